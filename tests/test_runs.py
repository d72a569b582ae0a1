"""`finetune runs`: each run directory's state, from a finished run to a killed one (runs.py).

`finetune eval` and `generate` on a trained run are checked in test_train.py, on
its two-step run, and through the Python API in test_api.py.
"""

import types

import pytest
from conftest import SHORT, invoke, run_with_fault, runner

from finetune.cli import app
from finetune.training import checkpoint, loop, outputs, runs

pytestmark = pytest.mark.backend_neutral  # listing a run's state reads its files


def test_runs_lists_each_state(uninterrupted, tmp_path):
    parent = tmp_path / "all"
    parent.mkdir()
    assert run_with_fault(parent / "killed", "SIGKILL", 2).returncode == -9
    invoke("gemma", *SHORT, "--lr", "1e9", "--checkpoint-every", "1", "--output", parent / "diverged")
    result = runner.invoke(app, ["runs", str(parent)])
    assert result.exit_code == 0
    states = {line.split()[0].rsplit("/", 1)[-1]: line.split()[1] for line in result.output.splitlines()[1:]}
    assert states == {"killed": "checkpointed", "diverged": "failed"}
    result = runner.invoke(app, ["runs", str(uninterrupted)])
    assert "finished" in result.output and "8" in result.output


def test_a_stopped_run_s_note_ends_whole(tmp_path, monkeypatch):
    """The stop message runs past the note's 100 characters: it was cut mid-parenthesis, "to continue (; last
    checkpoint step 5"."""
    where = types.SimpleNamespace(progress=types.SimpleNamespace(step=5), total_steps=28)
    message = loop.Loop._stopped_message(where, "Ctrl-C")
    assert len(message) > 100
    run = tmp_path / "stopped"
    run.mkdir()
    outputs.write_status(run, "stopped", 5, message)
    monkeypatch.setattr(checkpoint, "find", lambda path, verify=False: [types.SimpleNamespace(step=5)])
    monkeypatch.setattr(checkpoint, "latest", lambda path: types.SimpleNamespace(step=5))
    row = runs.describe(run)
    assert row["state"] == "stopped" and row["note"] == (
        "Ctrl-C: stopped at step 5/28 with a checkpoint; rerun the same command with --resume to continue; "
        "last checkpoint step 5"
    )
    assert runs.short_note("word " * 40) == ("word " * 19).strip() + "…"
    assert runs.short_note("first line\nsecond") == "first line"


@pytest.mark.backend_neutral  # the listing reads files; checkpoints load on every backend: test_checkpoint.py
def test_runs_names_the_checkpoint_resume_would_load_and_says_where_none_can_be(tmp_path):
    """`finetune runs` read the checkpoints' sizes where --resume reads their checksums: a checkpoint with a byte
    changed was listed as the one to continue from, and a run whose every checkpoint was cut short as resumable."""
    out = tmp_path / "killed"
    assert run_with_fault(out, "SIGKILL", 4).returncode == -9  # checkpoints at steps 2 and 4
    steps = sorted(checkpoint.find(out), key=lambda c: c.step)
    assert [c.step for c in steps] == [2, 4]
    weights = steps[-1].path / "weights.npz"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size, another checksum
    weights.write_bytes(bytes(data))
    row = runs.describe(out)
    assert row["step"] == 2 and row["note"].endswith("last checkpoint step 2; a later checkpoint is damaged"), row
    for found in steps:
        (found.path / "weights.npz").write_bytes(b"cut")
    row = runs.describe(out)
    assert row["note"] == "no checkpoint can be loaded (damaged): --resume cannot continue it; --overwrite starts again"


def _finished(path, metrics='{"steps": 8, "eval_loss": 1.25}'):
    path.mkdir(parents=True)
    (path / "finetune-run.json").write_text('{"finetune": "0", "started": "today"}')
    (path / "metrics.json").write_text(metrics)
    return path


def test_a_finished_run_under_a_run_over_it_that_died_says_so(tmp_path, monkeypatch):
    """--overwrite over a finished run keeps its results until the new one finishes; killed, the new run left its
    status (running, its pid gone) and checkpoints, and the listing said finished alone."""
    run = _finished(tmp_path / "run")
    assert runs.describe(run)["note"] == ""
    outputs.write_status(run, "running", 105)
    monkeypatch.setattr(checkpoint, "find", lambda path, verify=False: [types.SimpleNamespace(step=100)])
    monkeypatch.setattr(checkpoint, "latest", lambda path: types.SimpleNamespace(step=100))
    row = runs.describe(run)
    assert row["state"] == "finished" and row["step"] == 8  # its results stand until the run over it finishes
    assert row["note"] == ("a run over it (--overwrite) was killed or lost at checkpoint step 100, which --resume "
                           "continues")  # fmt: skip
    outputs.write_status(run, "failed", 3, "diverged")
    monkeypatch.setattr(checkpoint, "find", lambda path, verify=False: [])
    assert runs.describe(run)["note"] == "a run over it (--overwrite) failed"


def test_a_broken_run_is_listed_beside_the_good_ones(tmp_path):
    parent = tmp_path / "all"
    _finished(parent / "a-good")
    _finished(parent / "b-null", "null")
    _finished(parent / "c-list", "[]")
    _finished(parent / "d-text-steps", '{"steps": "8", "eval_loss": 1.0}')
    _finished(parent / "e-deep", "[" * 100_000)
    (_finished(parent / "f-bad-status", "{}") / "metrics.json").unlink()
    (parent / "f-bad-status" / "status.json").write_text('{"state": ["running"], "step": 3}')
    (_finished(parent / "g-bad-marker") / "finetune-run.json").write_text("7")
    _finished(parent / "z-good")
    result = runner.invoke(app, ["runs", str(parent)])
    assert result.exit_code == 0, result.output
    lines = {line.split()[0].rsplit("/", 1)[-1]: line for line in result.output.splitlines()[1:]}
    assert "finished" in lines["a-good"] and "1.2500" in lines["a-good"] and "finished" in lines["z-good"]
    assert "broken: metrics.json is not an object (it holds null)" in lines["b-null"]
    assert "broken: metrics.json is not an object (it holds a list)" in lines["c-list"]
    assert "broken: metrics.json: steps must be an integer, got text" in lines["d-text-steps"]
    assert "broken: metrics.json is nested too deeply to read" in lines["e-deep"]
    assert "broken: status.json: state must be text, got a list" in lines["f-bad-status"]
    assert "broken: finetune-run.json is not an object (it holds a number)" in lines["g-bad-marker"]
