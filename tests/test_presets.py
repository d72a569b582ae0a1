import json

import pytest

from finetune import presets
from finetune.errors import UserError


def test_tiny_and_names_resolve_to_their_family(monkeypatch):
    assert presets.resolve("tiny") == presets.Source("tiny", "tiny", "gemma")
    monkeypatch.setattr(presets, "_check_hub_access", lambda handle: None)
    assert presets.resolve("gemma2_2b_en").family == "gemma"
    assert presets.resolve("gemma3_1b").family == "gemma3"
    assert presets.resolve("kaggle://keras/gemma3/keras/gemma3_1b/3") == presets.Source(
        "hub", "kaggle://keras/gemma3/keras/gemma3_1b/3", "gemma3"
    )


def test_unknown_name_suggests_close_ones():
    with pytest.raises(UserError, match="unknown preset 'gemma_2b'; did you mean .*gemma_2b_en"):
        presets.resolve("gemma_2b")


def test_local_directories_are_checked(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        presets.resolve(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"class_name": "keras_hub>BertBackbone"}))
    with pytest.raises(UserError, match="BertBackbone model; finetune trains Gemma presets only"):
        presets.resolve(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"class_name": "keras_hub>Gemma3Backbone"}))
    assert presets.resolve(str(tmp_path)) == presets.Source("local", str(tmp_path), "gemma3")


def test_learning_rate_defaults():
    assert presets.resolve("tiny").default_learning_rate == 1e-2
    assert presets.Source("hub", "gemma_2b_en", "gemma").default_learning_rate == 5e-5
