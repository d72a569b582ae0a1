"""Preference pairs to token ids: a chosen and a rejected Example that begin with the same prompt ids.

Each side is a whole `<bos> prompt answer <eos>` Example (batching.py's layout)
whose weights are 1 on the answer and its closing <eos> only: the preference
losses compare the answers' log-probabilities given the prompt. Earlier
assistant turns of a conversational prompt are prompt here, weight 0.

Too long a pair is cut as TRL cut one before 1.x (max_prompt_length with
truncation_mode keep_end, still TRL 1.16's deprecated keep_end): the prompt
loses ids from its left, just after <bos>, until the longer answer fits, but
keeps at least half the sequence (TRL's old max_prompt_length was half its
max_length); then the answers are cut at the right. Both sides keep the same
prompt ids. A prompt longer than seq_len is cut the same way, so every pair
keeps at least one answer token to compare; TRL 1.16's default (keep_start)
drops such a pair instead (docs/preference.md, "Too long for --seq-len").
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.data import batching, templates


@dataclass
class Pair:
    chosen: batching.Example
    rejected: batching.Example
    prompt_length: int
    """Ids both sides begin with: <bos> and the prompt as kept."""
    prompt_cut: bool = False
    """Whether the prompt lost ids from its left to fit seq_len."""
    cut: bool = False
    """Whether the pair lost ids to fit seq_len: its prompt's from the left, or an answer's from its end."""

    @property
    def alike(self) -> bool:
        """Whether the cut left both answers the same tokens: no preference to learn, so a run skips the pair."""
        return self.chosen.token_ids == self.rejected.token_ids


def pairs(records, template, tokenizer, seq_len: int):
    """(pairs, how many pairs were cut to seq_len) of preference records.

    template: templates.Template. Renders each record's prompt and answers (templates.pair_segments).
    """
    batching.check_layout(tokenizer)
    sides = [templates.pair_segments(template, record) for record in records]
    # A prompt keeps its right end (where a chat's turn header meets the answer), an answer its start.
    prompts = iter(batching.trailing_ids(tokenizer, [text for chosen, _ in sides for text, _ in chosen[:-1]], seq_len))
    answers_of = [text for chosen, rejected in sides for text in (chosen[-1][0], rejected[-1][0])]
    pieces = iter(batching.leading_ids(tokenizer, answers_of, seq_len))
    made, cut = [], 0
    for chosen, _ in sides:
        prompt = [i for _ in chosen[:-1] for i in next(prompts)]
        answers = next(pieces), next(pieces)
        kept = _kept_prompt(prompt, max(map(len, answers)), seq_len)
        lost = len(kept) < len(prompt) or any(len(kept) + len(a) + 2 > seq_len + 1 for a in answers)
        cut += lost
        made.append(Pair(*(_example(kept, answer, seq_len) for answer in answers), prompt_length=1 + len(kept),
                         prompt_cut=len(kept) < len(prompt), cut=lost))  # fmt: skip
    return made, cut


def _kept_prompt(prompt: list[int], longest: int, seq_len: int) -> list[int]:
    """The prompt's ids from the right, as many as leave room for the longer answer, at least half the room:
    never all of it, so the answers' first token keeps a position however long the prompt."""
    room = seq_len - 1  # seq_len + 1 ids less <bos> and <eos>
    if len(prompt) + longest <= room:
        return prompt
    keep = max(room - longest, min(len(prompt), room // 2))
    return prompt[len(prompt) - keep :]


def _example(prompt: list[int], answer: list[int], seq_len: int) -> batching.Example:
    ids = [batching.BOS, *prompt, *answer, batching.EOS]
    weights = [0.0] * (1 + len(prompt)) + [1.0] * (len(answer) + 1)
    return batching.Example(ids[: seq_len + 1], weights[: seq_len + 1])
