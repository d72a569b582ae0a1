"""Chat records rendered by the model's own chat template, and the model's turns found in the text.

The templates are the `chat_template` Google ships with its instruction-tuned checkpoints (chat_templates/,
whose README says where each came from). They are rendered with jinja2 as transformers' apply_chat_template
renders them: a sandboxed environment that trims blocks, with loop controls, `raise_exception` and a `tojson` that
keeps non-ASCII text, and a message's reasoning under `reasoning_content` whichever of TRL's names it came in
(tests/test_chat_templates.py compares the two texts).

The loss mask is read from the rendered text, not from the messages. A template need not render a conversation's
beginning the same once more messages follow it (Gemma 4's drops an earlier turn's thinking once a later user turn
comes, and closes a model turn only when no assistant message continues it), so rendering growing prefixes of the
conversation and diffing them, as some trainers do, would misplace the spans. Instead each template names its
model turn's opening and its end: everything from the opening's end to the end marker is the model's and trained
on (its thinking, tool calls and answer, and the end marker, which the model must learn to stop on; the newline
the template writes after it is the template's, as generation stops at the marker), and blocks the environment writes inside the model's turn (Gemma 4's tool responses) are not. A block's
opening token is trained where it follows the model's text: the model writes it after its tool calls, and
generation stops there for the tool's answer; the openings of the answers after the first are the environment's.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from finetune.platform.errors import UserError

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
BOS = "<bos>"
# TRL's and transformers' names for an assistant message's reasoning; the templates read `reasoning_content`.
REASONING = ("reasoning_content", "thinking", "reasoning")


@functools.cache
def _compiled(file: str):
    """The template compiled in an environment like transformers' (chat_template_utils._compile_jinja_template)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source(file))


def source(file: str) -> str:
    """A shipped chat template's text."""
    return (TEMPLATES / file).read_text(encoding="utf-8")


@dataclass(frozen=True)
class ChatRenderer:
    """One shipped chat template and the markers of the model's turn in what it renders."""

    file: str
    model_open: str
    """The text that opens the model's turn; what follows it is the model's."""
    turn_end: str
    """The model's turn end, the last text of its turn that is trained on."""
    environment: tuple = ()
    """(opening, closing) of blocks inside the model's turn that the environment writes (tool responses)."""
    tools: bool = False
    """Whether the template renders tool declarations, tool calls and tool responses."""

    def text(self, messages: list, tools=(), add_generation_prompt: bool = False, thinking: bool | None = None) -> str:
        """The conversation as the template renders it, without the leading <bos> (batching.tokenize adds it).

        thinking: bool. Whether to render the template's thinking switch (Gemma 4's <|think|> in the system turn);
            by default, where an assistant message has reasoning, so the model learns to think when told to.
        """
        import jinja2

        thinking = any(reasoning_of(m) for m in messages) if thinking is None else thinking
        options = {"enable_thinking": True} if thinking else {}
        try:
            rendered = _compiled(self.file).render(
                messages=[with_reasoning(m) for m in messages],
                tools=list(tools) or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=BOS,
                eos_token="<eos>",
                **options,
            )
        except jinja2.exceptions.TemplateError as e:
            raise UserError(f"the {self.file} chat template cannot render this conversation: {e}") from None
        return rendered.removeprefix(BOS)

    def segments(self, messages: list, tools=()) -> list[tuple[str, bool]]:
        """The rendered conversation in (text, trained) pieces that join to text(): the model's turns trained."""
        text = self.text(messages, tools)
        pieces, at = [], 0
        while (start := text.find(self.model_open, at)) >= 0:
            start += len(self.model_open)
            pieces.append((text[at:start], False))
            end = text.find(self.turn_end, start)
            end = len(text) if end < 0 else end + len(self.turn_end)
            pieces += self._inside(text[start:end])
            at = end
        pieces.append((text[at:], False))
        return _merged(pieces)

    def _inside(self, turn: str) -> list[tuple[str, bool]]:
        """A model turn's pieces: the model's text trained, the environment's blocks in it not."""
        pieces, at = [], 0
        while True:
            found = [(turn.find(opening, at), opening, closing) for opening, closing in self.environment]
            found = [f for f in found if f[0] >= 0]
            if not found:
                break
            start, opening, closing = min(found)
            if start > at or not pieces:  # the model's text, then the opening it stops at
                start += len(opening)
            end = turn.find(closing, start)
            end = len(turn) if end < 0 else end + len(closing)
            pieces += [(turn[at:start], True), (turn[start:end], False)]
            at = end
        pieces.append((turn[at:], True))
        return pieces


def untrained_before(pieces, cut: int) -> list[tuple[str, bool]]:
    """(text, trained) pieces with their first `cut` characters not trained (a completion's prompt)."""
    kept, at = [], 0
    for text, trained in pieces:
        inside = max(0, min(len(text), cut - at))
        kept += [(text[:inside], False), (text[inside:], trained)]
        at += len(text)
    return _merged(kept)


def _merged(pieces) -> list[tuple[str, bool]]:
    merged = []
    for text, trained in pieces:
        if not text:
            continue
        if merged and merged[-1][1] == trained:
            merged[-1] = (merged[-1][0] + text, trained)
        else:
            merged.append((text, trained))
    return merged


GEMMA3 = ChatRenderer("gemma3.jinja", "<start_of_turn>model\n", "<end_of_turn>")
GEMMA4 = ChatRenderer(
    "gemma4.jinja", "<|turn>model\n", "<turn|>", environment=(("<|tool_response>", "<tool_response|>"),), tools=True
)


def reasoning_of(message: dict) -> str:
    return next((message[key] for key in REASONING if message.get(key)), "")


def with_reasoning(message: dict) -> dict:
    """The message with its reasoning also under `reasoning_content`, the name the templates read (as
    transformers' apply_chat_template fills it)."""
    reasoning = reasoning_of(message)
    return {**message, "reasoning_content": reasoning} if reasoning else dict(message)


def messages_of(record) -> list[dict]:
    """A record's conversation as a template takes it: its messages as read, or its turns (a pair's, a prompt's),
    or an instruction record's instruction and context as the user's turn and its response as the model's."""
    if record.messages:
        return [dict(m) for m in record.messages]
    turns = record.turns
    if not turns:
        user = record.instruction + (f"\n\n{record.context}" if record.context else "")
        turns = (("user", user), ("assistant", record.response))
    return [{"role": role, "content": text} for role, text in turns]
