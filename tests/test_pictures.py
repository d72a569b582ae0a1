"""Pictures held in memory (pictures.py): a Hugging Face dataset's `Image` columns, read through hf:NAME, checked
and refused by their row as a file's pictures are, counted by `finetune data`, and trained on.

The datasets are local folders of one Parquet file, whose schema keeps the Image features, loaded offline."""

import io
import json

import pytest
from conftest import BACKEND, invoke

from finetune.data import formats, images, pictures
from finetune.platform.errors import UserError

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 40)}


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def png(colour: str, size: int = 32) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), COLOURS[colour]).save(out, format="PNG")
    return out.getvalue()


def trl_row(colour: str, parts: int = 1, column: str = "images", picture: bytes | None = None) -> dict:
    """TRL's form: image parts in the user's content, the pictures in `images` (or one in `image`)."""
    question = [{"type": "image", "text": None}] * parts + [{"type": "text", "text": "What colour is this?"}]
    messages = [{"role": "user", "content": question},
                {"role": "assistant", "content": [{"type": "text", "text": colour}]}]  # fmt: skip
    cell = {"bytes": picture or png(colour), "path": None}
    return {"messages": messages, column: [cell] if column == "images" else cell}


def image_set(folder, rows: list[dict], column: str = "images") -> str:
    """hf:FOLDER of `rows`, whose `column` is a list of Image features (`images`) or one (`image`)."""
    import datasets

    text = datasets.Value("string")
    picture = [datasets.Image()] if column == "images" else datasets.Image()
    features = datasets.Features({"messages": [{"role": text, "content": [{"type": text, "text": text}]}],
                                  column: picture})  # fmt: skip
    folder.mkdir(parents=True)
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(folder / "train.parquet"))
    return f"hf:{folder}"


def files_under(folder) -> list:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if "cache" not in p.parts)


@pytest.mark.one_backend
def test_an_image_column_is_read_into_memory_and_fingerprinted_by_its_bytes(tmp_path):
    colours = list(COLOURS)
    source = image_set(tmp_path / "set", [trl_row(c) for c in colours])
    before = files_under(tmp_path)
    records, found = formats.read(source)
    assert found == "chat" and files_under(tmp_path) == before  # nothing written beside the data
    assert all(isinstance(p, pictures.Picture) for r in records for p in r.images)
    assert [r.images[0].data for r in records] == [png(c) for c in colours]
    assert records[2].images[0].label == f"{source} row 2 image 1"
    assert records[0].turns[0] == ("user", "<image>What colour is this?") and records[0].response == "red"
    assert tuple(images.rgb(records[1].images[0])[0, 0]) == COLOURS["green"]
    # `image`, one picture a row, reads the same; the fingerprint follows the bytes, not the dataset's name.
    single, _ = formats.read(image_set(tmp_path / "single", [trl_row(c, column="image") for c in colours], "image"))
    assert [r.images[0].data for r in single] == [r.images[0].data for r in records]
    assert formats.fingerprint(single) == formats.fingerprint(records)
    changed, _ = formats.read(image_set(tmp_path / "changed", [trl_row(c, picture=png("red")) for c in colours]))
    assert [r.turns for r in changed] == [r.turns for r in records]
    assert formats.fingerprint(changed) != formats.fingerprint(records)


def _broken(folder):
    return image_set(folder, [trl_row("red"), trl_row("green", picture=b"not a picture")])


def _more_placeholders(folder):
    return image_set(folder, [trl_row("red"), trl_row("green", parts=2)])


def _fewer_placeholders(folder):
    return image_set(folder, [trl_row("red"), trl_row("green", parts=0)])


REFUSALS = {
    "undecodable": (_broken, r"row 1: #1 is not an image Pillow reads"),
    "more-placeholders": (_more_placeholders, r"row 1: the record has 2 <image> placeholder\(s\) and 1 image\(s\)"),
    "fewer-placeholders": (_fewer_placeholders, r"row 1: the record has 0 <image> placeholder\(s\) and 1 image"),
}


@pytest.mark.one_backend
@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_row_whose_pictures_do_not_fit_is_refused_by_its_row(case, tmp_path):
    make, message = REFUSALS[case]
    source = make(tmp_path / "set")
    with pytest.raises(UserError, match=f"{source} {message}"):
        formats.read(source)


@pytest.mark.one_backend
def test_a_picture_past_pillows_decompression_limit_is_refused_before_it_is_decoded(tmp_path, monkeypatch):
    from PIL import Image

    source = image_set(tmp_path / "set", [trl_row("red", picture=png("red", 4)), trl_row("green")])
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 32 x 32 is past it, 4 x 4 is not
    with pytest.raises(UserError, match=rf"{source} row 1: image #1 is too large to decode \(over Pillow's limit"):
        formats.read(source)


@pytest.mark.one_backend
def test_a_row_gives_its_pictures_as_image_cells_only(tmp_path):
    from PIL import Image

    drawn = Image.new("RGB", (8, 8), COLOURS["blue"])  # a decoded cell, as `datasets` gives one by default
    (held,) = pictures.in_row({"image": drawn}, "hf:x row 0")
    assert tuple(images.rgb(held)[0, 0]) == COLOURS["blue"]
    assert pictures.in_row({"images": ["a.png"]}, "hf:x row 0") is None  # paths: refused by formats, below
    with pytest.raises(UserError, match="hf:x row 0: the row has both an `images` and an `image` column"):
        pictures.in_row({"images": [drawn], "image": drawn}, "hf:x row 0")
    with pytest.raises(UserError, match="hf:x row 0: `image` must hold pictures"):
        pictures.in_row({"image": 3}, "hf:x row 0")
    with pytest.raises(UserError, match="row 0: `images` holds file paths, which hf: does not resolve"):
        formats._pictures({"images": ["a.png"]}, "hf:x row 0", "hf:x")


@pytest.mark.one_backend
def test_finetune_data_counts_a_sets_pictures_and_exits_2_on_a_broken_one(tmp_path):
    source = image_set(tmp_path / "set", [trl_row(c) for c in COLOURS])
    result = invoke("data", source, "--preset", "tiny-gemma3-vision", "--seq-len", "64")
    assert result.exit_code == 0, result.output
    assert "images: 4 in 4 of 4 records, at most 1 a record" in result.output
    assert "image sizes (width x height, images): 32x32 (4)" in result.output
    broken = _broken(tmp_path / "broken")
    before = files_under(tmp_path)
    result = invoke("data", broken, "--preset", "tiny-gemma3-vision")
    assert result.exit_code == 2 and f"{broken} row 1: #1 is not an image Pillow reads" in result.output
    assert "Traceback" not in result.output and files_under(tmp_path) == before


# What this checks is where the pictures come from; how they are converted and trained on every backend is
# test_images.py's test_the_command_line_trains_on_pictures_and_generates_from_one.
@pytest.mark.backend_neutral
def test_the_command_line_trains_on_a_hugging_face_sets_pictures(tmp_path):
    from test_as_typed import finetune as typed

    source = image_set(tmp_path / "set", [trl_row(c) for c in COLOURS])
    typed("gemma", "--preset", "tiny-gemma3-vision", "--backend", BACKEND, "--data", source, "--max-steps", "2",
          "--seq-len", "64", "--batch-size", "2", "--eval-fraction", "0", "--set", "train.samples=0", "--output", "run",
          cwd=tmp_path)  # fmt: skip
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 2
    assert [p for p in files_under(tmp_path) if not p.startswith("run")] == ["set", "set/train.parquet"]
