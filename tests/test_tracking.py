"""--report-to: MLflow and Weights & Biases runs, each read back from its local store; a missing extra is refused."""

import contextlib
import csv
import glob
import importlib.util
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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


def finetune_process(cwd: Path, *flags: str, env: dict) -> subprocess.CompletedProcess:
    """`finetune gemma` (SHORT) into cwd/run, in a fresh process as a shell starts it, with `env` added to this one's."""
    command = Path(sys.executable).with_name("finetune")
    args = [str(command), "gemma", *SHORT, *flags, "--output", "run"]
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env={**os.environ, **env}, timeout=300)


def check_mlflow_run(client, out: Path) -> None:
    """The MLflow run of the finished run in `out`, as `client` reads it: its steps, final metrics and adapter."""
    (run,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == metrics(out)["run_id"]
    assert run.data.params["lora.rank"] == "4"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss")) == list(range(1, 9))
    assert run.data.metrics["final.eval_loss"] == pytest.approx(metrics(out)["eval_loss"])
    assert "adapter.lora.h5" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert not (out / "mlruns").exists()  # the user's store, not the run directory's


def test_mlflow_logs_into_a_sqlite_store(tmp_path):
    """MLflow 3's recommended local store: mlflow-skinny reaches it through SQLAlchemy and alembic (the extra)."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = finetune_process(tmp_path, "--report-to", "mlflow", env={"MLFLOW_TRACKING_URI": uri})
    assert done.returncode == 0, done.stderr[-3000:]
    check_mlflow_run(MlflowClient(tracking_uri=uri), tmp_path / "run")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """The address of an `mlflow server` on 127.0.0.1 (sqlite behind it, artifacts in tmp_path), ended after.

    It needs the full mlflow (Flask and the rest that mlflow-skinny leaves out): this Python's, or the `mlflow` command
    FINETUNE_TEST_MLFLOW names (one installed apart, as `pip install mlflow` in a venv of its own); skipped without."""
    command = os.environ.get("FINETUNE_TEST_MLFLOW") or f"{sys.executable} -m mlflow"
    port = free_port()
    args = [*command.split(), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination", str(tmp_path / "server-artifacts")]  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    address = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            if server.poll() is not None:
                pytest.skip(f"mlflow server does not start here: {(tmp_path / 'server.log').read_text()[-300:]}")
            try:
                with urllib.request.urlopen(f"{address}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail(f"mlflow server did not answer in 2 minutes: {(tmp_path / 'server.log').read_text()[-1000:]}")
        yield address
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is gone when the server could not start
            os.killpg(server.pid, signal.SIGTERM)  # the server, its uvicorn and its job workers: the group it leads
        server.wait(timeout=60)
        log.close()


def test_mlflow_logs_to_a_tracking_server(tmp_path, mlflow_server):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    done = finetune_process(tmp_path, "--report-to", "mlflow", env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert done.returncode == 0, done.stderr[-3000:]
    check_mlflow_run(MlflowClient(tracking_uri=mlflow_server), tmp_path / "run")


@pytest.mark.parametrize(
    "store, fix",
    [
        ("file:{tmp}/store", "MLFLOW_ALLOW_FILE_STORE=true"),  # MLflow 3 refuses its file store unless opted in
        ("http://127.0.0.1:{port}", "start the tracking server"),  # nobody answers
        ("nonsense://store", "MLFLOW_TRACKING_URI takes sqlite:///"),
    ],
)
def test_a_store_mlflow_refuses_is_refused_before_anything_is_written(tmp_path, monkeypatch, store, fix):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # an in-process run sets it for its own mlruns/
    uri = store.format(tmp=tmp_path, port=free_port())
    env = {"MLFLOW_TRACKING_URI": uri}
    started = time.monotonic()
    done = finetune_process(tmp_path, "--report-to", "mlflow", env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert fix in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "unset MLFLOW_TRACKING_URI" in done.stderr and "loading" not in done.stdout  # before the model
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()
    assert time.monotonic() - started < 120


def test_a_password_in_the_store_address_is_never_shown(tmp_path):
    pytest.importorskip("mlflow")
    secret = "s3cret-pass"
    env = {"MLFLOW_TRACKING_URI": f"http://user:{secret}@127.0.0.1:{free_port()}"}
    done = finetune_process(tmp_path, "--report-to", "mlflow", env=env)
    assert done.returncode == 2 and secret not in done.stdout + done.stderr and "user:***@" in done.stderr


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
    """wandb_file_records once the run's exit record is written: W&B's service writes the file behind the run, so a
    read may meet a record half written (left for the next read)."""
    records = []
    for _ in range(60):
        records = wandb_file_records(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        time.sleep(0.5)
    return records


def wandb_file_records(run_dir):
    """The records of W&B's offline run file, in wandb's own protobuf: it ships no reader, so the file's LevelDB-log
    framing (32 KiB blocks of chunks with a 7-byte header: crc, length, type) is undone here."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, position, pending, records = open(path, "rb").read(), 7, b"", []  # 7: the file's own header
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (length, kind) == (0, 0):
            position += left
            continue
        if position + 7 + length > len(data):
            break  # the writer's last chunk, not all of it on disk yet
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(pending)
            except DecodeError:
                break  # a record whose bytes are not all written yet: the caller reads again
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
