"""Pictures in training records: read, checked, converted, and laid out beside the token ids.

A record with images carries their paths (Record.images; from hf:NAME, the
pictures themselves, pictures.py) and one `<image>` placeholder in its text
where each goes, in order. Two forms are read:

- TRL's: a message's `content` is a list of parts, `{"type": "image"}` or
  `{"type": "text", "text": ...}`, and the record's `images` lists the files;
- LLaMA-Factory's: `<image>` placeholders written in the text of any format
  (chat, ShareGPT, Alpaca...), and an `images` list.

Paths are relative to the data file. Each image is opened with Pillow when the
record is read, so a missing, broken or oversized picture stops the run with
its line before anything is written; keras-hub's image converter of the preset
(Gemma3ImageConverter, Gemma4ImageConverter) resizes and scales the pixels when
the rows are made. Each placeholder becomes the family's image tokens, as
keras-hub's preprocessor writes them (LAYOUTS), and the model's image inputs
(the converter's arrays, `vision_indices`, `vision_mask`) are made here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from finetune.data import audio, pictures
from finetune.platform.errors import UserError

PLACEHOLDER = "<image>"
# The model inputs beside the tokens: the pictures as each family's converter gives them (Gemma 3: `images`, the
# resized pixels; Gemma 4: `pixel_values` and `pixel_position_ids`, its patches and their places), and where their
# soft tokens sit: per row, not per position (a batch cut to its longest row keeps them whole). vision_mask is per
# position.
PER_ROW = ("images", "pixel_values", "pixel_position_ids", "vision_indices")
INPUTS = (*PER_ROW, "vision_mask")


@dataclass(frozen=True)
class Layout:
    """How a family's keras-hub preprocessor writes a picture into the token ids."""

    marker: str
    """The tokenizer attribute naming the token its preprocessor expands into a picture's tokens: what a prompt
    to keras-hub's generate() holds where a picture goes."""
    margin: str
    """What stands on each side of a picture's tokens."""


LAYOUTS = {
    # "\n\n<start_of_image>" + "<img>" x 256 + "<end_of_image>\n\n", from <start_of_image>.
    "Gemma3CausalLMPreprocessor": Layout("start_of_image_token", "\n\n"),
    # Gemma 3n's as Gemma 3's, with <image_soft_token> x 256.
    "Gemma3nCausalLMPreprocessor": Layout("start_of_image_token", "\n\n"),
    # "<|image>" + "<|image|>" x 280 + "<image|>", from its soft token <|image|>, with no blank lines.
    "Gemma4CausalLMPreprocessor": Layout("image_placeholder", ""),
}


@dataclass(frozen=True)
class Vision:
    """What a preset's preprocessor says of its images."""

    tokens_per_image: int
    """Soft tokens each image becomes (Gemma 3: 256; Gemma 4: 280; the tiny vision presets: 4)."""
    max_images: int
    """Images a record may hold (keras-hub's max_images_per_prompt)."""
    placeholder_id: int
    """The id of the soft token, whose positions the image embeddings take."""
    expansion: str
    """The text each `<image>` placeholder becomes."""
    marker: str
    """The token keras-hub's generate() expands into `expansion` (Layout.marker)."""
    stripped: tuple
    """The special tokens keras-hub's generate() strips from what it gives back: all the tokenizer's but the
    start-of-image one (and Gemma 3n's start-of-audio), whether the picture's or a chat turn's (Gemma 3n's)."""
    converter: object
    """keras-hub's image converter of the preset."""
    blank: dict
    """The converter's arrays for an empty image slot (zeros): input name -> array of one picture."""

    @property
    def image_size(self) -> tuple | None:
        """(height, width) the converter resizes to; None where it keeps each picture's aspect (Gemma 4)."""
        return tuple(self.blank["images"].shape[:2]) if "images" in self.blank else None


def vision_of(preprocessor) -> Vision | None:
    """The preprocessor's image handling; None for a text-only one (no image converter), or a family whose
    pictures finetune does not lay out (LAYOUTS)."""
    converter = getattr(preprocessor, "image_converter", None)
    layout = next((LAYOUTS[c.__name__] for c in type(preprocessor).__mro__ if c.__name__ in LAYOUTS), None)
    if converter is None or layout is None:
        return None
    tokenizer = preprocessor.tokenizer
    tokens = preprocessor.num_vision_tokens_per_image
    soft = tokenizer.image_placeholder
    # keras-hub's preprocessor writes each image so; the ids are the same whether it or we expand the text.
    expansion = f"{layout.margin}{tokenizer.start_of_image_token}{soft * tokens}{tokenizer.end_of_image_token}"
    expansion += layout.margin
    blank = {name: np.zeros_like(array) for name, array in _converted(converter, np.zeros((32, 32, 3))).items()}
    marker = getattr(tokenizer, layout.marker)
    stripped = stripped_tokens(preprocessor)
    return Vision(tokens, preprocessor.max_images_per_prompt, tokenizer.token_to_id(soft), expansion, marker,
                  stripped, converter, blank)  # fmt: skip


# The special tokens keras-hub's generate() gives back (the rest it strips): the start of a picture, which the
# user wrote, and Gemma 3n's start of a clip too.
KEPT = {"Gemma3nCausalLMPreprocessor": ("start_of_image_token", "start_of_audio_token")}


def stripped_tokens(preprocessor) -> tuple:
    """The tokenizer's special tokens that keras-hub's generate() strips from what it gives back."""
    tokenizer = preprocessor.tokenizer
    names = next(
        (KEPT[c.__name__] for c in type(preprocessor).__mro__ if c.__name__ in KEPT), ("start_of_image_token",)
    )
    kept = {getattr(tokenizer, name, None) for name in names}
    return tuple(token for token in tokenizer.special_tokens if token not in kept)


def shown_text(written: str, stripped) -> str:
    """A prompt as the model reads it (its pictures' and clips' tokens written out), as keras-hub's generate()
    gives it back: less the special tokens it strips."""
    for token in stripped:
        written = written.replace(token, "")
    return written


def parts_to_text(messages, where: str):
    """A chat record's messages with TRL's content lists (image and text parts) written as text with `<image>`
    placeholders; messages whose content is already text are kept."""
    if not isinstance(messages, list):
        return messages
    written = []
    for number, message in enumerate(messages, start=1):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            message = {**message, "content": "".join(_part_text(part, number, where) for part in content)}
        written.append(message)
    return written


def _part_text(part, number: int, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image":
        return PLACEHOLDER
    if kind == "audio":  # its path is read with the record's clips (audio.py)
        return audio.PLACEHOLDER
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise UserError(
        f'{where}: message {number} has a content part that is neither {{"type": "image"}}, {{"type": "audio", '
        '"path": ...} nor {"type": "text", "text": ...}'
    )


def image_paths(obj: dict, where: str, source: str) -> tuple[str, ...]:
    """The record's `images`, resolved against the data file's folder and each checked with Pillow."""
    listed = obj.get("images")
    if listed is None:
        return ()
    if not isinstance(listed, list) or not all(isinstance(p, str) and p.strip() for p in listed):
        raise UserError(f"{where}: `images` must be a list of image file paths (relative to the data file)")
    folder = Path(source).expanduser().parent
    return tuple(str(check(folder / p, where)) for p in listed)


def check(path, where: str, hint: str = "; paths are relative to the data file"):
    """`path` (a Path, or a pictures.Picture held in memory) if Pillow can open it as a whole image of a size it
    decodes within its decompression-bomb limit."""
    from PIL import Image

    held = isinstance(path, pictures.Picture)
    if not held and not path.is_file():
        raise UserError(f"{where}: image {path} does not exist{hint}")
    try:
        with warnings.catch_warnings():
            # Pillow warns past MAX_IMAGE_PIXELS and raises past twice it; either is too large to train on.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with pictures.opened(path) as image:
                image.verify()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise UserError(
            f"{where}: image {path} is too large to decode (over Pillow's limit of {Image.MAX_IMAGE_PIXELS} pixels); "
            "shrink it"
        ) from None
    except Image.UnidentifiedImageError:
        raise UserError(f"{where}: {path} is not an image Pillow reads (PNG, JPEG, WebP...)") from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt: verify() raises these
        raise UserError(f"{where}: image {path} cannot be read ({str(e).splitlines()[0][:100]})") from None
    return path if held else path.resolve()


def expand(segments, vision: Vision):
    """A template's (text, trained) segments with each placeholder written as the family's image tokens."""
    return [(text.replace(PLACEHOLDER, vision.expansion), trained) for text, trained in segments]


def pixels(paths, vision: Vision, slots: int) -> dict:
    """The converter's arrays of `slots` image slots: each picture converted by the preset's converter, in order,
    then empty slots (zeros): input name -> (slots, ...) float32 or int32 array."""
    out = {name: np.zeros((slots, *blank.shape), blank.dtype) for name, blank in vision.blank.items()}
    for slot, path in enumerate(paths[:slots]):
        with pictures.opened(path) as image:
            rgb = np.asarray(image.convert("RGB"), np.float32)
        for name, array in _converted(vision.converter, rgb).items():
            out[name][slot] = array
    return out


def _converted(converter, rgb: np.ndarray) -> dict:
    """One picture through keras-hub's converter: {input name: array}. Gemma 3's gives the resized pixels
    (`images`); Gemma 4's a dict of its patches and their (x, y) places, padded to its most patches."""
    import keras

    out = converter(rgb[None])
    out = out if isinstance(out, dict) else {"images": out}
    return {name: np.asarray(keras.ops.convert_to_numpy(value))[0] for name, value in out.items()}


def model_inputs(paths, token_ids, vision: Vision, slots: int, source: str = "") -> dict:
    """One example's image inputs: the converter's arrays of its pictures (pixels()), and `vision_indices`
    (slots x tokens_per_image), the positions of its soft tokens among its input ids, in order, then 0 (a position
    keras-hub's model restores).

    slots: the images every row of the run has room for: the most a record of its data holds (0 without).
    """
    inputs = np.asarray(token_ids[:-1])
    positions = np.flatnonzero(inputs == vision.placeholder_id).astype(np.int32)
    if len(positions) != len(paths) * vision.tokens_per_image:
        raise UserError(
            f"a record of {source or 'the data'} with {len(paths)} image(s) is cut inside its image tokens "
            f"({vision.tokens_per_image} per image) by the sequence length; raise --seq-len or shorten the prompt"
        )
    indices = np.zeros(slots * vision.tokens_per_image, np.int32)
    indices[: len(positions)] = positions
    return {**pixels(paths, vision, slots), "vision_indices": indices}


def in_batch_order(pictures: np.ndarray, vision_indices: np.ndarray) -> np.ndarray:
    """A batch's (rows, slots, ...) pictures for a model that places them by their order in the whole batch, not
    by row (keras-hub's Gemma 3n, which takes no vision_indices: its n-th soft token of the batch takes the n-th
    picture of the flattened slots). The pictures are laid out in the batch's order, row by row, then the empty
    slots, so a row beside one with fewer pictures reads its own."""
    rows, slots = pictures.shape[:2]
    if slots == 0:
        return pictures
    per_slot = vision_indices.reshape(rows, slots, -1)
    held = (per_slot[:, :, 0] > 0).reshape(-1)  # a slot's first soft token sits past <bos>: position 0 is empty
    flat = pictures.reshape(rows * slots, *pictures.shape[2:])
    return np.concatenate([flat[held], flat[~held]]).reshape(pictures.shape)


def vision_mask(vision_indices: np.ndarray, seq_len: int) -> np.ndarray:
    """(rows, seq_len) int32, 1 at each soft token: where keras-hub's decoder places the picture (and Gemma 3's
    lets its tokens see each other both ways)."""
    mask = np.zeros((len(vision_indices), seq_len), np.int32)
    rows, slots = np.nonzero(vision_indices > 0)
    mask[rows, vision_indices[rows, slots]] = 1
    return mask


def limit(records, vision: Vision, source: str) -> None:
    """Refuse a record with more images than the family takes."""
    most = max((len(r.images) for r in records), default=0)
    if most > vision.max_images:
        raise UserError(
            f"a record of {source} holds {most} images; this preset takes at most {vision.max_images} per record"
        )


def attached(example, record, vision: Vision, slots: int, source: str = ""):
    """The example with its image inputs, and weight 0 on its soft tokens: a picture is never a target."""
    example.inputs = model_inputs(record.images, example.token_ids, vision, slots, source)
    soft = np.asarray(example.token_ids) == vision.placeholder_id
    example.weights = [0.0 if is_soft else weight for weight, is_soft in zip(example.weights, soft)]
    return example


def generation_input(prompts: list[str], pictures: list, vision: Vision) -> dict:
    """keras-hub's generate() input for prompts with pictures: each `<image>` written as the family's marker
    (Layout.marker), which keras-hub's preprocessor expands as training did, and each prompt's pictures as RGB
    arrays, which its image converter resizes and scales.

    pictures: per prompt, a list of image paths (checked with check()).
    """
    written = [prompt.replace(PLACEHOLDER, vision.marker) for prompt in prompts]
    return {"prompts": written, "images": [[rgb(path) for path in paths] for paths in pictures]}


def rgb(path) -> np.ndarray:
    with pictures.opened(path) as image:
        return np.asarray(image.convert("RGB"))


def shown(prompt: str, vision: Vision) -> str:
    """A prompt of generation_input() as keras-hub's generate() returns it: each marker as its expansion, less the
    special tokens keras-hub strips (all but the start-of-image token: Gemma 3 keeps the blank lines around it)."""
    return shown_text(written_prompt(prompt, vision), vision.stripped)


def written_prompt(prompt: str, vision: Vision) -> str:
    """A generation_input() prompt as the model reads it: each marker expanded, for counting ids."""
    return prompt.replace(vision.marker, vision.expansion)


def with_placeholders(prompt: str, count: int) -> str:
    """A prompt given `count` pictures: as it is where it places them with `<image>`, else with them before it."""
    found = prompt.count(PLACEHOLDER)
    if found == 0:
        return PLACEHOLDER * count + prompt
    if found != count:
        raise UserError(
            f"the prompt has {found} {PLACEHOLDER} placeholder(s) and {count} --image(s); give one for each"
        )
    return prompt


def summary(records) -> list[str]:
    """`finetune data`'s lines on the pictures: how many, in how many records, and their sizes (as Pillow reads
    their headers, before the converter resizes them); none for text-only records."""
    from collections import Counter

    pictured = [r for r in records if r.images]
    if not pictured:
        return []
    sizes = Counter()
    for record in pictured:
        for path in record.images:
            with pictures.opened(path) as image:
                sizes["{}x{}".format(*image.size)] += 1
    count = sum(sizes.values())
    most = max(len(r.images) for r in pictured)
    common = ", ".join(f"{size} ({n})" for size, n in sizes.most_common(4))
    more = f", {len(sizes) - 4} other sizes" if len(sizes) > 4 else ""
    return [
        f"images: {count} in {len(pictured)} of {len(records)} records, at most {most} a record",
        f"image sizes (width x height, images): {common}{more}; the preset's image converter resizes them",
    ]
