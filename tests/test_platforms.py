import sys

from finetune import platforms


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
