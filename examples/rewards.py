"""Reward functions for `finetune gemma --method grpo --reward examples/rewards.py:NAME` (docs/rl.md).

Each takes TRL's arguments: the prompts and the completions (text, or for prompts given as messages, each
completion as [{"role": "assistant", "content": TEXT}]), then every other column of the records by name
(here `answer`), with `completion_ids` and `trainer_state`. It returns one float per completion, or None
where it does not apply.
"""


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def opens_with_the(prompts, completions, **columns):
    """1 where the completion's first word is "The": a format the tiny preset learns in a dozen steps."""
    return [float(_text(c).strip().startswith("The")) for c in completions]


def names_the_subject(prompts, completions, answer, **columns):
    """1 where the completion names the record's `answer` column (the prompt's subject), else 0."""
    return [float(a.lower() in _text(c).lower()) for c, a in zip(completions, answer)]
