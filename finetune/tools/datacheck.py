"""`finetune data FILE`: what a run would make of a data file, before a model is built.

The format detected, the record counts, the template, the token lengths against
seq_len, what packing saves, and one example rendered with the text that
carries the loss marked. Users check their data here before they spend GPU
hours on it. Token counts need the preset's tokenizer; where it cannot load
(offline, no credentials) the rest is still reported, with the reason.
"""

from __future__ import annotations

import re

import numpy as np

from finetune.data import batching, formats, images, packing, pairs, templates
from finetune.model import families, presets
from finetune.platform.errors import UserError

MARKS = ("«", "»")  # around the text the loss is taken on


def report(path: str, preset: str, template: str, seq_len: int, example: int = 1, split: str = "train") -> list[str]:
    """The report's lines, for a run's defaults (the loss on the responses). split: of an hf:NAME dataset, the
    split read (--data-split), as a run reads it."""
    train_on_prompt = False
    records, found = formats.read(path, split=split)
    if not 1 <= example <= len(records):
        raise UserError(f"--example {example} is out of range: {path} holds {len(records)} records")
    family_chat = families.get(presets.family_of(preset)).chat_template
    chosen, _ = templates.for_data(template, found, family_chat, preset, path)
    renderer = templates.get(chosen)
    how = "auto, for this format" if template == "auto" else "given"
    kind = (
        "pairs" if found in formats.PREFERENCE_FORMATS else "prompts" if found in formats.PROMPT_FORMATS else "records"
    )
    lines = [
        f"data: {path}",
        f"format: {found} ({formats.FORMATS[found]}), {len(records)} {kind}",
        f"template: {chosen} ({how})",
    ]
    if kind == "pairs":
        return lines + _pair_report(records, renderer, preset, seq_len, example)
    if kind == "prompts":
        return lines + _prompt_report(records, renderer, preset, example)
    items = [renderer.segments(r) for r in records]
    lines += images.summary(records)
    written = _written(records, renderer, preset, seq_len, path)
    counted, cut_note = _tokens([written.renderer.segments(r) for r in records], preset, seq_len, train_on_prompt,
                                example - 1, written)  # fmt: skip
    lines += counted + _labels(records)
    lines += [f"example: record {example}, the loss is taken on the text between {MARKS[0]} and {MARKS[1]}:"]
    lines += ["  " + line for line in render(items[example - 1], train_on_prompt).split("\n")]
    return lines + ([cut_note] if cut_note else [])


def _labels(records) -> list[str]:
    """What a classifier (--method classify) would train on, where records carry a `label`: its classes, in the
    order a run numbers them, with each one's records; and the records a classifier would refuse."""
    from finetune.methods import classify

    if not any("label" in r.columns for r in records):
        return []
    given = [classify.label_text(r.columns.get("label")) for r in records]
    usable = [v for v in given if v is not None]
    if not usable:
        return [f"labels (for --method classify): none of the {len(records):,} records has a usable label (text or "
                "a whole number); a classifier refuses them"]  # fmt: skip
    counts: dict = {}
    for label in usable:
        counts[label] = counts.get(label, 0) + 1
    shown = ", ".join(f"{name}: {counts[name]:,}" for name in sorted(counts, key=classify._order))
    line = f"labels (for --method classify): {len(counts)} class{'es' * (len(counts) != 1)}: {shown}"
    if len(usable) < len(records):
        line += f"; {len(records) - len(usable):,} records without a usable label (text or a whole number)"
    if len(counts) < 2:
        line += "; a classifier needs records of at least 2 labels"
    return [line]


class Written:
    """How `finetune data` counts records' pictures and clips: each placeholder written as the preset's soft tokens
    (prepare.Media), as a run writes it, where the preset's preprocessor loads and sees or hears; else as its text,
    with the reason (`how`)."""

    def __init__(self, records, renderer, media=None, how: str = ""):
        self.records = records
        self.media_records = any(r.images or r.audios for r in records)
        self.media = media
        self.renderer = renderer if media is None else media.written(renderer)
        self.how = how

    def refused(self, whole, seq_len: int, skipped: set) -> list[str]:
        """The lines naming the records with pictures that --seq-len cuts inside their soft tokens, which a run
        refuses (images.model_inputs), among those it does not skip (`skipped`: their prompt fills the sequence);
        none where the soft tokens were not counted."""
        vision = self.media.vision if self.media is not None else None
        if vision is None:
            return []
        reached = [r for i, (r, e) in enumerate(zip(self.records, whole)) if r.images and i not in skipped and
                   np.flatnonzero(np.asarray(e.token_ids) == vision.placeholder_id).max(initial=0) >= seq_len]  # fmt: skip
        if not reached:
            return []
        return [f"seq-len {seq_len}: {len(reached)} records with pictures are cut inside their image tokens, which a "
                f"run refuses (the first: {reached[0].where or 'a record'}); raise --seq-len or shorten them"]  # fmt: skip


def _written(records, renderer, preset: str, seq_len: int, path: str) -> Written:
    """The records' Written: their pictures and clips as `preset`'s soft tokens where its preprocessor loads."""
    if not any(r.images or r.audios for r in records):
        return Written(records, renderer)
    from finetune.methods import prepare
    from finetune.model import builder  # imports keras: only once the data has been read

    try:
        media = prepare.Media.of(records, builder.load_preprocessor(presets.resolve(preset), seq_len), preset, path)
    except UserError as e:
        first = re.split(r"[;\n]|\. ", str(e))[0]
        return Written(records, renderer, how=f", each <image> and <audio> counted as its text: {first}")
    return Written(records, renderer, media, f", each picture and clip as {preset}'s soft tokens")


def render(segments, train_on_prompt: bool = False) -> str:
    """A record's segments as one text, with the trained ones (and the closing <eos>) marked."""
    runs: list[list] = []
    for text, trained in [*segments, ("<eos>", True)]:
        trained = trained or train_on_prompt
        if runs and runs[-1][1] == trained:
            runs[-1][0] += text
        elif text:
            runs.append([text, trained])
    return "".join(f"{MARKS[0]}{text}{MARKS[1]}" if trained else text for text, trained in runs)


# Long enough for any record: `finetune data` counts each one's every token (a run keeps --seq-len + 1 of them).
WHOLE = 10**9


def _tokens(items, preset: str, seq_len: int, train_on_prompt: bool, example: int,
            written=None) -> tuple[list[str], str | None]:  # fmt: skip
    """The token counts' lines, and what --seq-len does to record `example` (its index) where it cuts it.

    written: Written. How the records' pictures and clips were written (None: the records have none)."""
    from finetune.model import builder  # imports keras: only once the data has been read

    try:
        tokenizer = builder.load_tokenizer(presets.resolve(preset))
    except UserError as e:
        first = re.split(r"[;\n]|\. ", str(e))[0]
        return [f"tokens: not counted ({first}); pass --preset with a tokenizer this machine has, such as tiny"], None
    whole, _ = batching.tokenize(items, tokenizer, WHOLE, train_on_prompt)  # every record: its <eos> trains
    examples, dropped = batching.tokenize(items, tokenizer, seq_len, train_on_prompt)
    lengths = np.array([len(e.token_ids) for e in whole])
    trained = sum(int(sum(e.weights)) for e in whole)
    pictured = written is not None and written.media_records
    without = written.how if pictured else ""
    lines = [
        f"tokens ({preset}'s tokenizer, with <bos> and <eos>{without}): min {lengths.min():,}, median "
        f"{int(np.median(lengths)):,}, 95th percentile {int(np.percentile(lengths, 95)):,}, max {lengths.max():,}",
        f"loss on {trained:,} of {int(lengths.sum()):,} tokens ({trained / lengths.sum():.0%})",
    ]
    cut = int((lengths > seq_len + 1).sum())
    if cut or dropped:
        lines.append(
            f"seq-len {seq_len}: {cut} records are cut at the end, {len(dropped)} of them skipped as their "
            "prompt fills the sequence"
        )
    if pictured:
        lines += written.refused(whole, seq_len, set(dropped))
        held = written.records
        kinds = " or ".join(k for k, v in (("images", any(r.images for r in held)),
                                           ("audio", any(r.audios for r in held))) if v)  # fmt: skip
        lines.append(f"packing: off for data with {kinds} (such a row takes keras-hub's own mask)")
    elif examples:
        padded = batching.pad(examples, seq_len)
        packed = packing.pack(examples, seq_len)
        lines.append(
            f"packing at seq-len {seq_len}: {len(examples)} rows -> {len(packed['token_ids'])}, padding "
            f"{packing.padding_fraction(padded):.0%} -> {packing.padding_fraction(packed):.0%}"
        )
        kept = np.array([len(e.token_ids) - 1 for e in examples])  # positions: inputs, shifted one from targets
        shuffled, grouped = (computed_padding(kept, BATCH, seq_len, by_length) for by_length in (False, True))
        lines.append(f"--packing off, batches of {BATCH} cut to their longest row: padding {shuffled:.0%} of the "
                     f"positions computed, {grouped:.0%} with --group-by-length")  # fmt: skip
    return lines, _cut(whole[example], example in dropped, seq_len)


def _cut(record, skipped: bool, seq_len: int) -> str | None:
    """What --seq-len does to the example shown: nothing (None), cuts its end, or skips it."""
    length, marked = len(record.token_ids), int(sum(record.weights))
    if skipped:
        return (f"at --seq-len {seq_len} this record is skipped: its prompt fills the sequence ({length:,} tokens "
                "in all), so none of its marked text trains")  # fmt: skip
    if length <= seq_len + 1:
        return None
    kept = int(sum(record.weights[: seq_len + 1]))
    return (f"at --seq-len {seq_len} this record is cut to {seq_len + 1:,} of its {length:,} tokens: the loss is on "
            f"{kept:,} of its {marked:,} marked tokens, those before the cut")  # fmt: skip


BATCH = 8  # the batch the report's unpacked padding is counted at


def computed_padding(lengths: np.ndarray, batch: int, seq_len: int, grouped: bool) -> float:
    """The share of padding in the positions one epoch of unpacked batches computes, each batch cut to its longest
    row (to 16 positions, as PyTorch's and a CPU's TensorFlow's are), in the order a run draws them (seed 0):
    shuffled, or grouped by length (--group-by-length)."""
    order = batching.EpochRows(len(lengths), batch, 0, lengths if grouped else None)
    positions = 0
    for step in range(order.steps_per_epoch):
        rows = order(step)
        positions += len(rows) * batching.batch_length(lengths[rows], 16, seq_len)
    return 1 - float(lengths.sum()) / positions


def _pair_report(records, renderer, preset: str, seq_len: int, example: int) -> list[str]:
    """The token counts of preference pairs' prompts and answers, how many --seq-len cuts, and one pair."""
    lines = _pair_tokens(records, renderer, preset, seq_len)
    chosen, rejected = templates.pair_segments(renderer, records[example - 1])
    lines += [f"example: pair {example}, the prompt, then each answer with the text compared between {MARKS[0]} and "
              f"{MARKS[1]}:"]  # fmt: skip
    for label, text in (("prompt", "".join(t for t, _ in chosen[:-1])), ("chosen", _marked(chosen[-1][0])),
                        ("rejected", _marked(rejected[-1][0]))):  # fmt: skip
        lines += [f"  {label}:"] + [("    " + line).rstrip() for line in text.split("\n")]
    return lines


def _prompt_report(records, renderer, preset: str, example: int) -> list[str]:
    """Prompts alone (GRPO's): their tokens and one of them, rendered. No loss, packing or skipping to report: the
    run writes the completions, and cuts a prompt from its left to leave them room (rollouts.prompts_of)."""
    from finetune.model import builder  # imports keras: only once the data has been read

    written = _written(records, renderer, preset, 10**6, "the data")
    texts = [renderer.apply(r)[0] for r in records]
    counted = texts if written.media is None else [written.media.expanded(t, r) for t, r in zip(texts, records)]
    pictured = any(r.images or r.audios for r in records)  # rollouts.prompts_of never cuts these
    lines = ["GRPO (--method grpo) writes the completions: a prompt longer than --seq-len less "
             "--max-completion-length is cut from its left, and none is skipped"
             + ("; a prompt with pictures or clips is never cut: a longer one is refused" if pictured else "")]  # fmt: skip
    lines += images.summary(records)
    try:
        tokenizer = builder.load_tokenizer(presets.resolve(preset))
    except UserError as e:
        first = re.split(r"[;\n]|\. ", str(e))[0]
        lines.append(f"tokens: not counted ({first}); pass --preset with a tokenizer this machine has, such as tiny")
    else:
        lengths = np.array([1 + len(ids) for ids in batching.leading_ids(tokenizer, counted, 10**9)])
        without = written.how if written.media_records else ""
        lines.append(f"prompt tokens ({preset}'s tokenizer, with <bos>{without}): min {lengths.min():,}, median "
                     f"{int(np.median(lengths)):,}, 95th percentile {int(np.percentile(lengths, 95)):,}, max "
                     f"{lengths.max():,}")  # fmt: skip
        if pictured and written.media is not None:
            longest = max((i for i, r in enumerate(records) if r.images or r.audios), key=lambda i: lengths[i])
            lines.append(f"the longest prompt with pictures or clips takes {lengths[longest]:,} tokens "
                         f"({records[longest].where or 'a prompt'}): a run needs --seq-len of at least that plus "
                         "--max-completion-length, as it never cuts one")  # fmt: skip
    lines.append(f"example: prompt {example}, as the model is given it:")
    return lines + [("  " + line).rstrip() for line in texts[example - 1].split("\n")]


def _marked(answer: str) -> str:
    return f"{MARKS[0]}{answer}<eos>{MARKS[1]}"


def _pair_tokens(records, renderer, preset: str, seq_len: int) -> list[str]:
    from finetune.methods import preference
    from finetune.model import builder  # imports keras: only once the data has been read

    try:
        tokenizer = builder.load_tokenizer(presets.resolve(preset))
    except UserError as e:
        first = re.split(r"[;\n]|\. ", str(e))[0]
        return [f"tokens: not counted ({first}); pass --preset with a tokenizer this machine has, such as tiny"]
    written = _written(records, renderer, preset, seq_len, "the data")  # a pair's pictures, as the run writes them
    whole, _ = pairs.pairs(records, written.renderer, tokenizer, WHOLE)
    made, cut = pairs.pairs(records, written.renderer, tokenizer, seq_len)
    # As the run skips them (preference.pair_examples): a pair with pictures whose prompt is cut, then one whose
    # answers the cut leaves the same tokens.
    pictured = sum(preference.cuts_its_media(r, p) for r, p in zip(records, made)) if written.media else 0
    alike = sum(p.alike and not preference.cuts_its_media(r, p) for r, p in zip(records, made))
    prompt = np.array([p.prompt_length - 1 for p in whole])
    answers = {side: np.array([len(getattr(p, side).token_ids) - p.prompt_length for p in whole])
               for side in ("chosen", "rejected")}  # fmt: skip
    how = written.how if written.media_records else ""
    lines = [f"tokens ({preset}'s tokenizer; answers with <eos>, the prompt without <bos>{how}):"]
    for label, lengths in (("prompt", prompt), *answers.items()):
        lines.append(
            f"  {label}: min {lengths.min():,}, median {int(np.median(lengths)):,}, 95th percentile "
            f"{int(np.percentile(lengths, 95)):,}, max {lengths.max():,}"
        )
    lines.append(
        f"seq-len {seq_len}: {cut} of {len(records)} pairs are cut (the prompt from its left, keeping at least half "
        "the sequence, then the answers at their end), "
        + (f"{alike} of them skipped: the cut leaves their chosen and rejected answers the same tokens, so there is no "
           "preference to learn; raise --seq-len to keep them" if alike else "none skipped" if not pictured else "")
        + (f"{'; ' if alike else ''}{pictured} with pictures or audio skipped: cutting their prompt would cut its "
           "soft tokens" if pictured else "")
    )  # fmt: skip
    return lines
