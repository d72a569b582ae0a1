import json
import os
import sys
import time
import types
from pathlib import Path

import pytest
from conftest import BACKEND
from typer.testing import CliRunner

from finetune.cli import app
from finetune.model import builder, presets
from finetune.platform import platforms
from finetune.training import outputs


def test_kaggle_credentials_from_env_or_file(tmp_path, monkeypatch):
    for name in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(tmp_path))
    assert not platforms.kaggle_credentials_present()
    monkeypatch.setenv("KAGGLE_USERNAME", "someone")
    assert not platforms.kaggle_credentials_present()  # a username alone is not enough
    monkeypatch.setenv("KAGGLE_KEY", "k")
    assert platforms.kaggle_credentials_present()
    monkeypatch.delenv("KAGGLE_KEY")
    (tmp_path / "kaggle.json").write_text('{"username": "someone", "key": "k"}')
    assert platforms.kaggle_credentials_present()


def test_kagglehub_cache_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv("KAGGLEHUB_CACHE", str(tmp_path))
    assert not platforms.in_kagglehub_cache("gemma_2b_en")
    (tmp_path / "models" / "keras" / "gemma" / "keras" / "gemma_2b_en" / "3").mkdir(parents=True)
    assert platforms.in_kagglehub_cache("gemma_2b_en")
    assert platforms.in_kagglehub_cache("kaggle://keras/gemma/keras/gemma_2b_en/3")
    assert not platforms.in_kagglehub_cache("gemma_7b_en")


def test_unreachable_host_is_reported_quickly():
    assert not platforms.reachable("host.invalid", timeout=1.0)


def keras_hub_preset(path, class_name="keras_hub>GemmaBackbone"):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"class_name": class_name, "config": {}}))
    return path


@pytest.fixture
def kaggle_notebook(tmp_path, monkeypatch):
    """A Kaggle notebook session whose /kaggle/input and /kaggle/working are under tmp_path."""
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.setenv("FINETUNE_KAGGLE_INPUT", str(tmp_path / "input"))
    monkeypatch.setenv("FINETUNE_KAGGLE_WORKING", str(tmp_path / "working"))
    return tmp_path


def test_a_kaggle_notebook_is_told_by_its_run_type(monkeypatch):
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    assert not platforms.in_kaggle_notebook()
    assert platforms.runs_root() == Path("runs")
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    assert platforms.in_kaggle_notebook()
    assert platforms.runs_root() == Path("/kaggle/working/runs")


def test_a_kaggle_notebook_stops_before_its_12_hours(kaggle_notebook, monkeypatch):
    from finetune.training import resolve

    limit, deadline = resolve._time_limit(None)
    assert 11 * 3600 < deadline - time.monotonic() < 12 * 3600 and limit.value == resolve.KAGGLE_TIME_LIMIT
    assert "Kaggle" in limit.why
    assert resolve._time_limit("off")[1] is None
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE")
    assert resolve._time_limit(None)[1] is None


def test_runs_without_output_go_to_kaggle_working(kaggle_notebook):
    (kaggle_notebook / "working").mkdir()
    assert outputs.default_dir().parent == kaggle_notebook / "working" / "runs"


def test_attached_presets_are_found_by_name_or_handle(kaggle_notebook):
    models = kaggle_notebook / "input"
    older = keras_hub_preset(models / "gemma" / "keras" / "gemma_2b_en" / "2")
    newer = keras_hub_preset(models / "gemma" / "keras" / "gemma_2b_en" / "10")
    (models / "gemma" / "transformers" / "gemma_2b_en" / "11").mkdir(parents=True)  # not a keras-hub preset
    (models / "gemma" / "transformers" / "gemma_2b_en" / "11" / "config.json").write_text('{"model_type": "gemma"}')
    assert platforms.attached_preset("gemma_2b_en") == newer  # versions compare as numbers
    assert platforms.attached_preset("kaggle://keras/gemma/keras/gemma_2b_en") == newer
    assert platforms.attached_preset("kaggle://keras/gemma/keras/gemma_2b_en/2") == older
    assert platforms.attached_preset("kaggle://keras/gemma/keras/gemma_2b_en/3") is None
    assert platforms.attached_preset("kaggle://keras/gemma2/keras/gemma_2b_en") is None
    assert platforms.attached_preset("gemma_7b_en") is None
    assert platforms.attached_preset("gemma_2b_*") is None  # a name is not a pattern


def test_an_attached_preset_is_used_instead_of_a_download(kaggle_notebook, monkeypatch, capsys):
    attached = keras_hub_preset(kaggle_notebook / "input" / "gemma3" / "keras" / "gemma3_1b" / "3", "Gemma3Backbone")

    def no_download(handle):
        raise AssertionError(f"{handle} would be downloaded")

    monkeypatch.setattr(presets, "_check_hub_access", no_download)
    assert presets.resolve("gemma3_1b") == presets.Source("local", str(attached), "gemma3")
    assert f"note: using gemma3_1b attached at {attached}" in capsys.readouterr().err
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE")  # outside a notebook /kaggle/input is not looked at
    with pytest.raises(AssertionError, match="would be downloaded"):
        presets.resolve("gemma3_1b")


USERNAME, KEY = "user-from-secrets-7f3a", "key-from-secrets-9c1e"


@pytest.fixture
def kaggle_secrets(kaggle_notebook, monkeypatch):
    """Kaggle's secrets client, faked; no credentials anywhere else."""
    for name in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN"):
        monkeypatch.setenv(name, "")  # so that teardown removes what the code under test sets
        monkeypatch.delenv(name)
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(kaggle_notebook / "no-kaggle-json"))
    monkeypatch.setenv("KAGGLEHUB_CACHE", str(kaggle_notebook / "cache"))
    secrets = {"KAGGLE_USERNAME": USERNAME, "KAGGLE_KEY": KEY}

    class UserSecretsClient:
        def get_secret(self, label):
            return secrets[label]  # Kaggle raises for a secret not added to the notebook

    module = types.ModuleType("kaggle_secrets")
    module.UserSecretsClient = UserSecretsClient
    monkeypatch.setitem(sys.modules, "kaggle_secrets", module)
    return secrets


def test_kaggle_secrets_become_credentials_only_when_none_are_set(kaggle_secrets, monkeypatch):
    assert platforms.use_kaggle_secrets()
    assert (os.environ["KAGGLE_USERNAME"], os.environ["KAGGLE_KEY"]) == (USERNAME, KEY)
    monkeypatch.setenv("KAGGLE_KEY", "mine")
    assert not platforms.use_kaggle_secrets() and os.environ["KAGGLE_KEY"] == "mine"  # set by the user: kept
    monkeypatch.delenv("KAGGLE_USERNAME")
    monkeypatch.delenv("KAGGLE_KEY")
    del kaggle_secrets["KAGGLE_KEY"]  # a notebook with only one of the two secrets
    assert not platforms.use_kaggle_secrets() and not platforms.kaggle_credentials_present()
    monkeypatch.delenv("KAGGLE_USERNAME")
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE")  # outside a notebook the secrets are never asked for
    assert not platforms.use_kaggle_secrets() and "KAGGLE_USERNAME" not in os.environ


@pytest.mark.backend_neutral
def test_a_run_with_kaggle_secrets_never_shows_or_writes_them(kaggle_secrets, monkeypatch):
    """gemma_2b_en in a notebook: credentials from the secrets; the tiny model stands in for the download."""
    tiny_build = builder.build
    monkeypatch.setattr(platforms, "reachable", lambda host, port=443, timeout=3.0: True)
    monkeypatch.setattr(builder, "build", lambda source, *args: tiny_build(presets.resolve("tiny"), *args))
    working = Path(os.environ["FINETUNE_KAGGLE_WORKING"])
    working.mkdir()
    result = CliRunner().invoke(
        app,
        ["gemma", "--preset", "gemma_2b_en", "--backend", BACKEND, "--seq-len", "64", "--batch-size", "2",
         "--max-records", "24", "--max-steps", "1", "--set", "train.samples=0"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "from this notebook's secrets" in result.output
    (run,) = (working / "runs").iterdir()  # no --output: under /kaggle/working
    assert (run / "metrics.json").is_file()
    for secret in (USERNAME, KEY):
        assert secret not in result.output
        leaks = [p for p in working.parent.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
        assert not leaks, f"a secret was written to {leaks}"


def test_vertex_directories_come_from_the_environment(monkeypatch):
    for name in ("AIP_MODEL_DIR", "AIP_CHECKPOINT_DIR", "AIP_TENSORBOARD_LOG_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert platforms.vertex_model_dir() is None and platforms.vertex_mirror_dirs() == []
    monkeypatch.setenv("AIP_MODEL_DIR", "gs://b/model")
    monkeypatch.setenv("AIP_TENSORBOARD_LOG_DIR", "gs://b/logs")
    assert platforms.vertex_model_dir() == "gs://b/model" and platforms.vertex_mirror_dirs() == ["gs://b/logs"]


def test_tuning_without_hypertune_is_a_note(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hypertune", None)  # import hypertune raises ImportError
    monkeypatch.delenv("CLOUD_ML_HP_METRIC_TAG", raising=False)
    monkeypatch.delenv("CLOUD_ML_TRIAL_ID", raising=False)
    platforms.report_tuning_metric(1.0, 2)
    assert capsys.readouterr().out == ""  # not a tuning trial: nothing to say
    monkeypatch.setenv("CLOUD_ML_TRIAL_ID", "1")
    platforms.report_tuning_metric(1.0, 2)
    assert 'pip install "finetune[vertex]"' in capsys.readouterr().out
