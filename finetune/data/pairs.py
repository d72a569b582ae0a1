"""Preference pairs to token ids: a chosen and a rejected Example that begin with the same prompt ids.

Each side is a whole `<bos> prompt answer <eos>` Example (batching.py's layout)
whose weights are 1 on the answer and its closing <eos> only: the preference
losses compare the answers' log-probabilities given the prompt. Earlier
assistant turns of a conversational prompt are prompt here, weight 0.

Too long a pair is cut as TRL cuts one (truncation_mode keep_end for the
prompt): the prompt loses ids from its left, just after <bos>, until the
longer answer fits, but keeps at least half the sequence (TRL's default
max_prompt_length is half its max_length); then the answers are cut at the
right. Both sides keep the same prompt ids. A prompt that alone fills
seq_len leaves no answer to compare and is the user's error, naming its line.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.data import batching, templates
from finetune.platform.errors import UserError


@dataclass
class Pair:
    chosen: batching.Example
    rejected: batching.Example
    prompt_length: int
    """Ids both sides begin with: <bos> and the prompt as kept."""


def pairs(records, template, tokenizer, seq_len: int, strict: bool = True):
    """(pairs, indices of dropped records, how many pairs were cut) of preference records.

    template: templates.Template. Renders each record's prompt and answers (templates.pair_segments).
    strict: bool. A prompt that fills seq_len is a UserError naming the record's line; False drops the pair
        and lists its index instead (datacheck's overview at a long length).
    """
    batching.check_layout(tokenizer)
    sides = [templates.pair_segments(template, record) for record in records]
    texts = []
    for chosen, rejected in sides:
        texts += [text for text, _ in chosen[:-1]] + [chosen[-1][0], rejected[-1][0]]
    pieces = iter(batching.leading_ids(tokenizer, texts, seq_len))
    made, dropped, truncated = [], [], 0
    for index, (chosen, _) in enumerate(sides):
        prompt = [i for _ in chosen[:-1] for i in next(pieces)]
        answers = next(pieces), next(pieces)
        if len(prompt) >= seq_len:  # with <bos>, no position is left to predict an answer's first token
            if strict:
                raise UserError(_fills(records[index], seq_len))
            dropped.append(index)
            continue
        kept = _kept_prompt(prompt, max(map(len, answers)), seq_len)
        truncated += len(kept) < len(prompt) or any(len(kept) + len(a) + 2 > seq_len + 1 for a in answers)
        made.append(Pair(*(_example(kept, answer, seq_len) for answer in answers), prompt_length=1 + len(kept)))
    return made, dropped, truncated


def _kept_prompt(prompt: list[int], longest: int, seq_len: int) -> list[int]:
    """The prompt's ids from the right, as many as leave room for the longer answer, at least half the room."""
    room = seq_len - 1  # seq_len + 1 ids less <bos> and <eos>
    if len(prompt) + longest <= room:
        return prompt
    keep = max(room - longest, min(len(prompt), room // 2))
    return prompt[len(prompt) - keep :]


def _example(prompt: list[int], answer: list[int], seq_len: int) -> batching.Example:
    ids = [batching.BOS, *prompt, *answer, batching.EOS]
    weights = [0.0] * (1 + len(prompt)) + [1.0] * (len(answer) + 1)
    return batching.Example(ids[: seq_len + 1], weights[: seq_len + 1])


def _fills(record, seq_len: int) -> str:
    where = record.where or "a preference pair"
    return (
        f"{where}: the prompt alone fills --seq-len {seq_len}, leaving no token of the answers to compare; raise "
        "--seq-len, or shorten or remove the pair"
    )
