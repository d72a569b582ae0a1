"""What stops a run mid-training, from the loop (loop.py): SIGTERM, Ctrl-C, the time limit, NaN, out of memory.

Each stops with the last good checkpoint kept and nothing published. Runs that
must die are subprocesses (tests/fault_run.py sends the signal right after a
checkpoint); the rest run in-process through the CLI, on this process' backend.
"""

import time

import numpy as np
import pytest
from conftest import SHORT, invoke, run_with_fault, train, train_losses

from finetune.training import checkpoint, outputs, runs


@pytest.mark.backend_neutral  # Ctrl-C's handler, checked on every backend below
def test_sigterm_saves_a_checkpoint_and_exits_within_the_bound(tmp_path):
    out, mark = tmp_path / "term", tmp_path / "sent"
    result = run_with_fault(out, "SIGTERM", 2, mark=mark)
    ended = time.time()
    assert result.returncode == 143, result.stderr[-2000:]
    assert "SIGTERM" in result.stderr and "--resume" in result.stderr and "Traceback" not in result.stderr
    # It finishes the step under way, saves, and exits: the README promises one step plus a save.
    assert ended - float(mark.read_text()) < 30
    assert checkpoint.latest(out).step == 3 and not (out / "metrics.json").exists()
    assert outputs.read_status(out)["state"] == "stopped"


def test_ctrl_c_saves_a_checkpoint_and_exits_130_then_resumes(uninterrupted, tmp_path):
    out = tmp_path / "interrupted"
    result = run_with_fault(out, "SIGINT", 2)
    assert result.returncode == 130, result.stderr[-2000:]
    assert checkpoint.latest(out).step == 3 and not (out / "metrics.json").exists()
    train(out, "--resume")
    assert train_losses(out) == train_losses(uninterrupted)


@pytest.mark.backend_neutral
def test_the_time_limit_stops_with_a_checkpoint(tmp_path):
    out = tmp_path / "limited"
    result = invoke("gemma", *SHORT, "--time-limit", "1s", "--output", out)
    assert result.exit_code == 75, result.output
    assert "time limit" in result.stderr and "--resume" in result.stderr
    assert checkpoint.latest(out) is not None and not (out / "metrics.json").exists()


def test_a_nan_run_is_never_published(tmp_path):
    out = tmp_path / "nan"
    result = invoke("gemma", *SHORT, "--lr", "1e9", "--checkpoint-every", "1", "--output", out)
    assert result.exit_code == 2, result.output
    assert "diverged" in result.stderr and "--lr" in result.stderr and "Traceback" not in result.output
    assert not (out / "metrics.json").exists() and not (out / "adapter.lora.h5").exists()
    assert outputs.read_status(out)["state"] == "failed"
    good = checkpoint.latest(out)
    assert good is not None and all(np.isfinite(w).all() for w in checkpoint.load(good)[0])
    assert runs.describe(out)["state"] == "failed"


@pytest.mark.backend_neutral  # the divergence itself: the test above
def test_a_nan_run_before_any_checkpoint_leaves_nothing(tmp_path):
    out = tmp_path / "nan"
    result = invoke("gemma", *SHORT, "--lr", "1e9", "--checkpoint-every", "100", "--output", out)
    assert result.exit_code == 2 and "diverged" in result.stderr
    assert not out.exists()
    out.mkdir()  # the user's own directory: only what the run created goes
    (out / "notes.txt").write_text("mine")
    result = invoke("gemma", *SHORT, "--lr", "1e9", "--checkpoint-every", "100", "--output", out)
    assert result.exit_code == 2 and [p.name for p in out.iterdir()] == ["notes.txt"]


@pytest.mark.backend_neutral  # each backend's out-of-memory error is recognised in test_bad_inputs
def test_out_of_memory_mid_run_names_the_settings_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    import keras

    out, calls = tmp_path / "oom", []
    train_on_batch = keras.Model.train_on_batch

    def out_of_memory_at_step_3(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 bytes.")
        return train_on_batch(self, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "train_on_batch", out_of_memory_at_step_3)
    result = invoke("gemma", *SHORT, "--output", out)
    assert result.exit_code == 2, result.output
    message = result.stderr
    assert "out of memory at step 3 with batch 2, seq-len 64, rank 4" in message and "--batch-size" in message
    assert "checkpoint at step 2 is kept" in message and "Traceback" not in result.output
    assert checkpoint.latest(out).step == 2 and outputs.read_status(out)["state"] == "failed"


@pytest.mark.one_backend
@pytest.mark.parametrize("release", [True, False])
def test_a_run_that_asks_hands_freed_host_memory_back_after_each_micro_batch(release, monkeypatch):
    import os

    from test_evaluation import Order, Trainer

    from finetune.platform import backend
    from finetune.training import loop

    calls = []
    monkeypatch.setattr(backend, "release_freed_host_memory", lambda: calls.append(1) or True)
    hooks = loop.Hooks(loop.Evaluation(None), lambda progress: None, out=open(os.devnull, "w"))
    plan = loop.Plan(3, checkpoint_every=100, release_host_memory=release)
    loop.Loop(Trainer(), Order(), loop.Progress(), plan, hooks).run()
    assert len(calls) == (3 if release else 0)
