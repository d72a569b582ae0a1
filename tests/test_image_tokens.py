"""--image-tokens N: a Gemma 4 picture's soft tokens. tiny-gemma4-vision trains at 70 from the command line on every
backend, its rows hold 70 soft tokens a picture, and its merged export reloads with 70; the refusals, and the plan's
count, run in the PyTorch suite alone."""

import json

import numpy as np
import pytest
from conftest import BACKEND, invoke
from test_images import GEMMA4, pictures


def test_a_run_at_70_image_tokens_trains_and_exports_with_them(tmp_path):
    """`finetune gemma --image-tokens 70` in a fresh process; then its rows and its merged export, through the API."""
    import keras_hub
    from test_as_typed import finetune as typed

    import finetune
    from finetune.data import images
    from finetune.model import builder, presets

    pictures(tmp_path, 4)
    typed("gemma", "--preset", GEMMA4, "--backend", BACKEND, "--data", "pics.jsonl", "--image-tokens", "70",
          "--seq-len", "128", "--batch-size", "2", "--max-steps", "1", "--eval-fraction", "0", "--precision",
          "float32", "--set", "train.samples=0", "--output", "run", cwd=tmp_path)  # fmt: skip
    run = tmp_path / "run"
    assert json.loads((run / "metrics.json").read_text())["steps"] == 1
    saved = finetune.load_config(str(run / "config.yaml"))
    assert saved.data.image_tokens == 70

    # The run's preprocessor writes 70 soft tokens a picture, and its converter cuts up to 70 x 2² patches.
    _, preprocessor = builder.load_base(presets.resolve(GEMMA4), 128, images=True, image_tokens=70)
    vision = images.vision_of(preprocessor)
    assert vision.tokens_per_image == 70 and preprocessor.image_converter.max_soft_tokens == 70
    ids = np.asarray(preprocessor.tokenizer(vision.expansion))  # what each <image> placeholder becomes in a row
    assert int((ids == vision.placeholder_id).sum()) == 70
    assert vision.blank["pixel_values"].shape[0] == 70 * 2**2  # a picture's patches, padded to the budget's most

    finetune.export(run, "merged", tmp_path / "merged")
    merged = keras_hub.models.Gemma4CausalLMPreprocessor.from_preset(str(tmp_path / "merged"))
    assert merged.num_vision_tokens_per_image == 70  # keras-hub's preprocessor.json keeps the budget
    _, reloaded = builder.load_base(presets.resolve(str(tmp_path / "merged")), 128, images=True)
    assert reloaded.image_converter.max_soft_tokens == 70  # and the converter takes it from there


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "preset, tokens, why",
    [
        (GEMMA4, "100", "--image-tokens must be one of 70, 140, 280, 560, 1120"),
        ("tiny-gemma3-vision", "70", "only Gemma 4 lets a run choose them"),
    ],
)
def test_a_budget_gemma_4_does_not_take_exits_2_and_writes_nothing(preset, tokens, why, tmp_path):
    out = tmp_path / "run"
    result = invoke("gemma", "--preset", preset, "--data", pictures(tmp_path, 2), "--image-tokens", tokens,
                    "--output", out)  # fmt: skip
    assert result.exit_code == 2 and why in result.stderr, result.output
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.one_backend
def test_the_plan_counts_the_budget_in_the_sequence():
    from finetune import config
    from finetune.platform.errors import UserError
    from finetune.training import plan

    def planned(preset, **data):
        settings = {"model.preset": preset, "model.seq_len": 128, **{f"data.{k}": v for k, v in data.items()}}
        return plan.make(config.load(None, settings))

    made = planned(GEMMA4, images=1, image_tokens=70)
    assert made.images["tokens_per_image"] == 70
    assert any("72 of the 128 tokens with their markers, 56 left for the text" in note for note in made.notes)
    with pytest.raises(UserError, match="only Gemma 4"):
        planned("tiny-gemma3-vision", images=1, image_tokens=70)
    with pytest.raises(UserError, match="whose weights and pass the plan does not count yet"):
        planned("gemma4_2b", images=1, image_tokens=70)
