"""finetune publish: the dry run as typed, the refusals, and the upload calls, on one tiny finished run.

Nothing here reaches a network: the uploads go to stand-ins of huggingface_hub's HfApi and keras_hub.upload_preset,
put in this process, that record what they were given (the repository, the handle, and the files with their
contents, read while the upload directory still exists). The refusals and the dry run run as a user types them, in
fresh processes. Every test carries a fake token in the environment and checks that it appears nowhere.
"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import killed_after
from typer.testing import CliRunner

import finetune
from finetune.cli import app
from finetune.exports import publish
from finetune.model import families, presets

# The upload and its checks are the same on every backend, and the export that makes the files is tested on each
# (tests/test_export.py): one tiny run, in the PyTorch suite.
pytestmark = pytest.mark.backend_neutral
HF_TOKEN, KAGGLE_KEY = "hf_fAkEtOkEn0123456789sEcReT", "kaggle-fake-key-5ecret"


@pytest.fixture
def credentials(tmp_path, monkeypatch):
    """Fake credentials for both hubs, a temporary directory of our own, and an HF home with no saved token."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    environment = {
        "HF_TOKEN": HF_TOKEN, "HF_HOME": str(tmp_path / "hf-home"), "KAGGLE_USERNAME": "someone",
        "KAGGLE_KEY": KAGGLE_KEY, "KAGGLE_CONFIG_DIR": str(tmp_path / "kaggle"), "TMPDIR": str(scratch),
    }  # fmt: skip
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    return environment


def snapshot(directory) -> dict:
    """Every file under `directory`, by its path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def no_secret_in(*texts):
    for text in texts:
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        assert HF_TOKEN not in text and KAGGLE_KEY not in text


def fresh(*args, env=None, timeout=300):
    """`python -m finetune publish ARGS` in a fresh process."""
    command = [sys.executable, "-m", "finetune", "publish", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)


def test_the_dry_run_as_typed_lists_the_files_and_prints_the_card(uninterrupted, credentials, tmp_path):
    before = snapshot(uninterrupted)
    done = fresh("--run", uninterrupted, "--to", "hf://someone/tiny-dolly", "--dry-run")
    assert done.returncode == 0, done.stderr[-2000:]
    listing, _, readme = done.stdout.partition("\nREADME.md:\n")
    assert listing.startswith("would upload 8 files (") and "to hf://someone/tiny-dolly:" in listing
    names = [line.split()[0] for line in listing.splitlines()[1:] if line.strip()]
    assert names == ["README.md", "assets/tokenizer/vocabulary.spm", "config.json", "metadata.json",
                     "model.weights.h5", "preprocessor.json", "task.json", "tokenizer.json"]  # fmt: skip
    assert " KB" in listing.splitlines()[5]  # model.weights.h5, with its size
    metadata = yaml.safe_load(readme.strip().split("---")[1])
    assert metadata["license"] == "apache-2.0" and metadata["library_name"] == "keras-hub"
    assert "## Held-out metrics" in readme and "dry run: nothing was uploaded" in done.stderr
    no_secret_in(done.stdout, done.stderr, *snapshot(uninterrupted).values())
    assert snapshot(uninterrupted) == before  # the run is read, never written
    assert list((tmp_path / "tmp").iterdir()) == []  # the files were made in a temporary directory, now gone


def unfinished(whole, tmp_path):
    return killed_after(whole, tmp_path / "unfinished", 4)


REFUSALS = {
    "hf://onlyuser": "is not a handle",
    "kaggle://a/b": "is not a handle",
    "s3://bucket/model": "is not a handle",
    "kaggle://someone/tiny/pytorch/v1": "whose framework is keras",
    "kaggle://someone/tiny/keras/v1/2": "leave the version out",
}


@pytest.mark.parametrize("to", list(REFUSALS))
def test_a_malformed_handle_is_refused_as_typed(to, uninterrupted, credentials, tmp_path):
    done = fresh("--run", uninterrupted, "--to", to, "--dry-run", timeout=120)
    assert done.returncode == 2 and REFUSALS[to] in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr and done.stdout == ""
    assert list((tmp_path / "tmp").iterdir()) == []


def test_the_other_refusals_as_typed(uninterrupted, credentials, tmp_path):
    """No credentials for a real upload, a format Kaggle does not take, a run that has not finished: exit 2, in a
    second, with nothing made."""
    nobody = {"HF_TOKEN": "", "KAGGLE_USERNAME": "", "KAGGLE_KEY": ""}
    cases = [
        (["--to", "hf://someone/tiny"], nobody, "no Hugging Face credentials"),
        (["--to", "kaggle://someone/tiny/keras/v1"], nobody, "no Kaggle credentials"),
        (["--to", "kaggle://someone/tiny/keras/v1", "--format", "peft"], {}, "Kaggle Models takes a keras-hub preset"),
        (["--to", "hf://someone/tiny", "--format", "onnx"], {}, "unknown format 'onnx'"),
    ]
    for args, env, message in cases:
        done = fresh("--run", uninterrupted, *args, env=env, timeout=120)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
    run = unfinished(uninterrupted, tmp_path)
    before = snapshot(run)
    done = fresh("--run", run, "--to", "hf://someone/tiny", "--dry-run", timeout=120)
    assert done.returncode == 2 and "not a finished run" in done.stderr, done.stderr
    assert snapshot(run) == before and list((tmp_path / "tmp").iterdir()) == []


def test_a_base_whose_licence_forbids_redistribution_is_refused(uninterrupted, credentials, monkeypatch, tmp_path):
    closed = families.Licence("Closed Weights Licence", "other", "https://example.com/closed", redistribution=False)
    monkeypatch.setitem(presets.TINY, "tiny", dataclasses.replace(presets.TINY["tiny"], licence=closed))
    result = CliRunner().invoke(app, ["publish", "--run", str(uninterrupted), "--to", "hf://someone/tiny", "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "Closed Weights Licence" in result.stderr and "does not allow" in result.stderr
    with pytest.raises(finetune.UserError, match="does not allow"):
        finetune.publish(uninterrupted, "hf://someone/tiny", dry_run=True)
    assert list((tmp_path / "tmp").iterdir()) == []


class Recorder:
    """Stands in for huggingface_hub.HfApi and keras_hub.upload_preset: each call, with the files it was given."""

    def __init__(self):
        self.calls = []

    def hf_api(self):
        recorder = self

        class HfApi:
            def create_repo(self, repo_id, private=None, exist_ok=False, **rest):
                recorder.calls.append(("create_repo", repo_id, {"private": private, "exist_ok": exist_ok}))

            def upload_file(self, path_or_fileobj, path_in_repo, repo_id, **rest):
                with open(path_or_fileobj, "rb") as f:
                    recorder.calls.append(("upload_file", repo_id, {path_in_repo: f.read()}))

            def upload_folder(self, repo_id, folder_path, **rest):
                recorder.calls.append(("upload_folder", repo_id, snapshot(Path(folder_path))))

        return HfApi

    def upload_preset(self, uri, preset):
        self.calls.append(("upload_preset", uri, snapshot(Path(preset))))


@pytest.fixture
def recorder(monkeypatch):
    import huggingface_hub
    import keras_hub

    found = Recorder()
    monkeypatch.setattr(huggingface_hub, "HfApi", found.hf_api())
    monkeypatch.setattr(keras_hub, "upload_preset", found.upload_preset)
    return found


def test_a_peft_adapter_goes_to_the_hub_through_huggingface_hub(uninterrupted, credentials, recorder, tmp_path):
    done = finetune.publish(uninterrupted, "hf://someone/tiny-peft", format="peft", private=True)
    assert [call[:2] for call in recorder.calls] == [("create_repo", "someone/tiny-peft"),
                                                     ("upload_folder", "someone/tiny-peft")]  # fmt: skip
    assert recorder.calls[0][2] == {"private": True, "exist_ok": True}
    files = recorder.calls[1][2]
    assert sorted(files) == ["README.md", "adapter.json", "adapter_config.json", "adapter_model.safetensors"]
    assert files["README.md"].decode() == done.card and "library_name: peft" in done.card
    assert done.uploaded and done.url == "https://huggingface.co/someone/tiny-peft"
    assert sorted(name for name, _ in done.files) == sorted(files)
    no_secret_in(*files.values())
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_keras_preset_goes_to_kaggle_through_keras_hub(uninterrupted, credentials, recorder, tmp_path):
    result = CliRunner().invoke(app, ["publish", "--run", str(uninterrupted), "--to", "kaggle://someone/tiny/keras/v1"])
    assert result.exit_code == 0, result.output
    assert [call[:2] for call in recorder.calls] == [("upload_preset", "kaggle://someone/tiny/keras/v1")]
    files = recorder.calls[0][2]
    assert {"config.json", "model.weights.h5", "README.md"} <= set(files) and "finetune-export.json" not in files
    assert "published" in result.stdout and "https://www.kaggle.com/models/someone/tiny" in result.stdout
    assert "--private is for the Hugging Face Hub" not in result.output
    no_secret_in(result.output, *files.values())
    private = CliRunner().invoke(app, ["publish", "--run", str(uninterrupted), "--to", "kaggle://someone/tiny/keras/v1",
                                       "--private", "--dry-run"])  # fmt: skip
    assert private.exit_code == 0 and "note: --private is for the Hugging Face Hub; Kaggle makes" in private.output


def test_a_keras_preset_goes_to_the_hub_with_its_card_first(uninterrupted, credentials, recorder):
    """keras-hub writes a card of its own over ours when the repository has none: ours goes up before it looks."""
    done = finetune.publish(uninterrupted, "hf://someone/tiny-keras")
    assert [call[:2] for call in recorder.calls] == [
        ("create_repo", "someone/tiny-keras"),
        ("upload_file", "someone/tiny-keras"),
        ("upload_preset", "hf://someone/tiny-keras"),
    ]
    assert recorder.calls[0][2]["private"] is False
    assert recorder.calls[1][2] == {"README.md": done.card.encode()}
    assert recorder.calls[2][2]["README.md"] == done.card.encode()


def test_a_failed_upload_is_a_message_not_a_traceback(uninterrupted, credentials, monkeypatch):
    import huggingface_hub

    class Refusing:
        def create_repo(self, repo_id, **rest):
            raise OSError("403 Forbidden: you may not write to someone/tiny")

    monkeypatch.setattr(huggingface_hub, "HfApi", Refusing)
    result = CliRunner().invoke(app, ["publish", "--run", str(uninterrupted), "--to", "hf://someone/tiny"])
    assert result.exit_code == 2 and "the upload to hf://someone/tiny failed: 403 Forbidden" in result.stderr
    no_secret_in(result.output)


def test_a_missing_library_names_what_to_install(credentials, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "huggingface_hub" else find_spec(name, *a)
    )
    with pytest.raises(finetune.UserError, match=r"needs the huggingface_hub package: pip install 'finetune\[hf\]'"):
        publish.check(publish.Request("hf://someone/tiny", dry_run=True))


def test_an_upload_that_cannot_connect_is_a_message_as_typed(uninterrupted, credentials, tmp_path):
    """The real huggingface_hub client, pointed at a local port nothing listens on: exit 2, and no token shown."""
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2"}
    done = fresh("--run", uninterrupted, "--to", "hf://someone/tiny", "--format", "peft", env=env)
    assert done.returncode == 2 and "error: the upload to hf://someone/tiny failed" in done.stderr, done.stderr
    no_secret_in(done.stdout, done.stderr)
    assert list((tmp_path / "tmp").iterdir()) == []
