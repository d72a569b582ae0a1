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
