"""The TensorBoard log, read back from its event files by TensorBoard's own reader.

How the files are framed is test_events.py's.
"""

import types

import pytest
from conftest import tensorboard_scalars

from finetune.training import callbacks


@pytest.mark.backend_neutral
def test_tensorboard_log_writes_train_and_eval_tensorboard_scalars(tmp_path):
    board = callbacks.TensorBoardLog(tmp_path, types.SimpleNamespace(learning_rate=0.5))
    board.on_test_end({"step": 0, "loss": 3.0, "accuracy": 0.25, "perplexity": 20.0, "examples": 4})
    board.on_train_batch_end(1, {"loss": 2.5, "tokens": 100, "seconds": 0.5})
    board.on_train_batch_end(2, {"loss": 2.0, "tokens": 50, "seconds": 0.25, "learning_rate": 0.1, "grad_norm": 3.0})
    board.on_test_end({"loss": 1.5, "accuracy": 0.5, "perplexity": 4.5})  # after the last step trained
    board.on_train_end()
    train, held_out = tensorboard_scalars(tmp_path / "train"), tensorboard_scalars(tmp_path / "eval")
    assert train["loss"] == {1: 2.5, 2: 2.0} and train["grad_norm"] == {2: 3.0}
    assert train["learning_rate"] == {1: 0.5, 2: pytest.approx(0.1)}  # the step's own, where its logs name it
    assert train["tokens_per_second"] == {1: pytest.approx(200.0), 2: pytest.approx(200.0)}
    assert held_out == {"loss": {0: 3.0, 2: 1.5}, "accuracy": {0: 0.25, 2: 0.5}, "perplexity": {0: 20.0, 2: 4.5}}


@pytest.mark.backend_neutral
def test_a_resumed_log_hides_what_a_killed_session_logged_past_its_checkpoint(tmp_path):
    """Killed after step 5 with its checkpoint at step 3: the resumed session logs steps 4 and 5 again, and
    TensorBoard, reading the run's directory as its server does (plugin_event_accumulator), charts each step once,
    the resumed session's value."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as event_accumulator
    from tensorboard.util import tensor_util

    optimizer = types.SimpleNamespace(learning_rate=0.5)
    killed = callbacks.TensorBoardLog(tmp_path, optimizer)
    for step in range(1, 6):
        killed.on_train_batch_end(step, {"loss": float(step)})
    killed.on_train_end()
    resumed = callbacks.TensorBoardLog(tmp_path, optimizer, resumed_at=3)
    for step in range(4, 7):
        resumed.on_train_batch_end(step, {"loss": 10.0 + step})
    resumed.on_train_end()
    board = event_accumulator.EventAccumulator(str(tmp_path / "train"), size_guidance={event_accumulator.TENSORS: 0})
    board.Reload()
    charted = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in board.Tensors("loss")]
    assert charted == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]


def test_a_run_imports_its_backend_s_framework_alone(tmp_path, small_data, tiny_args, backend_name):
    """The CLI's run, from start to saved adapter, in its own process: no other framework is imported (keras-hub
    would import TensorFlow, 590 MiB, and keras JAX, 105 MiB, for nothing), nor nltk, which keras-hub's ROUGE
    scorer imports and a run that scores no ROUGE-L never uses (backend.DEFERRED_IMPORTS)."""
    import subprocess
    import sys

    code = (
        "import sys, runpy, atexit; sys.argv = sys.argv[1:]; "
        "atexit.register(lambda: print('LOADED', sorted(m for m in ('jax', 'tensorflow', 'torch', 'nltk') "
        "if sys.modules.get(m) is not None))); "
        "runpy.run_module('finetune', run_name='__main__')"
    )
    args = [
        "finetune",
        "gemma",
        *tiny_args,
        "--data",
        str(small_data),
        "--max-steps",
        "2",
        "--output",
        str(tmp_path / "r"),
    ]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"LOADED ['{backend_name}']" in done.stdout
    assert tensorboard_scalars(tmp_path / "r" / "tensorboard" / "train")["loss"]
