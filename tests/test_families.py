"""The newer families end to end, on their tiny presets: train, resume, export, on this process' backend.

One short run per family (module fixture, packed) serves every check: its
eval loss falls; a copy of it cut back to what a kill -9 right after its
step-3 checkpoint leaves on disk (that checkpoint, no results: what
tests/test_checkpoint.py gets by killing `tiny` for real) resumes to the same
adapter, bit for bit; the merged export loads in plain keras-hub with the
run's logits; and, in the PyTorch suite, the hf and peft exports give them
in transformers and PEFT. Packing is checked on the models directly in
tests/test_attention.py.

End to end: families.py's knowledge of each family is checked through every module a run passes.
"""

import dataclasses
import json
import os
import subprocess
import sys

import h5py
import keras
import numpy as np
import pytest
from conftest import BACKEND, float32_policy, killed_after, write_jsonl

import finetune
from finetune.config import LoraConfig
from finetune.model import builder, families, presets
from finetune.platform.errors import UserError
from finetune.training import checkpoint, outputs

FAMILIES = ["tiny-gemma3", "tiny-gemma4", "tiny-gemma4-moe", "tiny-gemma3n"]
TARGETS = ["query", "key", "value", "attention_output", "ffw_gating", "ffw_gating_2", "ffw_linear"]
TOKENS = np.array([[2, 50, 61, 72, 83, 94, 105, 116, 127, 5, 6, 7, 300, 301]], dtype="int32")
# Each backend's suite also kills one family's run for real (tests/test_checkpoint.py kills `tiny` on each).
KILLED_FOR_REAL = {"jax": "tiny-gemma4", "torch": "tiny-gemma3n", "tensorflow": "tiny-gemma4-moe"}
KILL_AFTER_STEP_3 = """
import json, os, signal, sys
import finetune
from finetune.training import checkpoint
save = checkpoint.save
def save_then_die(run_dir, run_id, step, *args, **kwargs):
    saved = save(run_dir, run_id, step, *args, **kwargs)
    if step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return saved
checkpoint.save = save_then_die
finetune.run(finetune.load_config("tiny", json.loads(sys.argv[1])))
"""
in_torch_suite = pytest.mark.skipif(BACKEND != "torch", reason="transformers and PEFT are checked in the PyTorch suite")


def settings(preset, out, data, **more):
    targets = TARGETS + (["experts"] if preset == "tiny-gemma4-moe" else [])  # the MoE's experts too
    return {
        "backend": BACKEND, "output.dir": str(out), "model.preset": preset, "model.seq_len": 32,
        "model.precision": "float32", "train.batch_size": 2, "train.max_steps": 6, "train.checkpoint_every": 3,
        "train.samples": 0, "data.path": str(data), "data.max_records": 24, "data.eval_fraction": 0.25,
        "lora.rank": 4, "lora.alpha": 8.0, "lora.targets": targets, **more,
        # PyTorch on a CPU: one thread in every process, so a run and its kill in a fresh process sum in one order
        # whatever the cores idle when each starts (the count the runs would pick otherwise).
        "train.threads": 1,
    }  # fmt: skip


def logits(lm, tokens=TOKENS):
    import keras

    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    if "position_ids" in builder.input_names(lm):
        x["position_ids"] = np.arange(tokens.shape[1])[None].astype("int32")
    return keras.ops.convert_to_numpy(lm(x))


def adapter_arrays(path):
    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: arrays.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None)
    return arrays


def resumes_to_the_same_adapter(preset, out, whole, data):
    """Resume the run cut at step 3 in `out`: it trains steps 4-6 and ends at `whole`'s adapter, bit for bit."""
    with float32_policy():
        metrics = finetune.run(finetune.load_config("tiny", settings(preset, out, data)), resume=True)
    assert metrics["resumed_from_step"] == 3 and metrics["steps"] == 6
    expected, got = adapter_arrays(whole / "adapter.lora.h5"), adapter_arrays(out / "adapter.lora.h5")
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    records = [{"instruction": f"What is {i} plus {i + 1}?", "response": f"{2 * i + 1}."} for i in range(24)]
    return write_jsonl(tmp_path_factory.mktemp("data") / "sums.jsonl", records)


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request, data, tmp_path_factory):
    """(preset, run directory, metrics, the fine-tuned model's logits on TOKENS)."""
    out = tmp_path_factory.mktemp(request.param) / "run"
    with float32_policy():
        metrics = finetune.run(finetune.load_config("tiny", settings(request.param, out, data)))
        tuned = logits(finetune.load(out))
    return request.param, out, metrics, tuned


def test_a_tiny_family_preset_trains_and_packs(trained):
    preset, out, metrics, _ = trained
    assert metrics["eval_loss"] < metrics["eval_loss_before"]
    assert metrics["packing"] is True and metrics["steps"] == 6
    described = json.loads((out / "adapter.json").read_text())
    assert described["preset"]["family"] == presets.TINY[preset].family
    assert len(described["adapted"]) > len(TARGETS)  # every kind of block took its adapters


@pytest.mark.backend_neutral  # exact replay: test_checkpoint, and the family killed for real below
def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_adapter(trained, data, tmp_path):
    preset, whole, _, _ = trained
    out = tmp_path / "killed"
    killed_after(whole, out, 3)
    resumes_to_the_same_adapter(preset, out, whole, data)


def test_a_run_killed_for_real_resumes_to_the_same_adapter(trained, data, tmp_path):
    """SIGKILL right after step 3's checkpoint, in its own process; then resume: the same adapter, bit for bit."""
    preset, whole, _, _ = trained
    if KILLED_FOR_REAL[BACKEND] != preset:
        pytest.skip(f"the {BACKEND} suite kills {KILLED_FOR_REAL[BACKEND]} for real")
    out = tmp_path / "killed"
    args = [sys.executable, "-c", KILL_AFTER_STEP_3, json.dumps(settings(preset, out, data))]
    killed = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "KERAS_BACKEND": BACKEND})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [c.step for c in checkpoint.find(out)] == [3] and not (out / outputs.METRICS).exists()
    resumes_to_the_same_adapter(preset, out, whole, data)


def test_merged_and_lora_exports_give_the_run_s_logits(trained, tmp_path):
    preset, out, _, tuned = trained
    finetune.export(out, "lora", tmp_path / "lora")
    finetune.export(out, "merged", tmp_path / "merged")
    with float32_policy():
        merged = families.keras_hub_class(families.get(presets.TINY[preset].family)).from_preset(
            str(tmp_path / "merged")
        )
    assert type(merged).__name__ == families.get(presets.TINY[preset].family).causal_lm
    np.testing.assert_allclose(logits(merged), tuned, atol=1e-4)


@in_torch_suite
def test_hf_and_peft_exports_give_the_run_s_logits_in_transformers(trained, tmp_path):
    transformers = pytest.importorskip("transformers", reason="checked in transformers: pip install 'finetune[hf]'")
    peft = pytest.importorskip("peft", reason="checked in PEFT: pip install 'finetune[hf]'")
    import torch

    preset, out, _, tuned = trained
    family = families.get(presets.TINY[preset].family)

    def hf_logits(hf_model):
        with torch.no_grad():
            return hf_model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()

    hf = transformers.AutoModelForCausalLM.from_pretrained(finetune.export(out, "hf", tmp_path / "hf"))
    assert type(hf).__name__ == family.transformers
    np.testing.assert_allclose(hf_logits(hf), tuned, atol=1e-4)  # the MoE's experts' update merged in
    if preset == "tiny-gemma4-moe":
        return  # peft refuses LoRA on the experts (tests/test_experts.py); tiny-gemma4 checks Gemma 4's linears
    base = transformers.AutoModelForCausalLM.from_pretrained(finetune.export(out, "hf", tmp_path / "base", base=True))
    adapted = peft.PeftModel.from_pretrained(base, finetune.export(out, "peft", tmp_path / "peft"))
    np.testing.assert_allclose(hf_logits(adapted), tuned, atol=1e-4)


@pytest.mark.parametrize(
    "preset, frozen",
    [
        ("tiny-gemma4-moe", ["proj"]),
        ("tiny-gemma4", ["per_layer_input_gate", "per_layer_model_projection"]),
        ("tiny-gemma3n", ["linear_left", "modality_router", "altup_projection_1", "per_layer_projection"]),
    ],
)
def test_lora_adapts_the_attention_and_ffw_and_refuses_the_rest(preset, frozen):
    from finetune.platform.errors import UserError

    with float32_policy():
        lm, _ = builder.load_base(presets.resolve(preset), 32)
    assert builder.adaptable_targets(lm.backbone) == list(families.TARGETS)
    for name in frozen:
        with pytest.raises(UserError, match=f"'{name}' layers stay frozen: .*; LoRA adapts query, key, value"):
            builder.enable_lora(lm, LoraConfig(rank=2, targets=["query", name]))
    own = ["q_proj", "down_proj"] if preset == "tiny-gemma3n" else ["query", "ffw_linear"]
    count = builder.enable_lora(lm, LoraConfig(rank=2, targets=own))
    trainable = {v.path.split("/")[-1] for v in lm.trainable_weights}
    assert trainable == {"lora_kernel_a", "lora_kernel_b"} and count == 2 * len(families.decoder_blocks(lm.backbone))


def _gemma4_hidden(quantize=None, lora=None):
    """tiny-gemma4's hidden states of one row, training mode, built in float32 (quantized if asked), with `lora`
    and B factors drawn so the update is not zero."""
    with float32_policy():
        lm, _ = builder.build(presets.resolve("tiny-gemma4"), 32, "float32", quantize)
        if lora is not None:
            builder.enable_lora(lm, lora, seed=0)
            rng = np.random.default_rng(0)
            for layer in lm.backbone._flatten_layers(include_self=False):
                if getattr(layer, "lora_enabled", False):
                    layer.lora_kernel_b.assign(rng.normal(0, 0.5, tuple(layer.lora_kernel_b.shape)).astype("float32"))
        x = {"token_ids": np.arange(2, 18)[None].astype("int32"), "padding_mask": np.ones((1, 16), "int32"),
             "position_ids": np.arange(16)[None].astype("int32")}  # fmt: skip
        return lm, keras.ops.convert_to_numpy(lm.backbone(x, training=True))


@pytest.mark.backend_neutral  # keras ops; int4 trains on every backend from the command line below
def test_gemma4_s_ffw_kernels_it_reads_itself_are_dequantized_and_take_dora():
    """keras-hub's Gemma 4 blocks multiply by their FFW kernels rather than calling the layers: a quantized kernel
    came without its scales (so --quantize was refused), and DoRA on ffw targets changed nothing (silently plain
    LoRA). The kernel they read is now the effective one."""
    _, plain = _gemma4_hidden()
    # The quantization's own error, far from a missing scale's: raw integers up to 127 where weights of about 0.1
    # belong put the output off by many times itself.
    # int4 dequantizes by the same path (quantized._int4_kernel); it trains below, from the command line.
    for mode, within in (("int8", 0.05),):
        _, quantized_out = _gemma4_hidden(mode)
        assert np.linalg.norm(quantized_out - plain) / np.linalg.norm(plain) < within, mode
    _, lora = _gemma4_hidden(lora=LoraConfig(rank=2, targets=["ffw_gating", "ffw_linear"]))
    lm, dora = _gemma4_hidden(lora=LoraConfig(rank=2, targets=["ffw_gating", "ffw_linear"], dora=True))
    assert np.abs(dora - lora).max() > 1e-3  # DoRA's magnitude acts
    layer = next(layer for layer in lm.backbone._flatten_layers() if layer.name == "ffw_gating")
    w, a, b, m = (keras.ops.convert_to_numpy(v) for v in (layer._kernel, layer.lora_kernel_a, layer.lora_kernel_b,
                                                          layer.lora_magnitude))  # fmt: skip
    merged = w + layer.lora_alpha / layer.lora_rank * a @ b
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer.kernel), merged * m / np.linalg.norm(merged, axis=0),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    with float32_policy():
        fresh, _ = builder.load_base(presets.resolve("tiny-gemma4"), 32)
        builder.effective_kernels(fresh.backbone, families.get("gemma4").read_kernels)
    with pytest.raises(UserError, match="--lora-dropout on layer 'ffw_gating': this model's blocks multiply"):
        builder.enable_lora(fresh, LoraConfig(rank=2, targets=["query", "ffw_gating"], dropout=0.1))


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-gemma4", "tiny-gemma3n"])
def test_all_linear_adapts_the_seven_linear_kinds_and_peft_names_name_them(preset):
    with float32_policy():
        lm, _ = builder.load_base(presets.resolve(preset), 32)
    family = families.get(presets.TINY[preset].family)
    count = builder.enable_lora(lm, LoraConfig(rank=2, targets=["all-linear"]))
    adapted = [layer for layer in lm.backbone._flatten_layers() if getattr(layer, "lora_enabled", False)]
    kinds = {family.layer_of(target) for target in families.TARGETS}
    assert len(kinds) == 7 and {layer.name for layer in adapted} == kinds
    dense = [layer for layer in lm.backbone._flatten_layers() if hasattr(layer, "lora_kernel_a")]
    assert count == len(adapted) == len([layer for layer in dense if layer.name in kinds]) >= 7
    names = list(families.PEFT_NAMES)  # q_proj ... down_proj: the same layers on every family
    assert builder.lora_layer_names(lm.backbone, names) == [family.layer_of(t) for t in families.TARGETS]


@pytest.mark.skipif(BACKEND != "torch", reason="loading a preset's weights is the same on every backend: torch suite")
def test_a_multimodal_preset_loads_its_text_decoder_alone(tmp_path):
    """Gemma 4's and 3n's presets carry image and audio encoders: finetune builds the backbone without them and
    loads the rest of the preset's weights, which are the full model's, and its text logits."""
    import keras
    import keras_hub
    from keras_hub.src.models.gemma3n.gemma3n_audio_encoder import Gemma3nAudioEncoder
    from keras_hub.src.models.mobilenetv5.mobilenetv5_backbone import MobileNetV5Backbone
    from keras_hub.src.models.mobilenetv5.mobilenetv5_builder import convert_arch_def_to_stackwise

    tokens = TOKENS[:, :6]
    with float32_policy():
        tokenizer = presets.tiny_tokenizer("tiny-gemma4")
        vision = keras_hub.models.Gemma4VisionEncoder(
            image_size=32, patch_size=8, num_heads=2, hidden_dim=16, num_layers=1, intermediate_dim=32, head_dim=8,
            output_dim=32, pool_size=2, position_embedding_size=16,
        )  # fmt: skip
        config = dict(presets.tiny_config("tiny-gemma4", tokenizer.vocabulary_size()), image_size=32)
        full = keras_hub.models.Gemma4CausalLM(
            backbone=keras_hub.models.Gemma4Backbone(vision_encoder=vision, **config),
            preprocessor=presets.tiny_preprocessor("tiny-gemma4", tokenizer, 32),
        )
        full.save_to_preset(str(tmp_path / "gemma4"))
        tokenizer = presets.tiny_tokenizer("tiny-gemma3n")
        mobilenet = MobileNetV5Backbone(**convert_arch_def_to_stackwise([["er_r1_k3_s1_e1_c16"]]), num_features=4,
                                        image_shape=(32, 32, 3), use_msfa=False)  # fmt: skip
        audio = Gemma3nAudioEncoder(
            hidden_size=8, input_feat_size=32, sscp_conv_channel_size=[4, 8], sscp_conv_kernel_size=[(3, 3), (3, 3)],
            sscp_conv_stride_size=[(2, 2), (2, 2)], sscp_conv_group_norm_eps=1e-5, num_hidden_layers=1,
            rms_norm_eps=1e-6, gradient_clipping=1.0, residual_weight=0.5, num_attention_heads=1,
            attention_chunk_size=4, num_attention_context_right=5, num_attention_context_left=5,
            attention_logit_cap=50.0, conv_kernel_size=5, reduction_factor=1,
        )  # fmt: skip
        vocabulary = tokenizer.vocabulary_size()
        full_3n = keras_hub.models.Gemma3nCausalLM(
            backbone=keras_hub.models.Gemma3nBackbone(
                vision_encoder_config=mobilenet.get_config(), vision_hidden_size=16, vision_vocab_offset=vocabulary,
                audio_encoder_config=audio.get_config(), audio_hidden_size=8, audio_vocab_offset=vocabulary + 128,
                **presets.tiny_config("tiny-gemma3n", vocabulary),
            ),
            preprocessor=presets.tiny_preprocessor("tiny-gemma3n", tokenizer, 32),
        )  # fmt: skip
        full_3n.save_to_preset(str(tmp_path / "gemma3n"))
        for name, original in (("gemma4", full), ("gemma3n", full_3n)):
            text, preprocessor = builder.build(presets.resolve(str(tmp_path / name)), 32)
            assert set(builder.input_names(text)) <= {"token_ids", "padding_mask", "position_ids"}, name
            assert preprocessor.image_converter is None and preprocessor.audio_converter is None
            weights = {w.path: keras.ops.convert_to_numpy(w) for w in original.backbone.weights}
            for weight in text.backbone.weights:
                np.testing.assert_array_equal(keras.ops.convert_to_numpy(weight), weights[weight.path])
        empty_images = {"pixel_values": np.zeros((1, 0, 1, 192), "float32"), "vision_indices": np.zeros((1, 0), "int32"),
                        "pixel_position_ids": np.zeros((1, 0, 1, 2), "int32"), "vision_mask": np.zeros_like(tokens)}  # fmt: skip
        text, _ = builder.build(presets.resolve(str(tmp_path / "gemma4")), 32)
        with_images = keras.ops.convert_to_numpy(
            full({"token_ids": tokens, "padding_mask": np.ones_like(tokens),
                  "position_ids": np.arange(6)[None].astype("int32"), **empty_images})
        )  # fmt: skip
        np.testing.assert_allclose(logits(text, tokens), with_images, atol=1e-5)


# --- a Gemma 4 preset with its vision encoder, saved as keras-hub saves the real ones -----------------------------


@pytest.fixture(scope="module")
def gemma4_vision_dir(tmp_path_factory):
    """tiny-gemma4-vision saved with keras-hub's save_to_preset: a Gemma 4 preset directory with a vision encoder,
    loaded as a real preset is (builder._from_preset), not built in-process as the tiny one is; and its encoder's
    weights."""
    import keras

    with float32_policy():
        lm, preprocessor = builder.load_base(presets.resolve("tiny-gemma4-vision"), 64)
        lm.preprocessor = preprocessor
        path = tmp_path_factory.mktemp("gemma4-vision") / "preset"
        lm.save_to_preset(str(path))
    return path, {w.path: keras.ops.convert_to_numpy(w) for w in lm.backbone.vision_encoder.weights}


def coloured_squares(directory, n=4):
    """n records, each a 32x32 square and its colour, in directory/pics.jsonl."""
    from PIL import Image

    colours = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
    records = []
    for i in range(n):
        name = list(colours)[i % 3]
        Image.new("RGB", (32, 32), colours[name]).save(directory / f"sq{i}.png")
        turns = [{"role": "user", "content": "<image>What colour is this?"}, {"role": "assistant", "content": name}]
        records.append({"messages": turns, "images": [f"sq{i}.png"]})
    return write_jsonl(directory / "pics.jsonl", records)


def test_a_gemma4_preset_keeps_its_vision_encoder_for_a_run_on_pictures_alone(gemma4_vision_dir, tmp_path):
    """Pictures build the preset with its vision encoder and image converter (no audio encoder); the run's
    recorded decision brings them back to load it (eval and generate) and export it; a text run's model has neither.
    Generating from a picture: the command-line test below, and tests/test_images.py on every backend."""
    import keras
    import yaml

    from finetune.training import resolve, runs

    directory, encoder_weights = gemma4_vision_dir
    source = presets.resolve(str(directory))
    out = tmp_path / "run"
    with float32_policy():
        seeing, preprocessor = builder.load_base(source, 64, images=True)
        flags = {"model.preset": str(directory), "data.path": str(coloured_squares(tmp_path)), "data.template": "auto",
                 "model.seq_len": 64, "model.precision": "float32", "train.batch_size": 2, "train.max_steps": 2,
                 "data.eval_fraction": 0, "train.samples": 0, "backend": BACKEND, "output.dir": str(out)}  # fmt: skip
        assert finetune.run(finetune.load_config("tiny", flags))["steps"] == 2
        loaded = finetune.load(out)
        finetune.export(out, "lora", tmp_path / "lora")  # the base rebuilt with its encoder: adapter.json fits it
        finetune.export(out, "merged", tmp_path / "merged")
        cfg = runs.open_run(out).config  # the same run's, as a text file would have recorded it
        text = resolve.finished(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, images=None)))
        text_model = builder.build_model(source, text.recipe(train=False))
    assert seeing.backbone.vision_encoder is not None and seeing.backbone.audio_encoder is None
    for weight in seeing.backbone.vision_encoder.weights:  # the preset's encoder weights, read
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(weight), encoder_weights[weight.path])
    converter = preprocessor.image_converter  # keras-hub 0.32 reloads it with Gemma 4's 280 tokens, pooled 3x3
    assert (converter.max_soft_tokens, converter.pooling_kernel_size) == (4, 2)
    assert preprocessor.audio_converter is None and preprocessor.video_converter is None
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["images"] == 1
    adapted = [entry["layer"] for entry in json.loads((out / "adapter.json").read_text())["adapted"]]
    assert adapted and all(name.startswith("decoder_block_") for name in adapted), adapted
    assert loaded.backbone.vision_encoder is not None
    merged = json.loads((tmp_path / "merged" / "config.json").read_text())["config"]
    assert merged["vision_encoder"] is not None and merged["audio_encoder"] is None
    assert builder.encoders(text_model.lm.backbone) == [] and text_model.preprocessor.image_converter is None


@pytest.mark.backend_neutral  # the build with the encoder: the test above, on every backend; the command line on
# pictures: tests/test_images.py, on every backend
def test_the_command_line_trains_a_gemma4_preset_directory_on_pictures_and_generates(gemma4_vision_dir, tmp_path):
    from test_as_typed import finetune as typed

    directory, _ = gemma4_vision_dir
    coloured_squares(tmp_path)
    typed("gemma", "--preset", str(directory), "--backend", BACKEND, "--data", "pics.jsonl", "--max-steps", "2",
          "--seq-len", "64", "--batch-size", "2", "--eval-fraction", "0", "--set", "train.samples=0", "--output",
          "run", cwd=tmp_path)  # fmt: skip
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 2
    answered = typed("generate", "--run", "run", "--image", "sq2.png", "--prompt", "What colour is this?",
                     "--max-new-tokens", "2", cwd=tmp_path)  # fmt: skip
    assert answered.stdout.strip() and "generated on" in answered.stderr
