"""Instruction templates: a record in, (prompt, response) text out.

The prompt is what the model is given; the response is what it learns to
write, so the loss is taken on response tokens only. Each template is a small
class with an `apply()` method and pure string logic, easy to test.
`segments()` gives the same text as (text, trained) pieces: one prompt and one
response for an instruction, and every turn for a multi-turn chat, whose
assistant turns are all trained on.
"""

from __future__ import annotations

from finetune.data import Record
from finetune.errors import UserError


class Template:
    name = ""

    def apply(self, record: Record) -> tuple[str, str]:
        raise NotImplementedError

    def segments(self, record: Record) -> list[tuple[str, bool]]:
        if record.turns:
            raise UserError(f"chat records (messages) need --template gemma-chat, not {self.name}")
        prompt, response = self.apply(record)
        return [(prompt, False), (response, True)]


class Dolly(Template):
    """The Keras Gemma tutorial's template, with the context in its own block when present."""

    name = "dolly"
    stop_tokens = ("<eos>",)

    def apply(self, record: Record) -> tuple[str, str]:
        prompt = f"Instruction:\n{record.instruction}\n\n"
        if record.context:
            prompt += f"Context:\n{record.context}\n\n"
        return prompt + "Response:\n", record.response


class Alpaca(Template):
    """The Stanford Alpaca template; the context goes in its Input block."""

    name = "alpaca"
    stop_tokens = ("<eos>",)

    def apply(self, record: Record) -> tuple[str, str]:
        if record.context:
            prompt = (
                "Below is an instruction that describes a task, paired with an input that provides "
                "further context. Write a response that appropriately completes the request.\n\n"
                f"### Instruction:\n{record.instruction}\n\n### Input:\n{record.context}\n\n"
            )
        else:
            prompt = (
                "Below is an instruction that describes a task. "
                "Write a response that appropriately completes the request.\n\n"
                f"### Instruction:\n{record.instruction}\n\n"
            )
        return prompt + "### Response:\n", record.response


class GemmaChat(Template):
    """Gemma's instruction-tuned turn format; the model's turn ends with <end_of_turn>.

    A chat record renders every turn; each assistant turn is trained on, each
    user turn (and the turn markers) is not.
    """

    name = "gemma-chat"
    stop_tokens = ("<eos>", "<end_of_turn>")

    def apply(self, record: Record) -> tuple[str, str]:
        pieces = self.segments(record)
        return "".join(text for text, _ in pieces[:-1]), pieces[-1][0]

    def segments(self, record: Record) -> list[tuple[str, bool]]:
        turns = record.turns
        if not turns:
            user = record.instruction
            if record.context:
                user += f"\n\n{record.context}"
            turns = (("user", user), ("assistant", record.response))
        pieces = []
        for index, (role, text) in enumerate(turns):
            if role == "user":
                opening = "\n" if index else ""  # after the previous model turn's <end_of_turn>
                pieces.append((f"{opening}<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n", False))
            else:
                pieces.append((text + "<end_of_turn>", True))
        return pieces


TEMPLATES = {t.name: t for t in (Dolly(), Alpaca(), GemmaChat())}


def get(name: str):
    return TEMPLATES[name]
