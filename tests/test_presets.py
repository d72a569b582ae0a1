import json

import pytest

from finetune.model import presets
from finetune.platform.errors import UserError

pytestmark = pytest.mark.one_backend  # no Keras backend in these: they run in one suite


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
    assert presets.Source("hub", "gemma_2b_en", "gemma").default_learning_rate == 1e-4


def test_every_family_resolves_by_name_handle_or_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(presets, "_check_hub_access", lambda handle: None)
    for name, family in [
        ("gemma3_270m", "gemma3"),
        ("gemma4_2b", "gemma4"),
        ("gemma4_instruct_26b_a4b", "gemma4"),
        ("gemma4_31b", "gemma4"),
        ("gemma3n_e2b", "gemma3n"),
        ("gemma3n_e4b_it", "gemma3n"),
    ]:
        assert presets.resolve(name).family == family, name
    for handle, family in [
        ("kaggle://keras/gemma4/keras/gemma4_2b/2", "gemma4"),  # by the variant keras-hub names
        ("kaggle://keras/gemma-3n/keras/gemma3n_e4b/1", "gemma3n"),
        ("kaggle://someone/gemma4/keras/my-finetune/1", "gemma4"),  # by the model
        ("kaggle://keras/gemma2/keras/gemma2_2b_en/1", "gemma"),
    ]:  # fmt: skip
        assert presets.resolve(handle) == presets.Source("hub", handle, family), handle
    with pytest.raises(UserError, match="cannot tell which Gemma family kaggle://someone/llama/keras/x/1"):
        presets.resolve("kaggle://someone/llama/keras/x/1")
    for class_name, family in [("keras_hub>Gemma4Backbone", "gemma4"), ("keras_hub>Gemma3nCausalLM", "gemma3n"),
                               ("keras_hub>Gemma3Backbone", "gemma3")]:  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps({"class_name": class_name}))
        assert presets.resolve(str(tmp_path)).family == family, class_name
    (tmp_path / "config.json").write_text(json.dumps({"class_name": "keras_hub>Gemma9Backbone"}))
    with pytest.raises(UserError, match="holds a Gemma9Backbone, a Gemma finetune does not know"):
        presets.resolve(str(tmp_path))


def test_tiny_presets_of_each_family_and_assistants_refused():
    for name, family in [("tiny-gemma3", "gemma3"), ("tiny-gemma4", "gemma4"), ("tiny-gemma4-moe", "gemma4"),
                         ("tiny-gemma3n", "gemma3n")]:  # fmt: skip
        assert presets.resolve(name) == presets.Source("tiny", name, family)
        assert presets.resolve(name).default_learning_rate == 1e-2
    with pytest.raises(UserError, match="speculative-decoding draft model.*fine-tune gemma4_instruct_2b instead"):
        presets.resolve("gemma4_instruct_2b_assistant")
    with pytest.raises(UserError, match="unknown preset 'tiny-gemma5'; did you mean tiny-gemma"):
        presets.resolve("tiny-gemma5")


def test_the_frameworks_a_preset_needs_are_told_offline(tmp_path):
    # keras-hub's Gemma 3, 3n and 4 preprocessors need TensorFlow on every backend; Gemma 1 and 2's do not.
    assert presets.frameworks_needed("tiny") == ()
    assert presets.frameworks_needed("gemma_2b_en") == ()
    for preset in ("tiny-gemma3", "tiny-gemma3n", "tiny-gemma4", "tiny-gemma4-moe", "gemma3_1b", "gemma4_2b"):
        assert presets.frameworks_needed(preset) == ("tensorflow",), preset
    # A name the offline table lacks, or a directory resolve() will refuse, keeps it: leaving it out would stop
    # the run, keeping it costs memory.
    assert presets.frameworks_needed("kaggle://keras/gemma/keras/gemma_2b_en/2") == ("tensorflow",)
    assert presets.frameworks_needed(str(tmp_path)) == ("tensorflow",)
    (tmp_path / "config.json").write_text(json.dumps({"class_name": "keras_hub>GemmaBackbone", "config": {}}))
    assert presets.frameworks_needed(str(tmp_path)) == ()


def test_the_licence_is_a_field_of_the_preset_record():
    assert presets.licence_of("tiny", "gemma").spdx == "apache-2.0"  # finetune's own test model
    assert presets.licence_of("gemma_2b_en", "gemma").spdx == "gemma"
    assert presets.licence_of("gemma3n_e2b", "gemma3n").spdx == "gemma"
    assert presets.licence_of("gemma4_2b", "gemma4").spdx == "apache-2.0"
    assert all(presets.licence_of(name, spec.family).redistribution for name, spec in presets.TINY.items())
