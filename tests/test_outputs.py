"""The run directory (outputs.py): checked before any work, claimed, published file by file, never lost to a
failed overwrite or taken by a second run."""

import json
import re

import pytest
import yaml
from conftest import SHORT, invoke, run_with_fault, train
from typer.testing import CliRunner

from finetune.cli import app
from finetune.platform.errors import UserError
from finetune.training import checkpoint, outputs, runs

pytestmark = (
    pytest.mark.backend_neutral
)  # the run directory's lifecycle is Python; exact resume is checked on every backend in test_checkpoint


def test_check_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert outputs.check_target(None, False, False).path.parent.name == "runs"
    assert outputs.check_target(str(tmp_path / "new"), False, False).path == tmp_path / "new"
    assert not (tmp_path / "new").exists() and not (tmp_path / "runs").exists()  # checks write nothing
    (tmp_path / "empty").mkdir()
    assert outputs.check_target(str(tmp_path / "empty"), False, False).path == tmp_path / "empty"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    with pytest.raises(UserError, match="not a finetune run and holds files"):  # a user's folder, not a run
        outputs.check_target(str(tmp_path / "notes"), False, False)
    assert outputs.check_target(str(tmp_path / "notes"), True, False).path == tmp_path / "notes"  # beside them
    (tmp_path / "notes" / "config.yaml").write_text("x")  # a user's own config.yaml is not a run either
    with pytest.raises(UserError, match="its config.yaml would be replaced"):
        outputs.check_target(str(tmp_path / "notes"), True, False)
    (tmp_path / "notes" / outputs.MARKER).write_text("{}")  # a run's directory: --overwrite replaces its files
    with pytest.raises(UserError, match="already holds a run"):
        outputs.check_target(str(tmp_path / "notes"), False, False)
    assert outputs.check_target(str(tmp_path / "notes"), True, False).path == tmp_path / "notes"
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        outputs.check_target(str(tmp_path / "file"), True, False)
    with pytest.raises(UserError, match="not a writable directory"):
        outputs.check_target(str(tmp_path / "file" / "run"), False, False)
    with pytest.raises(UserError, match="--output is empty"):
        outputs.check_target("", False, False)
    with pytest.raises(UserError, match="too long"):
        outputs.check_target(str(tmp_path / ("x" * 256)), False, False)
    with pytest.raises(UserError, match="--resume needs --output"):
        outputs.check_target(None, False, True)


def test_publish_writes_metrics_last_and_leaves_no_temporary_files(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text('{"old": true}')
    (run / "notes.txt").write_text("mine")
    written = []
    monkeypatch.setattr(outputs, "write_atomic", lambda path, write: (written.append(path.name), write(path)))
    outputs.publish(run, {"metrics.json": lambda p: p.write_text("{}"), "config.yaml": lambda p: p.write_text("x")})
    assert written == ["config.yaml", "metrics.json"]
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.json", "notes.txt"]


def test_a_failed_write_leaves_the_old_file(tmp_path):
    (tmp_path / "config.yaml").write_text("old")

    def half_written(path):
        path.write_text("new but cut")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        outputs.write_atomic(tmp_path / "config.yaml", half_written)
    assert (tmp_path / "config.yaml").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_free_space_is_checked_before_training(tmp_path):
    outputs.check_free_space(tmp_path / "run", 1024)
    with pytest.raises(UserError, match="MB free"):
        outputs.check_free_space(tmp_path / "run", 2**60)


def test_history_plot_and_summary(tmp_path):
    rows = [
        {"step": 0, "eval_loss": 3.0},
        {"step": 1, "epoch": 1, "train_loss": 2.5, "learning_rate": 0.01, "grad_norm": 0.5},
        {"step": 1, "epoch": 1, "eval_loss": 2.0, "eval_accuracy": 0.5},
    ]
    outputs.write_history(tmp_path / "h.csv", rows)
    lines = (tmp_path / "h.csv").read_text().splitlines()
    assert lines[0] == "step,epoch,train_loss,learning_rate,grad_norm,eval_loss,eval_accuracy"
    assert lines[2] == "1,1,2.5,0.01,0.5,," and lines[3] == "1,1,,,,2.0,0.5"
    outputs.plot_loss(tmp_path / "loss.png", rows, "t")
    assert (tmp_path / "loss.png").stat().st_size > 1000
    metrics = dict(
        backend="jax",
        device_name="gpu (NVIDIA L4)",
        dtype_policy="bfloat16",
        preset="tiny",
        rank=4,
        steps=1,
        train_loss=2.5,
        eval_loss_before=3.0,
        eval_loss=2.0,
        eval_perplexity=7.39,
        eval_accuracy=0.5,
        tokens_per_second=None,
        seconds=1.0,
        peak_memory_mb=100.0,
    )
    table = outputs.summary_table(metrics, tmp_path)
    assert "3.0000 -> 2.0000" in table and "jax" in table
    assert re.search(r"LoRA rank +\| 4\n", table)  # plain LoRA: the rank alone
    varied = outputs.summary_table({**metrics, "lora_variant": "DoRA, dropout 0.1, on an int4 base"}, tmp_path)
    assert "| 4, DoRA, dropout 0.1, on an int4 base" in varied
    assert "| gpu (NVIDIA L4), bfloat16" in table  # where it trained, and in what
    assert "n/a" in table  # one step in this session: nothing timed


@pytest.mark.parametrize("name", [n for n in outputs.OWN_NAMES if n not in (outputs.LOCK, outputs.MARKER)])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_users_file_with_a_run_files_name_is_never_replaced(tmp_path, name, overwrite):
    """Each of finetune's own names, as a user's file in a folder that is not a run: refused, left as it was."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / name).write_bytes(b"the user's own \x00 bytes")
    with pytest.raises(UserError, match="not a finetune run"):
        outputs.check_target(str(folder), overwrite, False)
    with pytest.raises(UserError, match="not a finetune run"):  # and again under the claim's lock
        outputs.claim(folder, default=False, overwrite=overwrite, resume=False)
    assert sorted(p.name for p in folder.iterdir()) == [name]  # no lock, no marker left behind
    assert (folder / name).read_bytes() == b"the user's own \x00 bytes"


def test_a_claimed_directory_is_marked_and_resume_needs_the_mark(tmp_path):
    claim = outputs.claim(tmp_path / "run", default=False, overwrite=False, resume=False)
    claim.release()
    assert outputs.is_run_directory(tmp_path / "run")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    with pytest.raises(UserError, match="not a finetune run directory"):
        outputs.check_target(str(tmp_path / "notes"), False, True)


def test_a_users_samples_and_history_are_left_as_they_were(tmp_path, tiny_args, small_data):
    """finetune gemma --output on a user's folder: refused, with or without --overwrite, while it holds files with
    a run file's name; a folder of other files takes the run beside them with --overwrite, theirs untouched."""
    notes = tmp_path / "notes"
    notes.mkdir()
    theirs = {"samples.md": b"# my own samples\n", "history.csv": b"date,weight\n2026-01-01,70\n"}
    for name, body in theirs.items():
        (notes / name).write_bytes(body)
    train = ["gemma", *tiny_args, "--data", str(small_data), "--max-steps", "1"]
    for overwrite in ([], ["--overwrite"]):
        result = CliRunner().invoke(app, [*train, "--output", str(notes), *overwrite])
        assert result.exit_code == 2, result.output
        assert "is not a finetune run" in result.stderr and len(result.stderr.strip().splitlines()) <= 2
        assert {p.name: p.read_bytes() for p in notes.iterdir()} == theirs
    (notes / "samples.md").rename(notes / "my-samples.md")
    (notes / "history.csv").rename(notes / "my-history.csv")
    result = CliRunner().invoke(app, [*train, "--output", str(notes), "--overwrite"])
    assert result.exit_code == 0, result.output + (result.stderr or "")
    assert (notes / "my-samples.md").read_bytes() == theirs["samples.md"]
    assert (notes / "my-history.csv").read_bytes() == theirs["history.csv"]
    added = {p.name for p in notes.iterdir()} - {"my-samples.md", "my-history.csv"}
    assert {"samples.md", "history.csv", outputs.MARKER} <= added <= set(outputs.OWN_NAMES), added


def test_overwrite_keeps_the_old_run_until_the_new_one_finishes(tmp_path):
    out = tmp_path / "run"
    train(out, "--max-steps", "2")
    before = (out / "adapter.lora.h5").read_bytes(), (out / "metrics.json").read_text()
    result = invoke("gemma", *SHORT, "--lr", "1e9", "--checkpoint-every", "1", "--overwrite", "--output", out)
    assert result.exit_code == 2 and "diverged" in result.stderr
    assert ((out / "adapter.lora.h5").read_bytes(), (out / "metrics.json").read_text()) == before
    train(out, "--overwrite", "--seed", "3")
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"] == 3
    assert {c.run_id for c in checkpoint.find(out)} == {metrics_run_id(out)}  # the old run's are gone


def test_an_overwrite_that_fails_before_its_first_checkpoint_leaves_the_old_run_as_it_was(tmp_path):
    """Not a file more or less: its TensorBoard logs were left beside the old run's."""
    out = tmp_path / "run"
    train(out, "--max-steps", "2")
    files = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != outputs.LOCK}
    # Diverged before its first checkpoint, at whichever step this machine's precision lets the loss turn NaN.
    result = invoke("gemma", *SHORT, "--lr", "1e9", "--checkpoint-every", "100", "--overwrite", "--output", out)
    assert result.exit_code == 2 and "diverged" in result.stderr
    assert {
        p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != outputs.LOCK
    } == files


def metrics_run_id(out):
    return yaml.safe_load((out / "config.yaml").read_text())["resolved"]["run_id"]


def test_a_run_config_used_as_a_recipe_never_replaces_the_run(uninterrupted, tmp_path):
    config = yaml.safe_load((uninterrupted / "config.yaml").read_text())
    assert config["output"] == {"dir": None, "overwrite": False, "report_to": ["tensorboard"]}
    result = invoke("gemma", "--recipe", uninterrupted / "config.yaml", "--output", uninterrupted)
    assert result.exit_code == 2 and "already holds a run" in result.stderr


def test_an_unfinished_run_is_not_restarted_by_accident(tmp_path):
    out = tmp_path / "run"
    assert run_with_fault(out, "SIGKILL", 2).returncode == -9
    result = invoke("gemma", *SHORT, "--output", out)
    assert result.exit_code == 2 and "checkpointed at step 2" in result.stderr and "--resume" in result.stderr


def test_two_runs_never_share_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = outputs.default_dir()
    first = outputs.claim(path, default=True, overwrite=False, resume=False)
    second = outputs.claim(path, default=True, overwrite=False, resume=False)  # the same second
    assert first.path != second.path and second.path.name == f"{path.name}-2"
    with pytest.raises(UserError, match="another finetune run is writing"):
        outputs.claim(first.path, default=False, overwrite=True, resume=False)
    busy = invoke("gemma", *SHORT, "--resume", "--output", first.path)  # refused before any model is built
    assert busy.exit_code == 2 and "another finetune run is writing" in busy.stderr
    assert runs.describe(first.path) is None  # a claim alone is not a run
    first.release()
    outputs.claim(first.path, default=False, overwrite=True, resume=False).release()


def test_a_second_fresh_run_into_the_same_new_directory_is_refused_at_once(tmp_path):
    """Two runs started together into one new --output: while the first is past its checks and not training yet
    (its evaluation before training; the directory not made), a second is refused before it reads its data, in a
    fresh process as typed, and writes nothing. Before, the directory's lock, taken once training starts, let it
    pass: both evaluated, and the second was refused after (outputs.Reservation)."""
    import subprocess
    import sys

    out = tmp_path / "run"
    command = [sys.executable, "-m", "finetune", "gemma", *SHORT, "--max-steps", "2", "--output", str(out)]
    with outputs.Reservation() as first:
        first.take(outputs.Target(out))  # as the first run holds it from its checks on
        second = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2 and "another finetune run is writing to" in second.stderr, second.stderr
        assert "read " not in second.stdout and "Traceback" not in second.stderr and not out.exists()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)  # let go of: the run is free
    assert done.returncode == 0 and json.loads((out / "metrics.json").read_text())["steps"] == 2, done.stderr


def _state(out) -> str:
    result = invoke("runs", out)
    assert result.exit_code == 0, result.output
    return result.output.splitlines()[1].split()[1]


def test_sigterm_while_publishing_stops_the_run_and_resume_publishes_it(tmp_path):
    out = tmp_path / "run"
    done = run_with_fault(out, "SIGTERM", "publish:adapter.lora.h5", "--max-steps", "2")
    assert done.returncode == 143, done.stderr[-2000:]
    assert "SIGTERM: stopped while writing the results of step 2" in done.stderr
    status = outputs.read_status(out)
    assert (status["state"], status["step"]) == ("stopped", 2) and checkpoint.latest(out).step == 2
    assert _state(out) == "stopped"
    assert not list(out.glob(".partial.*")) and not (out / outputs.METRICS).exists()
    train(out, "--max-steps", "2", "--resume")
    assert _state(out) == "finished" and outputs.read_status(out)["state"] == "finished"
    assert not list(out.glob(".partial.*"))


def test_a_kill_while_publishing_leaves_a_partial_file_that_resume_removes(tmp_path):
    out = tmp_path / "run"
    assert run_with_fault(out, "SIGKILL", "publish:adapter.lora.h5", "--max-steps", "2").returncode == -9
    assert (out / ".partial.adapter.lora.h5").exists() and _state(out) == "checkpointed"
    train(out, "--max-steps", "2", "--resume")
    assert _state(out) == "finished" and not list(out.glob(".partial.*"))
