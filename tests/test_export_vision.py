"""finetune export of a run that trained on pictures (tiny-gemma3-vision): transformers' Gemma3ForConditionalGeneration
gives keras-hub's logits on a picture and its text, PEFT's adapter on its base gives them too, the lora adapter loads
onto the preset, and gguf is refused, naming what works.

transformers and PEFT compute on PyTorch, and the export reads the merged weights through numpy: the module runs in
the PyTorch suite only (the vision runs themselves train on every backend in tests/test_images.py).
"""

import json

import numpy as np
import pytest
from conftest import BACKEND, float32_policy, invoke
from test_images import pictures, square

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="transformers and PEFT are checked in the PyTorch suite")
TARGETS = ["query", "key", "value", "attention_output", "ffw_gating", "ffw_gating_2", "ffw_linear"]
RANK, ALPHA = 4, 8.0
PROMPT = "<start_of_turn>user\n<start_of_image>What colour is this?<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory):
    """A 2-step tiny-gemma3-vision run with LoRA on every decoder kind: (run directory, picture folder)."""
    import finetune

    folder = tmp_path_factory.mktemp("vision-export")
    data = pictures(folder, 8)
    settings = {
        "backend": BACKEND, "output.dir": str(folder / "run"), "model.preset": "tiny-gemma3-vision",
        "model.seq_len": 64, "model.precision": "float32", "train.batch_size": 2, "train.max_steps": 2,
        "train.samples": 0, "data.path": str(data), "data.template": "auto", "data.eval_fraction": 0.0,
        "lora.rank": RANK, "lora.alpha": ALPHA, "lora.targets": TARGETS,
    }  # fmt: skip
    with float32_policy():
        finetune.run(finetune.load_config("tiny", settings))
    return folder / "run", folder


@pytest.fixture(scope="module")
def tuned(vision_run):
    """The run's fine-tuned model on the prompt with each colour's square: [(keras-hub inputs, logits), ...]."""
    import keras
    from PIL import Image

    from finetune.training import runs

    run, folder = vision_run
    with float32_policy():
        lm, preprocessor = runs.load_model(runs.open_on(str(run), None))
        seen = []
        for colour in ("red", "blue"):
            picture = np.asarray(Image.open(folder / square(folder / f"{colour}.png", colour)))
            x = preprocessor.generate_preprocess({"prompts": [PROMPT], "images": [[picture]]}, sequence_length=64)
            x = {name: keras.ops.convert_to_numpy(value) for name, value in x.items()}
            seen.append((x, keras.ops.convert_to_numpy(lm(x))))
    return seen


def hf_logits(model, x):
    """transformers' logits on keras-hub's ids and pixels: the picture NCHW, its soft tokens marked for the
    two-way attention keras-hub gives them (token_type_ids 1), up to keras-hub's padding."""
    import torch

    length = int(x["padding_mask"][0].sum())
    assert 0 < length < 64 and x["padding_mask"][0, :length].all()  # whole, and padded on the right
    ids = torch.tensor(x["token_ids"][:, :length], dtype=torch.long)
    pixels = torch.tensor(np.transpose(x["images"][0, :1], (0, 3, 1, 2)))  # the one picture, of two slots
    kinds = (ids == model.config.image_token_index).long()
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pixels, token_type_ids=kinds, attention_mask=torch.ones_like(ids))
    return out.logits.numpy(), length


@pytest.fixture(scope="module")
def hf_export(vision_run, tmp_path_factory):
    """`finetune export --format hf` of the run, as typed, in a fresh process."""
    from test_as_typed import finetune as typed

    run, _ = vision_run
    out = tmp_path_factory.mktemp("hf") / "hf"
    typed("export", "--run", str(run), "--format", "hf", "--output", str(out), cwd=out.parent)
    return out


def test_hf_export_gives_keras_hub_s_logits_on_a_picture_and_its_text(hf_export, tuned):
    transformers = pytest.importorskip("transformers", reason="checked in transformers: pip install 'finetune[hf]'")
    config = json.loads((hf_export / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"] and config["mm_tokens_per_image"] == 4
    model, loading = transformers.Gemma3ForConditionalGeneration.from_pretrained(hf_export, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    got = []
    for x, expected in tuned:
        logits, length = hf_logits(model, x)
        assert (x["token_ids"][0, :length] == config["image_token_index"]).sum() == 4
        np.testing.assert_allclose(logits[0], expected[0, :length], atol=1e-3)
        got.append(logits[0, -1])
    assert np.abs(got[0] - got[1]).max() > 1e-3  # the picture reaches the text: its colour moves the last logits


def test_transformers_processor_gives_keras_hub_s_ids_and_pixels(hf_export, tuned, vision_run):
    transformers = pytest.importorskip("transformers", reason="checked in transformers: pip install 'finetune[hf]'")
    from PIL import Image

    _, folder = vision_run
    processor = transformers.AutoProcessor.from_pretrained(hf_export)
    x, _ = tuned[0]
    got = processor(text=PROMPT, images=[[Image.open(folder / "red.png")]], return_tensors="np")
    length = int(x["padding_mask"][0].sum())
    assert got["input_ids"][0].tolist() == x["token_ids"][0, :length].tolist()
    np.testing.assert_allclose(got["pixel_values"][0], np.transpose(x["images"][0, 0], (2, 0, 1)), atol=1e-5)


def test_peft_on_the_hf_base_gives_the_fine_tuned_logits(vision_run, tuned, tmp_path):
    transformers = pytest.importorskip("transformers", reason="checked in transformers: pip install 'finetune[hf]'")
    peft = pytest.importorskip("peft", reason="checked in PEFT: pip install 'finetune[hf]'")
    import finetune

    run, _ = vision_run
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        finetune.export(run, "hf", tmp_path / "base", base=True)
    )
    (x, expected), _ = tuned
    before, length = hf_logits(base, x)
    assert np.abs(before[0] - expected[0, :length]).max() > 1e-3  # the base alone is not the fine-tuned model
    adapted = peft.PeftModel.from_pretrained(base, finetune.export(run, "peft", tmp_path / "peft"))
    adapted_names = [name for name, _ in adapted.named_modules() if name.endswith("lora_A")]
    assert len(adapted_names) == 7 * 2 and not [name for name in adapted_names if "vision" in name]
    np.testing.assert_allclose(hf_logits(adapted, x)[0][0], expected[0, :length], atol=1e-3)


def test_lora_export_loads_onto_the_vision_preset_with_plain_keras_hub(vision_run, tuned, tmp_path):
    import keras
    import keras_hub

    import finetune
    from finetune.model import presets

    run, _ = vision_run
    out = finetune.export(run, "lora", tmp_path / "lora")
    described = json.loads((out / "adapter.json").read_text())
    with float32_policy():
        vocabulary = presets.tiny_vocabulary_size("tiny-gemma3-vision")
        backbone = presets.tiny_backbone(vocabulary, name="tiny-gemma3-vision")
        backbone.enable_lora(described["rank"], target_layer_names=described["targets"])
        for layer in backbone._flatten_layers(include_self=False):
            if getattr(layer, "lora_enabled", False):
                layer.lora_alpha = described["alpha"]
        backbone.load_lora_weights(str(out / "adapter.lora.h5"))
        lm = keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=None)
        for x, expected in tuned:
            np.testing.assert_allclose(keras.ops.convert_to_numpy(lm(x)), expected, atol=1e-5)


def test_gguf_of_a_vision_run_is_refused_naming_what_works(vision_run, tmp_path):
    run, _ = vision_run
    result = invoke("export", "--run", str(run), "--format", "gguf", "--output", str(tmp_path / "gguf"))
    assert result.exit_code == 2, result.output
    assert "mmproj" in result.output and "--format merged, hf or peft" in result.output
    assert not (tmp_path / "gguf").exists()


@pytest.mark.one_backend
@pytest.mark.parametrize("kind", ["Gemma4Backbone", "Gemma3nBackbone"])
@pytest.mark.parametrize("fmt", ["hf", "peft", "gguf"])
def test_other_families_with_an_encoder_are_refused_naming_what_works(kind, fmt):
    from finetune.exports import export
    from finetune.platform.errors import UserError

    backbone = type(kind, (), {"vision_encoder": object(), "audio_encoder": None})()
    with pytest.raises(UserError, match="use --format merged or lora"):
        export.check_encoders(backbone, fmt)
    export.check_encoders(type(kind, (), {"vision_encoder": None})(), fmt)  # the text decoder alone is exported
