import pytest

from finetune import outputs
from finetune.errors import UserError


def test_choose_dir(tmp_path):
    assert outputs.choose_dir(None, False).parent.name == "runs"
    assert outputs.choose_dir(str(tmp_path / "new"), False) == tmp_path / "new"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    assert outputs.choose_dir(str(tmp_path / "notes"), False) == tmp_path / "notes"  # no run in it yet
    (tmp_path / "notes" / "config.yaml").write_text("x")
    with pytest.raises(UserError, match="already holds a run"):
        outputs.choose_dir(str(tmp_path / "notes"), False)
    assert outputs.choose_dir(str(tmp_path / "notes"), True) == tmp_path / "notes"
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        outputs.choose_dir(str(tmp_path / "file"), True)
    with pytest.raises(UserError, match="not a writable directory"):
        outputs.choose_dir(str(tmp_path / "file" / "run"), False)


def test_writer_publishes_all_files_at_once_or_none(tmp_path):
    writer = outputs.RunWriter(tmp_path / "run")
    writer.path("metrics.json").write_text("{}")
    assert not (tmp_path / "run").exists()
    writer.publish()
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["metrics.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging left

    failed = outputs.RunWriter(tmp_path / "other")
    failed.path("config.yaml").write_text("x")
    failed.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_history_plot_and_summary(tmp_path):
    rows = [
        {"step": 0, "eval_loss": 3.0},
        {"step": 1, "epoch": 1, "train_loss": 2.5},
        {"step": 1, "epoch": 1, "eval_loss": 2.0, "eval_accuracy": 0.5},
    ]
    outputs.write_history(tmp_path / "h.csv", rows)
    lines = (tmp_path / "h.csv").read_text().splitlines()
    assert lines[0] == "step,epoch,train_loss,eval_loss,eval_accuracy" and lines[2] == "1,1,2.5,,"
    outputs.plot_loss(tmp_path / "loss.png", rows, "t")
    assert (tmp_path / "loss.png").stat().st_size > 1000
    metrics = dict(
        backend="jax",
        preset="tiny",
        rank=4,
        steps=1,
        train_loss=2.5,
        eval_loss_before=3.0,
        eval_loss=2.0,
        eval_perplexity=7.39,
        eval_accuracy=0.5,
        tokens_per_second=10.0,
        seconds=1.0,
        peak_memory_mb=100.0,
    )
    table = outputs.summary_table(metrics, tmp_path)
    assert "3.0000 -> 2.0000" in table and "jax" in table
