"""Preference pairs with pictures: the picture is laid out on both sides as SFT lays it out, and read by the model.

The pairs path once trained on the literal text `<image>`; then it refused pictures. Now a pair's pictures (in its
prompt, which both answers follow) are written as the family's image tokens and attached to both rows
(methods/prepare.Media, shared with SFT's examples). Each method trains on them: test_method_matrix.py.
"""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import BACKEND, write_jsonl
from test_images import square

from finetune.config import TrainConfig
from finetune.data import batching, formats, images, pair_batches, templates
from finetune.methods import preference, prepare, registry
from finetune.platform.errors import UserError

PRESET = "tiny-gemma3-vision"


def _cfg(seq_len=64, preset=PRESET):
    return SimpleNamespace(model=SimpleNamespace(seq_len=seq_len, preset=preset),
                           data=SimpleNamespace(train_on_prompt=False))  # fmt: skip


def _preprocessor():
    from finetune.model import presets

    return presets.tiny_preprocessor(PRESET, presets.tiny_tokenizer(PRESET), 64)


def _pairs(tmp_path, colours=("red", "blue"), long_prompt=False):
    rows = []
    for i, colour in enumerate(colours):
        prompt = "<image>What colour is it?" + (" Think hard." * 40 if long_prompt and i == 0 else "")
        rows.append({"prompt": prompt, "chosen": f"{colour.title()}.", "rejected": "Green, maybe.",
                     "images": [square(tmp_path / f"{colour}.png", colour)]})  # fmt: skip
    records, found = formats.read(str(write_jsonl(tmp_path / "pairs.jsonl", rows)))
    assert found == "preference"
    return records


@pytest.mark.one_backend
def test_a_pair_s_picture_is_on_both_sides_where_its_prompt_places_it(tmp_path, capsys):
    records = _pairs(tmp_path, long_prompt=True)
    preprocessor = _preprocessor()
    vision = images.vision_of(preprocessor)
    made = preference.pair_examples(records, templates.get("none"), preprocessor, _cfg(), "pairs.jsonl")
    assert "1 pairs with pictures or audio skipped" in capsys.readouterr().out  # its prompt would be cut
    ((record, pair),) = made
    assert record.images and record.response == "Blue."
    for side in (pair.chosen, pair.rejected):
        ids = np.asarray(side.token_ids)
        soft = np.flatnonzero(ids[:-1] == vision.placeholder_id)
        assert len(soft) == vision.tokens_per_image  # the picture's tokens, not the text <image>
        np.testing.assert_array_equal(side.inputs["vision_indices"], soft)
        assert not np.asarray(side.weights)[soft].any()  # a picture is never a target
        assert side.inputs["images"].shape[0] == 1 and side.inputs["images"].any()
    np.testing.assert_array_equal(pair.chosen.inputs["images"], pair.rejected.inputs["images"])
    np.testing.assert_array_equal(
        pair.chosen.token_ids[: pair.prompt_length], pair.rejected.token_ids[: pair.prompt_length]
    )


@pytest.mark.one_backend
def test_a_placeholder_in_an_answer_is_refused(tmp_path):
    (record,) = _pairs(tmp_path, colours=("red",))
    record = dataclasses.replace(record, rejected="<image> Green.")
    with pytest.raises(UserError, match="pictures and audio clips go in its prompt"):
        preference.pair_examples([record], templates.get("none"), _preprocessor(), _cfg(), "pairs.jsonl")


@pytest.mark.parametrize(
    "preset",
    [PRESET, pytest.param("tiny-gemma3n-vision", marks=pytest.mark.skipif(BACKEND != "torch", reason="Gemma 3n "
                          "places pictures by the batch's order (numpy's layout): checked in the PyTorch suite"))],
)  # fmt: skip
def test_a_pair_with_a_picture_scores_its_chosen_answer_as_sft_scores_it(tmp_path, preset):
    """The pair view's log-probability of the chosen answer equals the response-token scoring of the same record
    as an SFT example with the same picture, and the picture changes it (red and blue, the same text)."""
    import keras

    from finetune.config import LoraConfig
    from finetune.model import builder, objective, presets
    from finetune.platform import backend

    backend.set_seed(0)
    keras.config.set_dtype_policy("float32")
    lm, preprocessor = builder.build(presets.resolve(preset), 64, "float32", images=True)
    builder.enable_lora(lm, LoraConfig(rank=2, targets=["query", "value"]), seed=0)
    records = _pairs(tmp_path, colours=("red", "blue"))
    records = [dataclasses.replace(r, response="Red.") for r in records]  # the same text, two pictures
    made = preference.pair_examples(records, templates.get("none"), preprocessor, _cfg(preset=preset), "pairs.jsonl")
    arrays = pair_batches.pad([p for _, p in made], 64)
    feed = batching.Feed(inputs=builder.input_names(lm))
    view = builder.objective_view(lm, registry.get("dpo").objective(TrainConfig(method="dpo")))
    ((_, values),) = preference.pair_outputs(view, pair_batches.Batches(arrays, 2, feed))
    paired = values[:, 5]  # logps_chosen

    sft = [dataclasses.replace(r, rejected="") for r in records]
    examples = [
        e for _, e in prepare.pictured_examples(sft, templates.get("none"), preprocessor, _cfg(preset=preset), "x")
    ]
    rows = batching.pad(examples, 64)
    x, _, _ = batching.inputs(rows, np.arange(2), 1, batching.target_width(rows, 2), names=feed.inputs)
    scoring = objective.ScoringView(lm, builder.chunk_for(lm))
    losses = keras.ops.convert_to_numpy(scoring(x)["loss"])
    row = x["loss_positions"].ravel() // 64  # each slot's row: the weighted positions lie in front (batching.targets)
    scored = -np.bincount(row, weights=(losses * x["loss_weights"]).ravel(), minlength=2)
    np.testing.assert_allclose(paired, scored, rtol=1e-5, atol=1e-5)
    assert abs(paired[0] - paired[1]) > 1e-4  # the picture reaches the answer's log-probability


@pytest.mark.one_backend
def test_the_plan_counts_a_pair_s_pictures_on_both_its_rows():
    """A pair is two rows, each with its prompt's pictures: the plan's pixels and encoder pass are twice SFT's."""
    from finetune import config
    from finetune.training import plan

    def planned(method):
        settings = {"backend": "torch", "model.preset": PRESET, "model.seq_len": 64, "data.images": 1,
                    "train.batch_size": 2, "train.method": method}  # fmt: skip
        return plan.make(config.load(None, settings), None, None).memory

    sft, dpo = planned("sft"), planned("dpo")
    assert sft["image_pixels"] > 0 and dpo["image_pixels"] == 2 * sft["image_pixels"]
    assert dpo["vision_forward"] == 2 * sft["vision_forward"]


@pytest.mark.one_backend
def test_orpo_s_every_token_targets_leave_the_picture_s_tokens_out(tmp_path):
    """ORPO's NLL takes every token of the chosen sequence but the pictures' soft tokens, which weigh 0 in SFT."""
    preprocessor = _preprocessor()
    vision = images.vision_of(preprocessor)
    made = preference.pair_examples(_pairs(tmp_path), templates.get("none"), preprocessor, _cfg(), "pairs.jsonl")
    arrays = pair_batches.pad([p for _, p in made], 64, whole_chosen=True)
    targets = pair_batches._targets(arrays, "chosen")
    soft = arrays.chosen["labels"] == vision.placeholder_id
    assert soft.sum() == 2 * vision.tokens_per_image and not targets[soft].any()
    np.testing.assert_array_equal(targets[~soft], arrays.chosen["padding_mask"][~soft])


@pytest.mark.one_backend
def test_predict_refuses_a_pictured_record_too_long_rather_than_leave_a_line_out(tmp_path):
    """A classifier's training skips a pictured record longer than --seq-len; `finetune predict` writes a line for
    each record, in order, so there it is refused, naming the record."""
    from finetune.methods import classify

    records = [dataclasses.replace(r, instruction="<image>" + " long" * 80) for r in _pairs(tmp_path)[:1]]
    with pytest.raises(UserError, match="longer than the run's --seq-len 64"):
        classify.sequences(records, templates.get("none"), _preprocessor(), _cfg(), "x.jsonl", None)


@pytest.mark.one_backend  # token counts: numpy's and the tokenizer's
def test_finetune_data_counts_a_pair_s_picture_and_the_pairs_a_run_skips_for_it(tmp_path):
    """`finetune data` on pairs with pictures counts them as the preset's soft tokens and names the pairs a run
    skips because cutting their prompt would cut a picture, as the run does (preference.pair_examples)."""
    from conftest import invoke
    from test_images import write_lines

    rows = [{"prompt": "<image>" + "Tell me the colour. " * (1 + 10 * i), "chosen": " Red.", "rejected": " Blue.",
             "images": [square(tmp_path / f"{i}.png")]} for i in range(4)]  # fmt: skip
    data = write_lines(tmp_path / "pairs.jsonl", rows)
    result = invoke("data", str(data), "--preset", PRESET, "--seq-len", "128")
    assert result.exit_code == 0, result.output
    assert f"each picture and clip as {PRESET}'s soft tokens" in result.output
    assert "2 of 4 pairs are cut" in result.output and "2 with pictures or audio skipped" in result.output
    records, _ = formats.read(str(data))
    kept = preference.pair_examples(records, templates.get("none"), _preprocessor(), _cfg(128), "pairs.jsonl")
    assert len(kept) == 2
