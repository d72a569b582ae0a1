"""The Python API in a real Jupyter kernel: a notebook built here and executed headless by nbclient.

It trains, evaluates and generates on the tiny model, is refused a second
backend, and is interrupted mid-training as the kernel's stop button does
(SIGINT to the kernel process). Its outputs must hold none of the frameworks'
log lines and no ipywidgets warning, the progress must be one updating line,
and the interrupt must stop training with a checkpoint. One backend runs it
(a kernel costs a few seconds, the notebook ~30 s); the API's backends are
checked everywhere else.

End to end, in a real kernel: it mirrors no one module.
"""

import os
import re

import pytest
from conftest import BACKEND, REPO

from finetune.platform import quiet

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="the notebook runs in the JAX suite only")
nbformat = pytest.importorskip("nbformat", reason="the notebook test needs pip install 'finetune[dev]'")
nbclient = pytest.importorskip("nbclient", reason="the notebook test needs pip install 'finetune[dev]'")
pytest.importorskip("ipykernel", reason="the notebook test needs pip install 'finetune[dev]'")

SETTINGS = "{'backend': 'jax', 'model.seq_len': 64, 'train.batch_size': 2, 'train.samples': 0, 'data.max_records': 40}"
CELLS = [
    ("import finetune\nsettings = " + SETTINGS, []),
    # The stop button while the first call still imports the frameworks: a KeyboardInterrupt raised inside an
    # import left jax half made, and every later call failed; the stop is taken once the imports are done.
    ("import os, signal, threading\n"
     "threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
     "finetune.run(finetune.load_config('tiny', {**settings, 'train.max_steps': 6, 'output.dir': 'early'}))",
     ["raises-exception"]),
    ("metrics = finetune.run(finetune.load_config('tiny', {**settings, 'train.max_steps': 6, 'output.dir': 'first'}))\n"
     "print('eval loss', round(metrics['eval_loss'], 3))", []),
    ("print('held out', sorted(finetune.evaluate('first')))", []),
    ("print('generated', finetune.generate('first', ['What is LoRA?'], max_new_tokens=4))", []),
    # Keras is loaded with JAX now: another backend is refused with a message, not a traceback.
    ("finetune.run(finetune.load_config('tiny', {**settings, 'backend': 'torch', 'output.dir': 'other'}))",
     ["raises-exception"]),
    # The stop button: SIGINT to the kernel process, once training has begun (the run's signals stop after a step).
    ("import os, signal, threading, time\n"
     "from finetune.training import loop\n"
     "def stop_button():\n"
     "    while loop.StopSignals.active is None or loop.StopSignals.active.at_once is not None:\n"
     "        time.sleep(0.005)\n"
     "    time.sleep(0.2)\n"
     "    os.kill(os.getpid(), signal.SIGINT)\n"
     "threading.Thread(target=stop_button, daemon=True).start()\n"
     "finetune.run(finetune.load_config('tiny', {**settings, 'train.epochs': 200, 'train.max_steps': 2000, 'output.dir': 'stopped'}))",
     ["raises-exception"]),
    ("from finetune.training import checkpoint\n"
     "print('checkpoints', [c.step for c in checkpoint.find('stopped')])", []),
]  # fmt: skip


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The executed notebook's cells."""
    where = tmp_path_factory.mktemp("notebook")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source, metadata={"tags": tags}) for source, tags in CELLS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("FINETUNE_VERBOSE", None)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # conftest's, which would hide the very lines checked for; a kernel lacks it
    client = nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(where)}}
    )
    client.execute(env=env)
    return where, notebook.cells


def text_of(cell) -> str:
    """Everything a cell showed: its streams, results and errors, as the notebook holds them."""
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type == "error":
            parts.append("\n".join(output.traceback))
        else:
            parts.append(str(output.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def test_the_notebook_shows_no_framework_log_line_and_no_widget_warning(executed):
    _, cells = executed
    for cell in cells:
        for line in text_of(cell).replace("\r", "\n").splitlines():
            assert not quiet.is_noise(line.encode()), line
            assert "IProgress not found" not in line and "ipywidgets" not in line, line
            assert "Warning" not in line, line  # the frameworks' Python warnings are filtered too


def test_it_trains_evaluates_and_generates(executed):
    _, cells = executed
    assert re.search(r"eval loss \d+\.\d+", text_of(cells[2]))
    assert "'loss'" in text_of(cells[3]) and "'perplexity'" in text_of(cells[3])
    assert re.search(r"generated \['.*'\]", text_of(cells[4]))


def test_progress_is_one_line_that_updates(executed):
    _, cells = executed
    text = text_of(cells[2])
    assert text.count("\rstep 6/6") == 1 and "\rstep 1/6" in text  # one line, rewritten by a carriage return
    # As a notebook shows it: a carriage return goes back to the start of the line.
    shown = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
    assert sum(line.startswith("step ") for line in shown) == 1, shown


def test_another_backend_is_refused_in_one_line(executed):
    _, cells = executed
    (error,) = [o for o in cells[5].outputs if o.output_type == "error"]
    assert error.ename == "UserError"
    assert error.traceback == [
        "UserError: keras is already loaded with the jax backend in this process, so torch cannot be chosen; "
        "choose jax instead, or restart the kernel and call finetune before importing keras"
    ]


def test_a_kernel_interrupt_stops_with_a_checkpoint(executed):
    where, cells = executed
    (error,) = [o for o in cells[6].outputs if o.output_type == "error"]
    assert error.ename == "RunStopped", error.traceback
    (message,) = error.traceback
    assert re.match(r"RunStopped: Ctrl-C: stopped at step (\d+)/2000 with a checkpoint", message), message
    step = int(re.search(r"step (\d+)/", message).group(1))
    assert f"checkpoints [{step}]" in text_of(cells[7])
    assert "saving a checkpoint after this step, then stopping" in text_of(cells[6])


def test_a_stop_while_the_first_call_imports_the_frameworks_leaves_the_kernel_usable(executed):
    """Nothing written, a RunStopped in one line, and every later cell runs (test_it_trains_evaluates_and_generates
    and the rest read them)."""
    where, cells = executed
    (error,) = [o for o in cells[1].outputs if o.output_type == "error"]
    assert error.ename == "RunStopped", error.traceback
    assert error.traceback == ["RunStopped: Ctrl-C: stopped before training; nothing was written, so rerunning the "
                               "same command starts it again"]  # fmt: skip
    assert not (where / "early").exists()
