"""Records to examples, below every method: reading, the template's room, pictures, the held-out split, rows.

Each method (methods/supervised.py, methods/preference.py) makes its examples
and rows from these pieces, and training, `finetune eval` and `finetune bench`
all prepare through the method, so an evaluation scores exactly the records its
run held out, and the bench trains on rows made as a run makes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.data import audio, batching, formats, images, packing, templates
from finetune.model import families, presets
from finetune.platform.errors import UserError


@dataclass
class Prepared:
    """What a run trains on and what it holds out.

    train, held_out: lists of (Record, Example) pairs.
    """

    template: templates.Template
    """The template the records were put in."""
    train: list
    held_out: list
    batch_size: int
    held_out_rows: dict
    """The held-out examples padded, one a row (batching.pad): what is scored."""
    rows: dict | None = None
    """The training rows, packed or padded; None when none were asked for."""
    packed: bool | None = None
    """Whether `rows` are packed."""
    padding: dict | None = None
    """The share of padding in the training rows (padding_fraction) and in them unpacked (unpacked)."""
    batch_size_why: str | None = None
    """Why `--batch-size auto` probed to batch_size; None when it was decided before (resolve.py)."""


def split(usable: list, cfg, every_record_of: str | None = None) -> tuple[list, list]:
    """(train, held out) of the usable examples: a function of the data, --eval-fraction and the seed alone.

    The held-out share never depends on --batch-size (a batch larger than it is scored with weight-0 filler rows),
    so two runs compared by their held-out loss are scored on the same records and train on the same rest.
    every_record_of: a file all of whose records are held out (`finetune eval --data`).
    """
    if every_record_of is not None:
        return [], usable
    if cfg.data.eval_fraction == 0:  # nothing held out: --eval-data, or no evaluation
        return usable, []
    return formats.split(usable, cfg.data.eval_fraction, cfg.train.seed)


def read(cfg, path: str, trained: bool = False, filtered: bool = True) -> tuple[list[formats.Record], str]:
    """(the records of `path`, checked and filtered as the config says; their format).

    The template for the format is decided with the run's other settings (resolve.py).

    trained: bool. `cfg` is a trained run's (`finetune eval`): its template and filters are fixed, so records
        the template cannot render, or the filters refuse, are said to be wrong for the run, not flags to change.
    filtered: bool. False: every record, whatever the config's filters (`finetune predict`: a line each).
    """
    records, found = formats.read(path, cfg.data.split if path == cfg.data.path else "train")
    if trained:
        family_chat = families.get(presets.family_of(cfg.model.preset)).chat_template
        templates.for_data(cfg.data.template, found, family_chat, cfg.model.preset, path, trained=True)
    print(f"read {len(records)} records, {found} format, from {path}")
    if not filtered:
        return records, found
    kept = formats.filter_records(
        records,
        drop_context=cfg.data.drop_context,
        categories=cfg.data.categories,
        max_records=cfg.data.max_records,
        source=path,
        fix="evaluate on a file with records the run's filters keep" if trained else None,
    )
    return kept, found


def check_seq_len(tokenizer, template, seq_len: int) -> None:
    """Refuse a seq_len that leaves fewer than 8 tokens beside the template's fixed text."""
    overhead = batching.template_overhead(tokenizer, template)
    if seq_len < overhead + 8:
        raise UserError(
            f"seq-len {seq_len} is too small for the {template.name} template, whose fixed text "
            f"takes {overhead} tokens; use --seq-len {max(64, overhead + 8)} or more"
        )


def examples(records, template, tokenizer, seq_len: int, train_on_prompt: bool = False, source: str = "") -> list:
    """(record, Example) for each record that leaves a response token within seq_len.

    template: templates.Template, or anything with its segments() (Pictured).
    """
    tokenized, dropped = batching.tokenize([template.segments(r) for r in records], tokenizer, seq_len, train_on_prompt)
    batching.check_fits(tokenized, dropped, source, seq_len)
    if dropped:
        print(f"note: {len(dropped)} records skipped: their prompt fills all {seq_len} tokens")
    skipped = set(dropped)
    kept = [r for i, r in enumerate(records) if i not in skipped]
    return list(zip(kept, tokenized))


# The presets that see images, named where pictures are refused.
SEE_IMAGES = "tiny-gemma3-vision, tiny-gemma4-vision, tiny-gemma3n-vision, gemma3_4b and up, Gemma 4 and 3n"


def no_vision_encoder(preset: str, what: str) -> UserError:
    """The refusal of pictures (`what` has them) on a preset built without a vision encoder, with its family's
    reason where it has one (families.Family.without_images)."""
    why = families.get(presets.family_of(preset)).without_images
    because = f" ({why})" if why else ""
    return UserError(f"{what} has images, and {preset} has no vision encoder{because}; use a preset that sees "
                     f"images ({SEE_IMAGES})")  # fmt: skip


# The presets that hear audio, named where audio is refused.
HEAR_AUDIO = "tiny-gemma4-audio, tiny-gemma3n-audio; the real Gemma 4 E-models and Gemma 3n are built without their audio encoder yet"


def no_audio_encoder(preset: str, what: str) -> UserError:
    """The refusal of audio clips (`what` has them) on a preset built without an audio encoder."""
    return UserError(f"{what} has audio clips, and {preset} has no audio encoder; use a preset that hears "
                     f"({HEAR_AUDIO})")  # fmt: skip


def pictured_examples(records, template, preprocessor, cfg, source: str) -> list:
    """examples() of records that may hold pictures or audio clips: each placeholder written as the family's image
    or audio tokens before tokenizing, and each example given its image and audio inputs after (images.py,
    audio.py)."""
    seq_len, on_prompt = cfg.model.seq_len, cfg.data.train_on_prompt
    media = Media.of(records, preprocessor, cfg.model.preset, source)
    if media is None:
        return examples(records, template, tokenizer_of(preprocessor), seq_len, on_prompt, source)
    made = examples(records, media.written(template), tokenizer_of(preprocessor), seq_len, on_prompt, source)
    return [(record, media.attached(example, record)) for record, example in made]


@dataclass
class Media:
    """The pictures' and audio clips' side of records that hold them, below every method: the preset's encoders,
    checked against the records, and each row's room for the most pictures (clips) a record holds, the rest blank
    (one picture a record encodes one slot a row, not the family's limit), found once for all the records."""

    vision: images.Vision | None
    hearing: audio.Hearing | None
    source: str
    image_slots: int = 0
    audio_slots: int = 0
    audio_room: tuple = (0, 0)
    """The most soft tokens and mel frames a clip of the records has (audio.most_tokens, most_frames)."""

    @classmethod
    def of(cls, records, preprocessor, preset: str, source: str):
        """The records' Media, refusing what the preset cannot see or hear; None where they and the preset have
        neither (a text-only file feeds none, and the encoder is skipped)."""
        vision, hearing = images.vision_of(preprocessor), audio.hearing_of(preprocessor)
        if vision is None and any(r.images for r in records):
            raise no_vision_encoder(preset, source)
        if hearing is None and any(r.audios for r in records):
            raise no_audio_encoder(preset, source)
        if vision is None and hearing is None:
            return None
        media = cls(vision, hearing, source)
        if vision is not None:
            images.limit(records, vision, source)
            media.image_slots = max((len(r.images) for r in records), default=0)
        if hearing is not None:
            audio.limit(records, hearing, source)
            media.audio_slots = max((len(r.audios) for r in records), default=0)
            media.audio_room = (audio.most_tokens(records, hearing), audio.most_frames(records, hearing))
        return media

    def written(self, template) -> Pictured:
        """`template` with each placeholder written as the family's tokens (Pictured)."""
        return Pictured(template, self.vision, self.hearing)

    def expanded(self, text: str, record) -> str:
        """`text` (a record's, rendered) with each placeholder written as the family's tokens (Pictured)."""
        return "".join(piece for piece, _ in self.written(None)._expanded([(text, False)], record))

    def attached(self, example, record):
        """The example with the record's image and audio inputs, weight 0 on their soft tokens."""
        if self.vision is not None:
            example = images.attached(example, record, self.vision, self.image_slots, self.source)
        if self.hearing is not None:
            example = audio.attached(example, record, self.hearing, self.audio_slots, self.audio_room, self.source)
        return example


@dataclass
class Pictured:
    """A template whose pieces have each `<image>` (`<audio>`) placeholder written as the family's image (audio)
    tokens.

    The tokens are written once the template has rendered the record, as transformers' processors expand the
    template's image token: a chat template trims each message, which would take the image tokens' margins off a
    placeholder written out before it.
    """

    template: templates.Template
    vision: images.Vision | None
    hearing: audio.Hearing | None = None

    def segments(self, record) -> list[tuple[str, bool]]:
        return self._expanded(self.template.segments(record), record)

    def rejected_segments(self, record) -> list[tuple[str, bool]]:
        """A preference pair's prompt and rejected answer (Template.rejected_segments), its placeholders written."""
        return self._expanded(self.template.rejected_segments(record), record)

    def _expanded(self, segments, record) -> list[tuple[str, bool]]:
        if self.vision is not None:
            segments = images.expand(segments, self.vision)
        if self.hearing is not None:
            segments = audio.expand(segments, self.hearing, record.audios)
        return segments


def tokenizer_of(preprocessor):
    """The preprocessor's tokenizer (a text run may be given the tokenizer itself)."""
    return getattr(preprocessor, "tokenizer", preprocessor)


def rows(examples, seq_len: int, packed: bool) -> dict:
    """The examples in rows of seq_len: several to a row (packing.py), or one to a row, padded."""
    return packing.pack(examples, seq_len) if packed else batching.pad(examples, seq_len)


def row_count(examples, seq_len: int, packed: bool) -> int:
    """How many rows rows() would make, without making them."""
    if not packed:
        return len(examples)
    return len(packing.best_fit_decreasing([len(e.token_ids) - 1 for e in examples], seq_len))


def training_rows(train, batch_size: int, seq_len: int, packed: bool) -> tuple[dict, dict]:
    """(rows, padding) of the training pairs; refuses data that fills less than one batch."""
    if len(train) < batch_size:
        raise UserError(
            f"{len(train)} training records are fewer than one batch of {batch_size}; lower --batch-size or add records"
        )
    train_examples = [e for _, e in train]
    padded = batching.pad(train_examples, seq_len)
    made = packing.pack(train_examples, seq_len) if packed else padded
    if len(made["token_ids"]) < batch_size:
        raise UserError(
            f"{len(train_examples)} training records fill {len(made['token_ids'])} rows, fewer than one batch of "
            f"{batch_size}; lower --batch-size, add records, or pass --packing off"
        )
    padding = {"padding_fraction": packing.padding_fraction(made), "unpacked": packing.padding_fraction(padded)}
    if packed:
        print(
            f"packing: {len(train_examples)} examples in {len(made['token_ids'])} rows of {seq_len} "
            f"tokens; padding {padding['unpacked']:.0%} -> {padding['padding_fraction']:.0%}"
        )
    return made, padding
