"""Pictures carried in memory: the cells of a Hugging Face dataset's `Image` columns, read through hf:NAME.

A record's pictures are image file paths (JSONL, JSON, Parquet files: images.py) or, for hf:NAME rows, Picture
values that hold each picture's encoded bytes as the dataset stores them (PNG, JPEG...). Nothing is written to
disk for them: Pillow opens both kinds the same way (opened()), so the checks, the converter and `finetune data`
take either. The dataset's Image columns are read undecoded, so that each picture is checked against Pillow's
decompression-bomb limit (images.check) before anything decodes it.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field

from finetune.platform.errors import UserError

# The columns a row's pictures are read from: `images`, a list (TRL's and LLaMA-Factory's name), or `image`, one
# picture (as many captioning and VQA sets name it); either holds an Image feature, a list of them, or nothing.
COLUMNS = ("images", "image")


@dataclass(frozen=True)
class Picture:
    """One picture of a dataset row, in memory."""

    data: bytes = field(repr=False)
    """The encoded image (PNG, JPEG...), as the dataset stores it."""
    where: str
    """The row it comes from: "hf:NAME row 3"."""
    number: int
    """Its place among the row's pictures, from 1."""

    def __str__(self) -> str:
        # Messages name the row first ("hf:NAME row 3: image #1 cannot be read"), so the picture is its number.
        return f"#{self.number}"

    @property
    def label(self) -> str:
        return f"{self.where} image {self.number}"

    @property
    def digest(self) -> str:
        """What a resume's data fingerprint compares: the bytes, not where they were read."""
        return "sha256:" + hashlib.sha256(self.data).hexdigest()


def opened(picture):
    """Pillow's image of a file path or a Picture (lazy, as Image.open is: the header until it is loaded)."""
    from PIL import Image

    if isinstance(picture, Picture):
        return Image.open(io.BytesIO(picture.data))
    return Image.open(picture)


def key(picture) -> str:
    """A picture as the data fingerprint writes it: a path as it is, a Picture by its bytes."""
    return picture.digest if isinstance(picture, Picture) else str(picture)


def undecoded(rows):
    """A `datasets.Dataset` whose picture columns (COLUMNS) hold Image features, read with its features left
    undecoded: each picture as its {bytes, path}, not a PIL image, so that the checks refuse one too large before
    it is decoded. As an iterable over the same rows, which writes nothing (a cast would write a cache file)."""
    import datasets

    features = getattr(rows, "features", None) or {}
    held = [name for name in COLUMNS if _holds_images(features.get(name), datasets)]
    if not held:
        return rows
    iterable = rows.to_iterable_dataset()
    if hasattr(iterable, "decode"):
        return iterable.decode(False)
    for name in held:  # datasets before 3.x: a cast, which writes its cache file in the datasets cache
        plain = datasets.Image(decode=False)
        rows = rows.cast_column(name, plain if isinstance(features[name], datasets.Image) else [plain])
    return rows


def _holds_images(feature, datasets) -> bool:
    """Whether a column's feature is an Image, or a list of them."""
    if isinstance(feature, datasets.Image):
        return True
    inner = feature[0] if isinstance(feature, list) and len(feature) == 1 else getattr(feature, "feature", None)
    return isinstance(inner, datasets.Image)


def in_row(row: dict, where: str) -> tuple[Picture, ...] | None:
    """The pictures of a Hugging Face row's `images` or `image` column, in order; None where it has neither
    (or holds file paths, read as a file's are)."""
    found = [name for name in COLUMNS if row.get(name) is not None]
    if len(found) > 1:
        raise UserError(f"{where}: the row has both an `images` and an `image` column; give its pictures in one")
    if not found:
        return None
    cells = row[found[0]]
    cells = cells if isinstance(cells, (list, tuple)) else [cells]
    if all(isinstance(cell, str) for cell in cells) and found[0] == "images":
        return None  # paths, as LLaMA-Factory's sets give them
    return tuple(Picture(_encoded(cell, where, found[0]), where, n) for n, cell in enumerate(cells, start=1))


def _encoded(cell, where: str, column: str) -> bytes:
    """A cell's encoded bytes: an undecoded Image feature's {bytes, path}, or a PIL image (encoded as PNG, which
    keeps every pixel)."""
    from PIL import Image

    if isinstance(cell, dict) and isinstance(cell.get("bytes"), bytes):
        return cell["bytes"]
    if isinstance(cell, dict) and isinstance(cell.get("path"), str):
        return _file_bytes(cell["path"], where)
    if isinstance(cell, Image.Image):
        out = io.BytesIO()
        cell.save(out, format="PNG")
        return out.getvalue()
    raise UserError(
        f"{where}: `{column}` must hold pictures (a datasets Image feature, or a list of them), got "
        f"{type(cell).__name__}"
    )


def _file_bytes(path: str, where: str) -> bytes:
    """An Image cell stored by path (an imagefolder dataset's local files), read as it is."""
    from pathlib import Path

    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"{where}: image {path} cannot be read ({e.strerror or e})") from None
