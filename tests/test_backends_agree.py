"""The same recipe gives the same losses on JAX, PyTorch and TensorFlow.

Runs once, from the JAX suite: the other two backends run as subprocesses,
since Keras fixes its backend at its first import. Same seed, same batches,
LoRA factors drawn from one numpy generator: every logged loss agrees to 1%.

End to end, across the three backends: it mirrors no one module.
"""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import BACKEND

# float32: in bf16 (auto on a CPU with bf16 units) each backend's kernels round differently, and the
# held-out loss after six steps came out 2% apart; the agreement the issue asks for is float32's.
RUN = "--preset tiny --seq-len 64 --batch-size 2 --max-records 40 --max-steps 6 --precision float32".split()
RUN += ["--set", "train.samples=0"]


def losses(out):
    rows = list(csv.DictReader((out / "history.csv").open()))
    return [float(r["train_loss"] or r["eval_loss"]) for r in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run on each backend, each in its own process: backend -> run directory."""
    if BACKEND != "jax":
        pytest.skip("runs once, from the JAX suite, with the others in subprocesses")
    root, found = tmp_path_factory.mktemp("agree"), {}
    for backend in ("jax", "torch", "tensorflow"):
        found[backend] = root / backend
        args = [sys.executable, "-m", "finetune", "gemma", *RUN, "--backend", backend, "--output", str(found[backend])]
        env = {**os.environ, "KERAS_BACKEND": backend}
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    return found


def test_every_backend_logs_the_same_losses(runs):
    reference = losses(runs["jax"])
    assert len(reference) == 7  # six steps and the held-out loss after them
    for backend in ("torch", "tensorflow"):
        assert losses(runs[backend]) == pytest.approx(reference, rel=0.01), backend


LOGITS = """
import json, sys
import numpy as np
import finetune

lm = finetune.load(sys.argv[1], backend=sys.argv[2])
import keras

tokens = np.array([[2, 50, 61, 72, 83, 94, 105, 116, 5, 6, 7, 300]], dtype="int32")
x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens, dtype=bool)}
print("LOGITS " + json.dumps(keras.ops.convert_to_numpy(lm(x)).astype(float).tolist()))
"""


def test_an_adapter_trained_on_one_backend_gives_the_same_logits_on_the_others(runs):
    """Trained on torch, loaded on all three: an adapter is plain LoRA factors, and travels between backends."""
    run = runs["torch"]
    found = {}
    for backend in ("torch", "jax", "tensorflow"):
        done = subprocess.run([sys.executable, "-c", LOGITS, str(run), backend], capture_output=True, text=True,
                              env={**os.environ, "KERAS_BACKEND": backend}, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("LOGITS "))
        found[backend] = np.array(json.loads(line[7:]))
    assert np.abs(found["torch"]).max() > 1
    for backend in ("jax", "tensorflow"):
        np.testing.assert_allclose(found[backend], found["torch"], atol=1e-4, err_msg=backend)
