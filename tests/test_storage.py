"""Remote run directories: gs:// through a local stand-in for Cloud Storage, and Vertex AI's directories.

The stand-in is an fsspec file system registered for the gs protocol that
keeps each "bucket" as a folder under a temporary directory, so no network
and no gcsfs are needed. Staging directories go to a temporary directory too.
"""

import importlib
import json
import os
import sys
import tempfile
import threading
import time
import types

import pytest
from conftest import BACKEND, tensorboard_scalars
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from typer.testing import CliRunner

from finetune.cli import app
from finetune.data import formats
from finetune.platform import storage
from finetune.platform.errors import UserError
from finetune.training import outputs

pytestmark = (
    pytest.mark.backend_neutral
)  # staging and copying are Python; exact resume is checked on every backend in test_checkpoint

runner = CliRunner()
SHORT = [
    "--preset", "tiny", "--backend", BACKEND, "--seq-len", "64", "--batch-size", "2", "--max-records", "40",
    "--max-steps", "2", "--set", "train.samples=1", "--set", "train.max_new_tokens=4",
]  # fmt: skip
REGISTRY = importlib.import_module("fsspec.registry")._registry  # fsspec.registry is its read-only view
RESULTS = {
    "config.yaml", "adapter.lora.h5", "adapter.json", "metrics.json", "history.csv", "samples.md", "loss.png",
    "status.json",
}  # fmt: skip


class LocalBucket(DirFileSystem):
    """gs://<bucket>/<path> kept at <root>/<bucket>/<path>; records what was uploaded, in order."""

    protocol = "gs"
    cachable = False
    root = None
    uploads: list = []
    read_only = False

    def __init__(self, **options):
        super().__init__(path=str(self.root), fs=LocalFileSystem(auto_mkdir=True))

    def put_file(self, lpath, rpath, **kwargs):
        LocalBucket.uploads.append(rpath)
        return super().put_file(lpath, rpath, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        if self.read_only:
            raise PermissionError(403, "caller does not have storage.objects.create access")
        return super().pipe_file(path, value, **kwargs)


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """The root of the stand-in Cloud Storage; gs://b is an empty bucket. Staging goes under tmp_path/tmp."""
    root = tmp_path / "gcs"
    (root / "b").mkdir(parents=True)
    monkeypatch.setattr(LocalBucket, "root", root)
    monkeypatch.setattr(LocalBucket, "uploads", [])
    monkeypatch.setattr(LocalBucket, "read_only", False)
    monkeypatch.setitem(REGISTRY, "gs", LocalBucket)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    for name in ("AIP_MODEL_DIR", "AIP_CHECKPOINT_DIR", "AIP_TENSORBOARD_LOG_DIR", "CLOUD_ML_TRIAL_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CLOUD_ML_HP_METRIC_TAG", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return root


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def train(*flags):
    result = invoke("gemma", *SHORT, *flags)
    assert result.exit_code == 0, result.output + (result.stderr or "")
    return result


def no_gs_folder(tmp_path):
    return not [p for p in tmp_path.rglob("*") if p.name.startswith("gs:")]


def test_remote_paths_are_told_from_local_ones():
    assert storage.is_remote("gs://bucket/runs/a") and storage.is_remote("memory://x")
    for local in ("runs/a", "/gcs/bucket/runs/a", "./gs:", "C:/runs", "", None):
        assert not storage.is_remote(local), local
    assert storage.is_staged("/gcs/bucket/runs/a") and storage.is_staged("gs://bucket/runs/a")
    assert not storage.is_staged("/gcsx/runs/a") and not storage.is_staged("runs/a")


def test_a_cloud_storage_fuse_output_is_staged_and_copied_in(bucket, tmp_path, monkeypatch):
    mount = tmp_path / "gcs-mount"
    (mount / "b").mkdir(parents=True)
    monkeypatch.setattr(storage, "FUSE_MOUNT", mount)
    out = str(mount / "b" / "runs" / "a")
    target = outputs.check_target(out, False, False)
    assert target.mirror.url == out and str(target) == out
    assert target.path.is_relative_to(tmp_path / "tmp")  # a local disk: locks and renames work
    held = outputs.claim(target.path, default=False, overwrite=False, resume=False, mirror=target.mirror)
    outputs.publish(
        target.path, {"metrics.json": lambda p: p.write_text("{}"), "config.yaml": lambda p: p.write_text("x")}
    )
    held.publish_remote()
    held.release()
    assert sorted(p.name for p in (mount / "b" / "runs" / "a").iterdir()) == [
        "config.yaml",
        "finetune-run.json",
        "metrics.json",
    ]
    assert not target.path.exists()
    with pytest.raises(UserError, match="already holds a run"):
        outputs.check_target(out, False, False)


def test_gs_without_gcsfs_names_the_extra(monkeypatch):
    try:
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed")
    except ImportError:
        pass
    monkeypatch.delitem(REGISTRY, "gs", raising=False)
    with pytest.raises(UserError, match=r'pip install "finetune\[gcs\]"'):
        storage.filesystem("gs://bucket/runs/a")
    with pytest.raises(UserError, match="cannot use nope://x"):
        storage.filesystem("nope://x")


def test_data_in_a_bucket_is_read_in_every_container(bucket, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"{i} plus 1 is", "completion": f" {i + 1}."} for i in range(3)]
    (bucket / "b" / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (bucket / "b" / "d.json").write_text(json.dumps(rows))
    (bucket / "b" / "d.csv").write_text(
        "prompt,completion\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in rows)
    )
    pq.write_table(pa.Table.from_pylist(rows), bucket / "b" / "d.parquet")
    local = formats.read(str(bucket / "b" / "d.jsonl"))
    assert local[1] == "completion"
    for name in ("d.jsonl", "d.json", "d.csv", "d.parquet"):
        assert formats.read(f"gs://b/{name}") == local, name
    with pytest.raises(
        UserError, match="could not read gs://b/none.jsonl: .*; check the path and your GCS credentials"
    ):
        formats.read("gs://b/none.jsonl")
    result = invoke("data", "gs://b/d.parquet", "--preset", "tiny", "--seq-len", "32")
    assert result.exit_code == 0, result.output + (result.stderr or "")
    assert "format: completion (prompt, completion), 3 records" in result.output
    assert result.output.rstrip().endswith("0 plus 1 is« 1.<eos>»")


def test_mirror_sends_changes_manifest_and_metrics_last_and_prunes_when_final(bucket, tmp_path):
    local = tmp_path / "run"
    (local / "checkpoints" / "step-1").mkdir(parents=True)
    for name in ("checkpoints/step-1/manifest.json", "checkpoints/step-1/weights.npz", "metrics.json", "a.txt"):
        (local / name).write_text(name)
    (local / ".lock").write_text("")
    (bucket / "b" / "run" / "checkpoints" / "old").mkdir(parents=True)
    (bucket / "b" / "run" / "checkpoints" / "old" / "manifest.json").write_text("a replaced run's")
    mirror = storage.Mirror(local, "gs://b/run", last=("metrics.json", "manifest.json"), prune="checkpoints")
    mirror.push()
    sent = [u.split("b/run/")[1] for u in LocalBucket.uploads]
    assert sorted(sent[:2]) == ["a.txt", "checkpoints/step-1/weights.npz"]
    assert sorted(sent[2:]) == ["checkpoints/step-1/manifest.json", "metrics.json"]
    assert not (bucket / "b" / "run" / ".lock").exists()  # hidden files (locks, partial writes) stay local
    LocalBucket.uploads.clear()
    mirror.push()
    assert LocalBucket.uploads == []  # nothing changed
    (local / "a.txt").write_text("changed")
    (local / "checkpoints" / "step-1" / "weights.npz").unlink()
    mirror.push()
    assert [u.split("b/run/")[1] for u in LocalBucket.uploads] == ["a.txt"]
    assert not (bucket / "b" / "run" / "checkpoints" / "step-1" / "weights.npz").exists()
    assert (bucket / "b" / "run" / "checkpoints" / "old" / "manifest.json").exists()  # until the run is final
    mirror.push(final=True)
    assert not list((bucket / "b" / "run" / "checkpoints" / "old").glob("*"))


def test_pull_copies_the_remote_checkpoints_and_keeps_local_ones(bucket, tmp_path):
    remote = bucket / "b" / "run"
    (remote / "checkpoints" / "step-2").mkdir(parents=True)
    (remote / "checkpoints" / "step-2" / "manifest.json").write_text("two")
    local = tmp_path / "staging"
    (local / "checkpoints" / "step-1").mkdir(parents=True)
    (local / "checkpoints" / "step-1" / "manifest.json").write_text("one, never copied out")
    (local / "metrics.json").write_text("published here, not in the bucket")
    mirror = storage.Mirror(local, "gs://b/run")
    mirror.pull("checkpoints", names=("metrics.json",))
    assert (local / "checkpoints" / "step-2" / "manifest.json").read_text() == "two"
    assert (local / "checkpoints" / "step-1" / "manifest.json").exists()
    assert not (local / "metrics.json").exists()  # so a resume publishes to the bucket again
    mirror.push()
    assert [u.split("b/run/")[1] for u in LocalBucket.uploads] == ["checkpoints/step-1/manifest.json"]


def test_an_unwritable_bucket_is_refused_before_anything_is_written(bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(LocalBucket, "read_only", True)
    result = invoke("gemma", *SHORT, "--output", "gs://b/runs/a")
    assert result.exit_code == 2
    assert "cannot write to gs://b/runs/a" in result.stderr and len(result.stderr.strip().splitlines()) <= 2
    assert not any(bucket.rglob("*.*")) and not any((tmp_path / "tmp").iterdir()) and not any(tmp_path.glob("cwd/*"))
    assert "loading" not in result.output  # refused before the model was built


def test_a_finished_remote_run_is_refused_without_overwrite(bucket):
    (bucket / "b" / "runs" / "a").mkdir(parents=True)
    (bucket / "b" / "runs" / "a" / "metrics.json").write_text("{}")
    result = invoke("gemma", *SHORT, "--output", "gs://b/runs/a")
    assert result.exit_code == 2 and "gs://b/runs/a already holds a run" in result.stderr
    (bucket / "b" / "runs" / "a" / "metrics.json").unlink()
    (bucket / "b" / "runs" / "a" / "checkpoints" / "step-00000003-abcd").mkdir(parents=True)
    (bucket / "b" / "runs" / "a" / "checkpoints" / "step-00000003-abcd" / "manifest.json").write_text("{}")
    result = invoke("gemma", *SHORT, "--output", "gs://b/runs/a")
    assert result.exit_code == 2 and "checkpointed at step 3" in result.stderr


def test_a_gs_run_is_staged_then_copied_with_metrics_last_and_resumes_from_the_bucket(bucket, tmp_path):
    train("--output", "gs://b/runs/a", "--checkpoint-every", "1")
    remote = bucket / "b" / "runs" / "a"
    sent = [u.split("runs/a/")[1] for u in LocalBucket.uploads]
    first_checkpoint = next(i for i, name in enumerate(sent) if name.endswith("manifest.json"))
    assert "step-00000001-" in sent[first_checkpoint] and first_checkpoint < sent.index("adapter.lora.h5")
    assert RESULTS | {"checkpoints", "tensorboard", "finetune-run.json"} == {p.name for p in remote.iterdir()}
    assert LocalBucket.uploads[-1].endswith("runs/a/metrics.json")  # the run is finished remotely only when whole
    assert no_gs_folder(tmp_path)
    assert not any((tmp_path / "tmp" / "finetune-staging").iterdir())  # staging is gone once published
    metrics = json.loads((remote / "metrics.json").read_text())
    assert metrics["steps"] == 2
    assert json.loads((remote / "status.json").read_text())["state"] == "finished"
    train_log, eval_log = (
        tensorboard_scalars(remote / "tensorboard" / "train"),
        tensorboard_scalars(remote / "tensorboard" / "eval"),
    )
    assert {"loss", "learning_rate", "tokens_per_second"} <= set(train_log) and set(train_log["loss"]) == {1, 2}
    assert eval_log["loss"] == pytest.approx({0: metrics["eval_loss_before"], 2: metrics["eval_loss"]})

    train("--output", "gs://b/runs/a", "--resume", "--max-steps", "3")
    metrics = json.loads((remote / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 2 and metrics["steps"] == 3  # the checkpoint came from the bucket
    assert no_gs_folder(tmp_path)


def test_vertex_directories_and_tuning_metric(bucket, tmp_path, monkeypatch):
    reported = []

    class HyperTune:
        def report_hyperparameter_tuning_metric(self, **kwargs):
            reported.append(kwargs)

    monkeypatch.setitem(sys.modules, "hypertune", types.SimpleNamespace(HyperTune=HyperTune))
    monkeypatch.setenv("AIP_MODEL_DIR", "gs://b/job/model")
    monkeypatch.setenv("AIP_CHECKPOINT_DIR", "gs://b/job/checkpoints")
    monkeypatch.setenv("AIP_TENSORBOARD_LOG_DIR", "gs://b/job/logs")
    monkeypatch.setenv("CLOUD_ML_TRIAL_ID", "7")
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_TAG", "loss")
    train()
    job = bucket / "b" / "job"
    assert RESULTS <= {p.name for p in (job / "model").iterdir()}
    assert list((job / "checkpoints").glob("step-00000002-*/manifest.json"))
    assert list((job / "logs" / "train").glob("events.out.tfevents.*"))
    metrics = json.loads((job / "model" / "metrics.json").read_text())
    assert reported == [{"hyperparameter_metric_tag": "loss", "metric_value": metrics["eval_loss"], "global_step": 2}]
    assert no_gs_folder(tmp_path) and not (tmp_path / "cwd" / "runs").exists()


def test_a_directory_without_flock_is_still_claimed(tmp_path, monkeypatch, capsys):
    def no_flock(*args):
        raise OSError(38, "Function not implemented")  # gcsfuse

    monkeypatch.setattr(outputs.fcntl, "flock", no_flock)
    held = outputs.claim(tmp_path / "run", default=False, overwrite=False, resume=False)
    held.release()
    assert "cannot be locked" in capsys.readouterr().out and (tmp_path / "run").is_dir()


def test_a_failed_copy_during_training_is_a_note(bucket, tmp_path, monkeypatch, capsys):
    def unreachable(self, lpath, rpath, **kwargs):
        raise OSError("Cloud Storage is unreachable")

    mirror = storage.Mirror(tmp_path / "run", "gs://b/run")
    held = outputs.claim(tmp_path / "run", default=False, overwrite=False, resume=False, mirror=mirror)
    (tmp_path / "run" / "status.json").write_text("{}")
    monkeypatch.setattr(LocalBucket, "put_file", unreachable)
    held.sync()  # training goes on; the next checkpoint tries again
    held.release()
    assert "could not copy" in capsys.readouterr().out and (tmp_path / "run").is_dir()


def test_a_staged_run_never_copied_out_is_not_discarded_by_a_new_run(bucket):
    """An upload that failed leaves the run staged; a new run to that URL must not silently delete it."""
    staging = storage.staging_dir("gs://b/runs/lost")
    staging.mkdir(parents=True)
    (staging / outputs.METRICS).write_text("{}")
    with pytest.raises(UserError, match="never copied there; pass --resume"):
        outputs.check_target("gs://b/runs/lost", overwrite=False, resume=False)
    assert (staging / outputs.METRICS).exists()
    outputs.check_target("gs://b/runs/lost", overwrite=True, resume=False)  # --overwrite discards it
    assert not staging.exists()


# === Output paths: one check before any work (storage.check_output) ===


def test_an_output_file_is_refused_where_a_folder_is(tmp_path):
    with pytest.raises(UserError, match=r"--json .* is a folder; name the file to write"):
        storage.check_output(str(tmp_path), "--json")
    storage.check_output(str(tmp_path / "rows.json"), "--json")  # a file in it is fine


def test_an_output_directory_is_refused_where_a_file_is(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file, not a directory"):
        storage.check_output(str(tmp_path / "file"), "--output", directory=True)
    with pytest.raises(UserError, match="not a writable directory"):  # a file on the way
        storage.check_output(str(tmp_path / "file" / "run"), "--output", directory=True)
    storage.check_output(str(tmp_path / "new" / "deeper"), "--output", directory=True)  # made with its parents
    assert not (tmp_path / "new").exists()


def test_an_output_through_a_link_to_nothing_is_refused_before_the_work(tmp_path):
    """A run's --output that is a dangling link passed every check, trained its evaluation and samples, then failed
    to make the directory (FileExistsError, exit 1)."""
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for output in (tmp_path / "dangling", tmp_path / "dangling" / "run"):
        with pytest.raises(UserError, match=r"dangling is a link to .*gone, which does not exist; create it"):
            storage.check_output(str(output), "--output", directory=True)
    (tmp_path / "gone").mkdir()
    storage.check_output(str(tmp_path / "dangling"), "--output", directory=True)  # a link to a folder is fine


def test_an_output_file_needs_its_folder(tmp_path):
    with pytest.raises(UserError, match="its folder does not exist"):
        storage.check_output(str(tmp_path / "missing" / "rows.json"), "--json")


def test_an_output_nobody_may_write_is_refused(read_only_dir):
    with pytest.raises(UserError, match=r"read-only is not a writable directory; pass another --plot"):
        storage.check_output(str(read_only_dir / "bench.png"), "--plot")
    with pytest.raises(UserError, match="not a writable directory"):
        storage.check_output(str(read_only_dir / "runs" / "a"), "--output", directory=True)


def test_an_output_name_the_file_system_refuses_is_refused(tmp_path):
    with pytest.raises(UserError, match="256 bytes, too long for the file system"):
        storage.check_output(str(tmp_path / ("r" * 256)), "--output", directory=True)
    storage.check_output(str(tmp_path / ("r" * 255)), "--output", directory=True)
    with pytest.raises(UserError, match=r"too long .* \(at most 245 here\)"):  # temporary names beside it
        storage.check_output(str(tmp_path / ("r" * 250)), "--output", directory=True, beside=10)
    with pytest.raises(UserError, match="too long for the file system"):  # an over-long name on the way
        storage.check_output(str(tmp_path / ("é" * 200) / "rows.json"), "--json")
    deep = tmp_path.joinpath(*["d" * 200] * 21)  # each name fits, the path does not
    with pytest.raises(UserError, match="too long a path for the file system; pass a shorter --output"):
        storage.check_output(str(deep), "--output", directory=True)


def test_a_url_is_left_to_its_file_system():
    storage.check_output("gs://bucket/" + "x" * 300, "--output", directory=True)
    with pytest.raises(UserError, match="--json is empty"):
        storage.check_output(" ", "--json")


def test_a_run_in_a_bucket_is_evaluated_generated_exported_and_published_from_it(bucket, tmp_path):
    """eval, generate, export and publish take --run gs://...: the run's own files, copied from the bucket (not
    its checkpoints), and copied again when the run there is trained anew."""
    train("--output", "gs://b/runs/a")
    remote = bucket / "b" / "runs" / "a"
    result = invoke("eval", "--run", "gs://b/runs/a")
    assert result.exit_code == 0, result.output + result.stderr
    metrics = json.loads((remote / "metrics.json").read_text())
    loss = float(result.stdout.split("eval_loss ")[1].split()[0])
    assert loss == pytest.approx(metrics["eval_loss"], abs=1e-4)
    assert "read gs://b/runs/a" in result.stderr
    result = invoke("generate", "--run", "gs://b/runs/a/", "--prompt", "Say hi", "--max-new-tokens", "3")
    assert result.exit_code == 0 and result.stdout.strip(), result.output + result.stderr
    result = invoke("export", "--run", "gs://b/runs/a", "--format", "lora", "--output", tmp_path / "exported")
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads((tmp_path / "exported" / "finetune-export.json").read_text())["run"] == "gs://b/runs/a"
    result = invoke("publish", "--run", "gs://b/runs/a", "--to", "hf://someone/tiny", "--dry-run")
    assert result.exit_code == 0, result.output + result.stderr
    (copy,) = [p for p in (tmp_path / "tmp").glob("finetune-fetched-*/*") if p.is_dir()]  # beside: its lock
    assert {p.name for p in copy.iterdir() if not p.name.startswith(".")} == {
        p.name for p in remote.iterdir() if p.is_file()
    }  # the run's files; its checkpoints and logs stay in the bucket
    train("--output", "gs://b/runs/a", "--overwrite", "--seed", "7")  # the same sizes, other factors
    assert invoke("eval", "--run", "gs://b/runs/a").exit_code == 0
    assert (copy / "adapter.lora.h5").read_bytes() == (remote / "adapter.lora.h5").read_bytes()


def test_a_bucket_path_that_holds_no_finished_run_is_refused(bucket, tmp_path):
    for run, said in [("gs://b/none", "gs://b/none does not exist"),
                      ("gs://b/half", "gs://b/half has no config.yaml, so it is not a finished run")]:  # fmt: skip
        (bucket / "b" / "half").mkdir(exist_ok=True)
        (bucket / "b" / "half" / "status.json").write_text('{"state": "running"}')
        result = invoke("eval", "--run", run)
        assert result.exit_code == 2 and said in result.stderr, result.output + result.stderr
        assert "Traceback" not in result.output + result.stderr


def test_runs_lists_a_bucket_as_it_lists_a_local_directory_without_fetching_weights(bucket, tmp_path, monkeypatch):
    """`finetune runs gs://...`: each run's state from its status, metrics and checkpoints' manifests, as the same
    directory lists on disk; no weights are fetched. A run whose status says running is running (no lock there)."""
    import shutil

    train("--output", "gs://b/runs/a", "--checkpoint-every", "1")
    runs_dir = bucket / "b" / "runs"
    shutil.copytree(runs_dir / "a" / "checkpoints", runs_dir / "c" / "checkpoints")
    (runs_dir / "c" / "status.json").write_text('{"state": "running", "step": 1}')
    (runs_dir / "d").mkdir()
    (runs_dir / "d" / "status.json").write_text('{"state": "stopped", "step": 0, "message": "stopped by hand"}')
    fetched = []
    get_file = LocalBucket.get_file
    monkeypatch.setattr(
        LocalBucket, "get_file", lambda self, rpath, lpath, **k: fetched.append(rpath) or get_file(self, rpath, lpath)
    )
    local = invoke("runs", runs_dir)
    remote = invoke("runs", "gs://b/runs/")
    assert local.exit_code == 0 and remote.exit_code == 0, remote.output + remote.stderr
    assert fetched and all(p.rsplit("/", 1)[-1] in ("status.json", "metrics.json", "finetune-run.json",
                                                    "manifest.json") for p in fetched)  # fmt: skip
    rows = {line.split()[0]: line.split(None, 1)[1] for line in remote.stdout.splitlines()[1:] if line.strip()}
    assert set(rows) == {"gs://b/runs/a", "gs://b/runs/c", "gs://b/runs/d"}
    for name in ("a", "d"):  # as the same folder lists on disk
        (on_disk,) = [line for line in local.stdout.splitlines() if line.startswith(str(runs_dir / name))]
        assert on_disk.split(None, 1)[1].split() == rows[f"gs://b/runs/{name}"].split()
    assert rows["gs://b/runs/a"].split()[:2] == ["finished", "2"]
    assert rows["gs://b/runs/c"].startswith("running") and "its job's state says which" in rows["gs://b/runs/c"]
    assert "checkpointed" in [line for line in local.stdout.splitlines() if "/c " in line or "/c  " in line][0]
    result = invoke("runs", "gs://b/none")
    assert result.exit_code == 2 and "gs://b/none is not a directory" in result.stderr
    assert not list((tmp_path / "tmp").glob("finetune-listed-*"))  # the stand-ins are gone


def test_a_bucket_run_read_past_a_failure_or_a_file_path_is_refused_with_nothing_half_copied(bucket, monkeypatch):
    """A download that fails midway, a URL of one of the run's files, and a run without metrics.json (being
    written) are exit 2 with one line; no partial file stays in the copy."""
    train("--output", "gs://b/runs/a")
    result = invoke("eval", "--run", "gs://b/runs/a/config.yaml")
    assert result.exit_code == 2 and "gs://b/runs/a/config.yaml is a file; pass the run's directory" in result.stderr

    def broken(self, rpath, lpath, **kwargs):
        with open(lpath, "wb") as f:
            f.write(b"half")
        raise ConnectionError("connection reset by peer")

    get_file = LocalBucket.get_file
    monkeypatch.setattr(LocalBucket, "get_file", broken)
    result = invoke("eval", "--run", "gs://b/runs/a")
    assert result.exit_code == 2 and "cannot copy gs://b/runs/a to " in result.stderr, result.output
    assert "connection reset by peer" in result.stderr and "Traceback" not in result.output + result.stderr
    (copy,) = [p for p in (bucket.parent / "tmp").glob("finetune-fetched-*/*") if p.is_dir()]
    assert not [p for p in copy.iterdir() if p.name.startswith(".partial")]
    monkeypatch.setattr(LocalBucket, "get_file", get_file)
    (bucket / "b" / "runs" / "a" / "metrics.json").unlink()
    result = invoke("eval", "--run", "gs://b/runs/a")
    assert result.exit_code == 2 and "gs://b/runs/a has no metrics.json, so it is not a finished run" in result.stderr


def test_two_readers_of_a_bucket_run_at_once_take_turns(bucket, monkeypatch):
    """Two processes fetching the same run (a notebook's eval beside a generate) take turns: neither clears the
    other's file in flight (the second's cleanup removed the first's half-copied file, which failed its rename)."""
    train("--output", "gs://b/runs/a")
    get_file, first = LocalBucket.get_file, threading.Event()

    def slow_first(self, rpath, lpath, **kwargs):
        get_file(self, rpath, lpath, **kwargs)
        if not first.is_set():  # the first copy of the first reader waits, written, for the other to run
            first.set()
            time.sleep(1.0)

    monkeypatch.setattr(LocalBucket, "get_file", slow_first)
    found, errors = [], []

    def read():
        try:
            found.append(storage.fetched("gs://b/runs/a", ("config.yaml", "metrics.json", "adapter.json")))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(2)]
    threads[0].start()
    first.wait(10)
    threads[1].start()
    for thread in threads:
        thread.join(30)
    assert not errors and len(found) == 2 and found[0] == found[1]
    names = {p.name for p in found[0].iterdir()}
    assert names == {".fetched.json", "adapter.json", "config.yaml", "metrics.json"}


def test_a_copy_not_fetched_for_a_week_is_removed_at_the_next_fetch(bucket, monkeypatch):
    """A --full run's copy holds its weights: copies of other URLs last fetched UNUSED_DAYS ago go at the next
    fetch, unless another process holds them (being fetched); a recent one stays."""
    fcntl = pytest.importorskip("fcntl")
    train("--output", "gs://b/runs/a")
    train("--output", "gs://b/runs/b")
    names = ("config.yaml", "metrics.json")
    stale, recent = storage.fetched("gs://b/runs/a", names), storage.fetched("gs://b/runs/b", names)
    week = time.time() - storage.UNUSED_DAYS * 86400 - 60
    os.utime(stale / ".fetched.json", (week, week))
    held = open(stale.parent / f"{stale.name}.lock", "a")
    fcntl.flock(held, fcntl.LOCK_EX)
    storage.fetched("gs://b/runs/b", names)
    assert stale.is_dir()  # held by another reader: left
    fcntl.flock(held, fcntl.LOCK_UN)
    held.close()
    storage.fetched("gs://b/runs/b", names)
    assert not stale.exists() and (recent / "config.yaml").is_file()
    assert (storage.fetched("gs://b/runs/a", names) / "metrics.json").is_file()  # fetched anew when asked again


def test_finetune_gemma_as_typed_refuses_an_output_through_a_link_to_nothing(tmp_path):
    """The installed command, in a fresh process: exit 2 and one line before anything loads, nothing made where the
    link points (it was exit 1 after the first evaluation)."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    command = [str(Path(sys.executable).with_name("finetune")), "gemma", "--preset", "tiny", "--max-steps", "1",
               "--output", "dangling"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "dangling is a link to" in done.stderr and "which does not exist" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "gone").exists()
