"""--report-to: MLflow and Weights & Biases runs, each read back from its local store; a missing extra is refused."""

import csv
import glob
import importlib.util
import json
import struct
import time

import pytest
from conftest import SHORT, invoke, run_with_fault, tensorboard_scalars, train

from finetune.training import tracking

pytestmark = pytest.mark.backend_neutral  # the trackers' writers are Python


def metrics(out):
    return json.loads((out / "metrics.json").read_text())


def test_mlflow_logs_params_steps_final_metrics_and_the_adapter(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    train(
        out, "--report-to", "tensorboard,mlflow", "--eval-every", "4", "--lr-schedule", "linear", "--warmup-steps", "2"
    )
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == metrics(out)["run_id"]
    assert run.data.params["lora.rank"] == "4" and run.data.params["eval.every"] == "4"
    train_loss = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in sorted(train_loss, key=lambda m: m.step)] == list(range(1, 9))
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")) == [0, 4, 8]
    assert run.data.metrics["final.eval_loss"] == pytest.approx(metrics(out)["eval_loss"])
    assert "adapter.lora.h5" in [a.path for a in client.list_artifacts(run.info.run_id)]
    # Each step's own learning rate, as history.csv has it (checked against transformers' schedules in
    # test_optimizer), in both trackers: warm-up and decay make every step's differ from the next one's.
    rows = csv.DictReader((out / "history.csv").open())
    rates = {int(r["step"]): float(r["learning_rate"]) for r in rows if r["train_loss"]}
    assert len(rates) == 8 and all(rates[step] != rates[step + 1] for step in range(1, 8))
    logged = client.get_metric_history(run.info.run_id, "train_learning_rate")
    assert {m.step: m.value for m in logged} == pytest.approx(rates, rel=1e-6)
    board = tensorboard_scalars(out / "tensorboard" / "train")
    assert board["learning_rate"] == pytest.approx(rates, rel=1e-6) and set(board["grad_norm"]) == set(rates)


def test_a_resumed_run_carries_on_its_mlflow_and_wandb_runs(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this test's own client, as a run sets it
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: not logged in, so offline
    out = tmp_path / "run"
    assert run_with_fault(out, "SIGKILL", 6, "--report-to", "mlflow,wandb").returncode == -9
    result = invoke("gemma", "--resume", "--output", out)  # --report-to is the run's: the checkpoint keeps it
    assert result.exit_code == 0, result.output + (result.stderr or "")
    assert not (out / "tensorboard").exists()
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])  # one run, not two
    assert run.info.status == "FINISHED" and run.info.run_name == metrics(out)["run_id"]
    steps = {m.step for m in client.get_metric_history(run.info.run_id, "train_loss")}
    assert steps == set(range(1, 9))  # the steps before the kill, and those after the resume
    assert run.data.params["lora.rank"] == "4"
    # W&B: a run file for each session, both of finetune's run id, which `wandb sync` makes one run.
    files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{metrics(out)['run_id']}.wandb") for f in files)


def wandb_records(run_dir):
    """wandb_file_records once the run's exit record is written: W&B's service writes the file behind the run."""
    for _ in range(60):
        records = wandb_file_records(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        time.sleep(0.5)
    return records


def wandb_file_records(run_dir):
    """The records of W&B's offline run file, in wandb's own protobuf: it ships no reader, so the file's LevelDB-log
    framing (32 KiB blocks of chunks with a 7-byte header: crc, length, type) is undone here."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, position, pending, records = open(path, "rb").read(), 7, b"", []  # 7: the file's own header
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (length, kind) == (0, 0):
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_runs_offline_and_logs_steps_summary_and_the_adapter(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: not logged in, so offline
    out = tmp_path / "run"
    train(out, "--report-to", "wandb")
    records = wandb_records(out)
    history = [{i.key or "/".join(i.nested_key): i.value_json for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]  # fmt: skip
    assert [int(h["_step"]) for h in history if "train/loss" in h] == list(range(1, 9))
    assert [int(h["_step"]) for h in history if "eval/loss" in h] == [0, 8]
    summary = {
        i.key: i.value_json for r in records if r.WhichOneof("record_type") == "summary" for i in r.summary.update
    }
    assert float(summary["eval_loss"]) == pytest.approx(metrics(out)["eval_loss"])
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert [c.path for a in artifacts for c in a.manifest.contents] == ["adapter.lora.h5"]
    assert not (out / "tensorboard").exists()


def test_a_key_is_never_written(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    secret = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("WANDB_MODE", "offline")  # logged in, but the test must not reach the network
    out = tmp_path / "run"
    result = train(out, "--report-to", "wandb", "--max-steps", "2")
    assert secret not in result.output
    for path in out.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_a_missing_extra_is_refused_before_anything_is_written(tmp_path, monkeypatch, tracker):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else find_spec(name, *a))
    out = tmp_path / "run"
    result = invoke("gemma", *SHORT, "--report-to", tracker, "--output", out)
    assert result.exit_code == 2 and f"pip install 'finetune[{tracker}]'" in result.stderr
    assert not out.exists()


def test_report_to_none_writes_no_logs(tmp_path):
    out = tmp_path / "run"
    train(out, "--report-to", "none", "--max-steps", "2")
    assert not (out / "tensorboard").exists() and (out / "metrics.json").is_file()


def test_flat_params():
    assert tracking.flat({"a": {"b": 1, "c": {"d": [2]}}, "e": None}) == {"a.b": 1, "a.c.d": [2], "e": None}
