"""Instruction templates: a record in, (prompt, response) text out.

The prompt is what the model is given; the response is what it learns to
write, so the loss is taken on response tokens only. Each template is a small
class with one `apply()` method and pure string logic, easy to test.
"""

from __future__ import annotations

from finetune.data import Record


class Dolly:
    """The Keras Gemma tutorial's template, with the context in its own block when present."""

    name = "dolly"
    stop_tokens = ("<eos>",)

    def apply(self, record: Record) -> tuple[str, str]:
        prompt = f"Instruction:\n{record.instruction}\n\n"
        if record.context:
            prompt += f"Context:\n{record.context}\n\n"
        return prompt + "Response:\n", record.response


class Alpaca:
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


class GemmaChat:
    """Gemma's instruction-tuned turn format; the model's turn ends with <end_of_turn>."""

    name = "gemma-chat"
    stop_tokens = ("<eos>", "<end_of_turn>")

    def apply(self, record: Record) -> tuple[str, str]:
        user = record.instruction
        if record.context:
            user += f"\n\n{record.context}"
        prompt = f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"
        return prompt, record.response + "<end_of_turn>"


TEMPLATES = {t.name: t for t in (Dolly(), Alpaca(), GemmaChat())}


def get(name: str):
    return TEMPLATES[name]
