"""`finetune plan --images N` (training/plan.py): Gemma 3's pictures in the plan and in --batch-size auto's.

The counts are checked against keras-hub's numbers (256 soft tokens a picture, the encoder's published weights),
and on JAX against what XLA allocates for a train step whose frozen encoder's pass is its largest part. The check
at gemma3_4b's real dims is tools/vision_peak.py's (docs/images.md gives its result).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BACKEND, float32_policy, invoke

from finetune import config
from finetune.model import archs
from finetune.training import plan, resolve

GEMMA3_4B = {"model.preset": "gemma3_4b", "model.seq_len": 512, "train.batch_size": 1, "model.precision": "bfloat16"}
# Passes of the step: the decoder's and the encoder's, of which the plan's total takes the larger.
PASSES = ("activations", "logits", "dequantized_kernel", "vision_forward", "total")


def make(device=None, **settings):
    cfg = config.load(None, {"backend": "torch", **settings})
    return plan.make(cfg, None, plan.device(device) if device else None)


@pytest.mark.one_backend
def test_gemma3_4b_with_a_picture_counts_256_soft_tokens_and_the_frozen_encoder_s_pass():
    planned = make(**GEMMA3_4B, **{"data.images": 1})
    assert planned.images == {"per_example": 1, "tokens_per_image": 256, "slots": 2, "image_size": 896}
    assert any("260 of the 512 tokens" in note and "252 left for the text" in note for note in planned.notes)
    # keras-hub builds the encoder in float32 under bfloat16; a run feeds it both of a row's image slots. PyTorch
    # holds the scores and their softmax at once (XLA, one of them: the JAX test below).
    per_picture = (2 * 16 * 4096**2 + 5 * 4096 * 1152) * 4
    m = planned.memory
    assert m["vision_forward"] == 2 * per_picture and m["image_pixels"] == 2 * 896 * 896 * 3 * 4
    assert {g.name: g for g in planned.groups}["vision encoder"].bytes_per_device == 419_816_304 * 4
    held = sum(v for k, v in m.items() if k not in PASSES)
    decoder = m["activations"] + m["logits"] + m["dequantized_kernel"]
    assert m["total"] == held + max(m["vision_forward"], decoder)
    text = make(**GEMMA3_4B)  # no pictures: the encoder's weights load, it never runs
    assert text.images is None and "vision_forward" not in text.memory
    assert text.memory["weights"] == m["weights"] and m["total"] > text.memory["total"]


@pytest.mark.one_backend
def test_batch_size_auto_fits_fewer_rows_with_pictures():
    def rows(**settings):
        planned = make("l4", **{**GEMMA3_4B, "train.batch_size": "auto"}, **settings)
        (note,) = [n for n in planned.notes if n.startswith("batch auto")]
        return int(re.search(r"up to (\d+) sequences", note).group(1))

    assert 1 <= rows(**{"data.images": 1}) < rows()


@pytest.mark.one_backend
def test_the_encoder_s_config_gives_keras_hub_s_counts():
    for name in ("gemma3_4b", "gemma3_12b", "gemma3_27b"):
        arch = archs.ARCHS[name]
        assert archs.vision_parameter_count(arch.vision) == arch.vision_params, name
        assert archs.tokens_per_image(arch.vision) == 256
    tiny = make(**{"model.preset": "tiny-gemma3-vision", "model.seq_len": 64, "data.images": 2})
    assert tiny.images["tokens_per_image"] == 4 and "vision encoder" in {g.name for g in tiny.groups}


@pytest.mark.one_backend
def test_a_run_counts_its_data_s_pictures_over_images():
    assert resolve._images(None, 1) == resolve.Decision(1, "the most a record of the data holds")
    assert resolve._images(2, 1).value == 1 and "--images 2 is for plans" in resolve._images(2, 1).why


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "tiny-gemma3-vision", "--images", "3"], "takes at most 2 pictures an example"),
        (["--preset", "tiny-gemma3-vision", "--images", "-1"], "images per example must not be negative"),
        (["--preset", "tiny-gemma3-vision", "--images", "2", "--seq-len", "16"], "raise --seq-len"),
        (["--preset", "gemma_2b_en", "--images", "1"], "it has no vision encoder"),
        (["--preset", "gemma4_4b", "--images", "1"], "trains its text decoder alone"),
        (["--preset", "tiny-gemma3-vision", "--images", "one"], "--images"),
    ],
)
def test_a_bad_images_value_exits_2_with_a_message(args, message):
    result = invoke("plan", "--backend", "torch", *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.one_backend
def test_the_command_plans_a_picture_in_a_fresh_process(tmp_path):
    command = Path(sys.executable).with_name("finetune")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    args = [str(command), "plan", "--preset", "tiny-gemma3-vision", "--images", "1"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    for row in ("images 1 per example, 4 soft tokens each", "vision encoder, forward", "pictures, the batch's"):
        assert row in done.stdout, row
    assert not list(tmp_path.iterdir())  # a plan writes nothing


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's memory analysis is JAX's")
def test_the_plan_of_a_frozen_encoder_s_pass_is_within_15_percent_of_what_xla_allocates(tmp_path, monkeypatch):
    """tiny-gemma3-vision with an encoder whose pass is most of the step: 64x64 pictures in 256 patches, 4 heads,
    4 blocks, float32, batch 4 x 64 with one picture a row. Were the encoder's activations kept for the backward,
    XLA would hold about four times its planned pass."""
    import dataclasses
    from types import SimpleNamespace

    import jax
    import numpy as np
    from PIL import Image

    from finetune.data import batching, formats, templates
    from finetune.model import builder, presets
    from finetune.training import prepare

    heavy = dict(presets.TINY_GEMMA3_VISION_ENCODER, image_size=64, num_heads=4, hidden_dim=32, num_layers=4)
    spec = dataclasses.replace(presets.TINY["tiny-gemma3-vision"], vision=heavy)
    monkeypatch.setitem(presets.TINY, "tiny-gemma3-vision", spec)
    lines = []
    for i in range(4):
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(tmp_path / f"{i}.png")
        lines.append(f'{{"messages": [{{"role": "user", "content": "<image>Colour {i}?"}}, '
                     f'{{"role": "assistant", "content": "blue"}}], "images": ["{i}.png"]}}')  # fmt: skip
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    with float32_policy():
        lora = config.LoraConfig(rank=4)
        recipe = builder.Recipe(64, "float32", lora=lora, optimizer=builder.Optimizer(1e-3, 0.0))
        model = builder.build_model(presets.resolve("tiny-gemma3-vision"), recipe)
        records = formats.read(str(tmp_path / "p.jsonl"))[0]
        cfg = SimpleNamespace(model=SimpleNamespace(seq_len=64), data=SimpleNamespace(train_on_prompt=False))
        usable = prepare.pictured_examples(records, templates.get("gemma-chat"), model.preprocessor, cfg, "p")
        arrays = batching.pad([e for _, e in usable], 64)
        names = builder.input_names(model.lm)
        x, y, w = batching.inputs(arrays, np.arange(4), 1, batching.target_width(arrays, 4), names=names)
        trainer = model.trainer
        trainer.train_on_batch(x, y, sample_weight=w)  # builds AdamW
        state = tuple(
            [v.value for v in variables]
            for variables in (trainer.trainable_variables, trainer.non_trainable_variables,
                              trainer.optimizer.variables, trainer.metrics_variables)
        )  # fmt: skip
        analysis = jax.jit(trainer.train_step).lower(state, (x, y, w)).compile().memory_analysis()
    measured = analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
    planned = make(**{"backend": "jax", "model.preset": "tiny-gemma3-vision", "model.precision": "float32",
                      "model.seq_len": 64, "train.batch_size": 4, "model.remat": "off", "data.images": 1})  # fmt: skip
    assert planned.memory["vision_forward"] > 0.5 * planned.memory["total"]  # the encoder's pass is the check
    assert planned.memory["total"] == pytest.approx(measured, rel=0.15), (planned.memory, measured)
