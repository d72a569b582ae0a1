"""Pictures in the data: TRL's and LLaMA-Factory's forms, their refusals, and tiny-gemma3-vision training on them."""

import json

import numpy as np
import pytest
from conftest import BACKEND, invoke

from finetune.data import formats, images

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def square(path, colour="red", size=32):
    from PIL import Image

    Image.new("RGB", (size, size), COLOURS[colour]).save(path)
    return path.name


def trl(picture: str, answer: str = "red") -> dict:
    question = [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        "images": [picture],
    }


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pictures(tmp_path, n=8):
    """n TRL records of coloured squares, in tmp_path/pics.jsonl."""
    names = list(COLOURS)
    records = [trl(square(tmp_path / f"sq{i}.png", names[i % 3]), names[i % 3]) for i in range(n)]
    return write_lines(tmp_path / "pics.jsonl", records)


@pytest.mark.one_backend
def test_trl_and_llama_factory_forms_read_to_the_same_record(tmp_path):
    square(tmp_path / "a.png")
    llama_factory = {
        "messages": [
            {"role": "user", "content": "<image>What colour is this?"},
            {"role": "assistant", "content": "red"},
        ],
        "images": ["a.png"],
    }
    write_lines(tmp_path / "trl.jsonl", [trl("a.png")])
    write_lines(tmp_path / "lf.jsonl", [llama_factory])
    (from_trl,), _ = formats.read(str(tmp_path / "trl.jsonl"))
    (from_lf,), _ = formats.read(str(tmp_path / "lf.jsonl"))
    assert from_trl == from_lf
    assert from_trl.turns[0] == ("user", "<image>What colour is this?")
    assert from_trl.images == (str((tmp_path / "a.png").resolve()),)  # relative to the data file
    assert formats.fingerprint([from_trl]) != formats.fingerprint(
        [formats.Record("<image>What colour is this?", "red")]
    )


def _missing(tmp_path):
    return [trl("nowhere.png")]


def _not_an_image(tmp_path):
    (tmp_path / "notes.png").write_text("not a picture")
    return [trl("notes.png")]


def _truncated(tmp_path):
    square(tmp_path / "whole.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "whole.png").read_bytes()[:60])
    return [trl("cut.png")]


def _more_placeholders(tmp_path):
    record = trl(square(tmp_path / "a.png"))
    record["messages"][0]["content"].insert(0, {"type": "image"})
    return [record]


def _fewer_placeholders(tmp_path):
    record = trl(square(tmp_path / "a.png"))
    record["images"].append(square(tmp_path / "b.png"))
    return [record]


def _too_large(tmp_path):
    square(tmp_path / "big.png", size=200)  # 40,000 pixels, past the limit the test sets
    return [trl("big.png")]


BAD = {
    "missing-image": (_missing, "does not exist"),
    "not-an-image": (_not_an_image, "is not an image"),
    "truncated-image": (_truncated, "cannot be read"),
    "more-placeholders-than-images": (_more_placeholders, "2 <image> placeholder(s) and 1 image(s)"),
    "fewer-placeholders-than-images": (_fewer_placeholders, "1 <image> placeholder(s) and 2 image(s)"),
    "decompression-bomb": (_too_large, "too large to decode"),
}


@pytest.mark.one_backend
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_picture_exits_2_naming_its_line_and_writes_nothing(case, tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)
    make, expected = BAD[case]
    good = trl(square(tmp_path / "good.png"))
    data = write_lines(tmp_path / "bad.jsonl", [good, *make(tmp_path)])
    out = tmp_path / "run"
    result = invoke("gemma", "--preset", "tiny-gemma3-vision", "--data", data, "--output", out)
    message = result.stderr.strip()
    assert result.exit_code == 2, result.output
    assert message.startswith("error: ") and f"{data}:2" in message and expected in message, message
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.one_backend
def test_text_records_on_a_text_preset_refuse_pictures(tmp_path):
    result = invoke("gemma", "--preset", "tiny", "--data", pictures(tmp_path), "--output", tmp_path / "run")
    assert result.exit_code == 2 and "has no vision encoder" in result.stderr, result.output
    assert not (tmp_path / "run").exists()


def test_image_inputs_point_at_the_soft_tokens_and_weigh_nothing(tmp_path):
    from finetune.model import presets

    tokenizer = presets.tiny_tokenizer("tiny-gemma3-vision")
    vision = images.vision_of(presets.tiny_preprocessor("tiny-gemma3-vision", tokenizer, 64))
    assert vision.tokens_per_image == 4 and vision.image_size == (32, 32)
    record = formats.read(str(pictures(tmp_path, 1)))[0][0]
    from finetune.data import templates
    from finetune.training import prepare

    ((_, example),) = prepare.pictured_examples(
        [record], templates.get("gemma-chat"), vision_preprocessor(), _cfg(), "x"
    )
    ids = np.asarray(example.token_ids)
    soft = np.flatnonzero(ids[:-1] == vision.placeholder_id)
    assert list(example.inputs["vision_indices"][:4]) == list(soft) and len(soft) == 4
    assert not np.asarray(example.weights)[ids == vision.placeholder_id].any()
    picture = example.inputs["images"]
    assert picture.shape == (2, 32, 32, 3) and not picture[1].any()  # the second slot is empty
    np.testing.assert_allclose(picture[0, 0, 0], np.array(COLOURS["red"]) / 127.5 - 1, atol=1e-6)


def vision_preprocessor():
    from finetune.model import presets

    return presets.tiny_preprocessor("tiny-gemma3-vision", presets.tiny_tokenizer("tiny-gemma3-vision"), 64)


def _cfg():
    from types import SimpleNamespace

    return SimpleNamespace(model=SimpleNamespace(seq_len=64, preset="tiny-gemma3-vision"),
                           data=SimpleNamespace(train_on_prompt=False))  # fmt: skip


def test_tiny_gemma3_vision_trains_on_pictures(tmp_path):
    out = tmp_path / "run"
    flags = ["--backend", BACKEND, "--seq-len", "64", "--batch-size", "2", "--max-steps", "2"]
    result = invoke("gemma", "--preset", "tiny-gemma3-vision", "--data", pictures(tmp_path), *flags, "--output", out,
                    "--set", "train.samples=0")  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    assert "auto: the data has images" in result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert np.isfinite(metrics["eval_loss"])
