"""What stops a run (loop.py): SIGTERM, Ctrl-C, the time limit, NaN, out of memory; Ctrl-C in every phase of a run.

Each stops with the last good checkpoint kept and nothing published; before training, with nothing written. Runs
that must die are subprocesses (tests/fault_run.py sends the signal right after a checkpoint, or from a finalizer;
interrupted_at sends it once the console shows a phase); the rest run in-process through the CLI, on this process'
backend.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import BACKEND, SHORT, invoke, make_records, run_with_fault, train, train_losses, write_jsonl

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
    assert "out of memory at step 3 with batch 2, seq-len 64, LoRA rank 4" in message and "--batch-size" in message
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


# === Ctrl-C at any moment of a run: a fresh `finetune gemma` process, sent SIGINT once its console shows a phase ===

RUN = [
    "--preset", "tiny", "--backend", BACKEND, "--seq-len", "64", "--batch-size", "2", "--max-records", "40",
    "--checkpoint-every", "2", "--set", "train.samples=1", "--set", "train.max_new_tokens=4",
]  # fmt: skip
PROMPT = (
    20  # seconds from the signal to the exit; measured 1-3 s on 2 busy CPU cores, the first step's compile included
)


def interrupted_at(out: Path, phase: str, *flags: str, delay: float = 0.0) -> tuple:
    """A fresh `finetune gemma` process (RUN) sent SIGINT `delay` seconds after a line of its console holds `phase`:
    (exit code, stdout, stderr, seconds from the signal to the exit; None if the line never came)."""
    command = Path(sys.executable).with_name("finetune")
    args = [str(command), "gemma", *RUN, *flags, "--output", str(out)]
    errors = out.with_name(f"{out.name}.stderr")
    with errors.open("w") as stderr:
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                   env={**os.environ, "KERAS_BACKEND": BACKEND})  # fmt: skip
        watchdog = threading.Timer(300, process.kill)
        watchdog.start()
        sent, lines = None, []
        for line in process.stdout:
            lines.append(line)
            if sent is None and phase in line:
                time.sleep(delay)
                process.send_signal(signal.SIGINT)
                sent = time.monotonic()
        code = process.wait()
        watchdog.cancel()
    seconds = time.monotonic() - sent if sent is not None else None
    return code, "".join(lines), errors.read_text(), seconds


def long_pass_flags(tmp_path: Path, phase: str) -> list:
    """3000 held-out records, or 3000 DPO pairs to score the reference of: on JAX on 2 CPU cores the evaluation
    before training, or the reference pass, lasts ~5 s, its compile included."""
    if "reference" in phase:
        prompts = [{"prompt": f"Say {i} twice.", "chosen": f"{i} {i}", "rejected": "no"} for i in range(3000)]
        pairs = write_jsonl(tmp_path / "pairs.jsonl", prompts)
        return ["--method", "dpo", "--data", str(pairs), "--max-records", "3000"]
    held_out = write_jsonl(tmp_path / "held-out.jsonl", make_records(3000))
    return ["--eval-data", str(held_out), "--eval-fraction", "0", "--max-records", "3000"]  # it caps --eval-data too


# (the console line to stop at, flags, what the stop keeps). Where the stop is taken is Python that does not branch on
# the backend, but what it interrupts is not: keras' evaluate() (where JAX lost a Ctrl-C), DPO's reference pass, a
# training step and keras-hub's generate() (where JAX crashed) run in every suite; loading the model is the same
# Python on every backend.
# Writing the results is left to test_outputs' publish faults: a tiny run writes them faster than a signal lands.
GENERATING = ["--max-steps", "4", "--set", "train.max_new_tokens=48"]  # a generation long enough to land in
PHASES = [
    pytest.param("] loading tiny", ["--max-steps", "4"], "nothing", id="loading", marks=pytest.mark.backend_neutral),
    pytest.param("] evaluating before training", ["--max-steps", "4"], "nothing", id="evaluating-before"),
    pytest.param("] scoring the reference", ["--max-steps", "4"], "nothing", id="dpo-reference"),
    # Raised inside generate() on JAX, the stop crashed the process as it exited (SIGSEGV) in about half the runs.
    pytest.param("samples before training", GENERATING, "nothing", id="generating-before"),
    pytest.param("] training steps", ["--max-steps", "200"], "a checkpoint", id="training"),
    pytest.param("samples after training", GENERATING, "the results", id="generating-after"),
]


@pytest.mark.parametrize("phase, flags, kept", PHASES)
def test_ctrl_c_in_every_phase_stops_the_run_promptly(tmp_path, phase, flags, kept):
    out = tmp_path / "run"
    long = phase.endswith(("evaluating before training", "scoring the reference"))
    flags = [*flags, *long_pass_flags(tmp_path, phase)] if long else flags
    code, stdout, stderr, seconds = interrupted_at(out, phase, *flags, delay=0.5 if long else 0.0)
    assert seconds is not None, f"no line held {phase!r}:\n{stdout}"
    assert code == 130 and seconds < PROMPT, (code, seconds, stdout[-2000:], stderr[-3000:])
    assert "Traceback" not in stderr
    if kept == "nothing":  # before training: no run directory at all, so nothing is published
        assert "stopped before training; nothing was written" in stderr, stderr[-2000:]
        assert not out.exists()
        return
    # Once training has begun: a checkpoint to resume from, nothing published, and the run marked stopped.
    assert not (out / "metrics.json").exists() and not (out / "adapter.lora.h5").exists()
    assert outputs.read_status(out)["state"] == "stopped" and "--resume" in stderr
    if kept == "a checkpoint":
        assert checkpoint.latest(out).step >= 1 and "Ctrl-C: stopped at step" in stderr, stderr[-2000:]
    else:  # the results of the last step were being written: its checkpoint writes them on --resume
        assert checkpoint.latest(out).step == 4 and "stopped while writing the results of step 4" in stderr


def test_a_ctrl_c_that_a_finalizer_swallows_still_stops_the_evaluation_before_training(tmp_path):
    """Python drops what a signal handler raises inside a `__del__`; keras' evaluate() on JAX runs enough of them
    that a Ctrl-C while evaluating before training was lost, and the run trained on. fault_run sends the signal from
    a finalizer just before that evaluation, so the handler's raise is lost every time: the record of the signal must
    stop the run after the evaluation's next batch, before its result is printed."""
    out = tmp_path / "run"
    result = run_with_fault(out, "SIGINT", "finalizer:evaluate")
    assert "Exception ignored in" in result.stderr  # the handler's raise was dropped, as it was in the wild
    assert result.returncode == 130, (result.stdout[-2000:], result.stderr[-3000:])
    assert "stopped before training; nothing was written" in result.stderr
    assert not re.search(r"eval loss \S+, accuracy \S+ before training", result.stdout)  # inside the evaluation
    assert not out.exists()
