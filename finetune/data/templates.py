"""Instruction templates: a record in, (prompt, response) text out.

The prompt is what the model is given; the response is what it learns to
write, so the loss is taken on response tokens only. Each template is a small
class with an `apply()` method and pure string logic, easy to test.
`segments()` gives the same text as (text, trained) pieces: one prompt and one
response for an instruction, and every turn for a multi-turn chat, whose
assistant turns are all trained on.

A preference pair (formats.Record with `rejected`) renders twice: segments()
gives the prompt and the chosen answer, rejected_segments() the same prompt
pieces and the rejected answer, so both begin with the same ids.

`none` is no template: a completion record's prompt and completion as they
are written, and a text record's text, all of it trained on.

Each Gemma family's instruction-tuned presets speak one turn format:
gemma-chat (Gemma 1 to 3, and 3n) or gemma4-chat (Gemma 4's <|turn> markers),
each rendered by the model's own chat template (chat.py); only Gemma 4's
renders tools, tool calls and thinking (tool-chat records).
for_data() picks the template for the data's format, and refuses one that
cannot render it.
"""

from __future__ import annotations

import dataclasses
import re

from finetune.data import chat
from finetune.data.formats import CHAT_FORMATS, Record
from finetune.platform.errors import UserError


class Template:
    name = ""
    tools = False
    """Whether it renders tool declarations, tool calls, tool responses and thinking (tool-chat records)."""

    def apply(self, record: Record) -> tuple[str, str]:
        raise NotImplementedError

    def segments(self, record: Record) -> list[tuple[str, bool]]:
        if record.turns:
            where = f"{record.where}: " if record.where else ""  # an --eval-data file's, as a training file's
            raise UserError(
                f"{where}chat records (messages) need --template gemma-chat or gemma4-chat, not {self.name}"
            )
        prompt, response = self.apply(record)
        return [(prompt, False), (response, True)]

    def rejected_segments(self, record: Record) -> list[tuple[str, bool]]:
        """A preference pair's prompt, in the same pieces as segments() gives it, then the rejected answer."""
        turns = (*record.turns[:-1], ("assistant", record.rejected)) if record.turns else ()
        rejected = {"role": "assistant", "content": record.rejected}
        messages = (*record.messages[:-1], rejected) if record.messages else ()
        return self.segments(
            dataclasses.replace(record, response=record.rejected, turns=turns, messages=messages, rejected="")
        )

    def sample_prompt(self, record: Record) -> str:
        """What a sample generation before and after training is given for `record`."""
        return self.apply(record)[0]

    def sample_reference(self, record: Record) -> str:
        """What a sample generation for `record` is compared with (samples.md, eval --generate's ROUGE-L): what the
        record trains the model to write after its sample prompt, up to where generation stops. A tool-chat
        record's is its tool call, which hands over to the tool (<|tool_response>), not its final reply."""
        rest = self.apply(record)[1]
        return rest[: min((rest.find(t) for t in self.stop_tokens if t in rest), default=len(rest))]

    def stop_ids(self, tokenizer) -> tuple[int, ...]:
        return stop_ids(tokenizer, self.stop_tokens)


def stop_ids(tokenizer, tokens) -> tuple[int, ...]:
    """The ids generation stops at: each of `tokens` the tokenizer has as one piece (for one it lacks, a tiny
    preset's tokenizer gives its unknown id, and generation would stop at any unknown piece)."""
    ids = ((token, tokenizer.token_to_id(token)) for token in tokens)
    return tuple(i for token, i in ids if tokenizer.id_to_token(i) == token)


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
    """Gemma 3's chat template (chat_templates/gemma3.jinja), the turn format of Gemma 1 to 3 and 3n.

    A record renders as the model's own template renders its messages (chat.py); each model turn is trained on,
    from its first token to its turn end (<end_of_turn>), and the rest is not. Gemma 3's
    template has no tool turns: it puts a system message before the first user turn, as Gemma 1 and 2 were
    tuned to read one.
    """

    name = "gemma-chat"
    stop_tokens = ("<eos>", "<end_of_turn>")
    renderer = chat.GEMMA3

    def apply(self, record: Record) -> tuple[str, str]:
        """(the prompt: every turn before the last model turn, that turn opened; the model's last turn)."""
        messages = chat.messages_of(record)
        if messages[-1]["role"] == "user":  # a prompt alone (GRPO's): every turn, the model's opened
            return self.renderer.text(messages, record.tools, add_generation_prompt=True), ""
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        thinking = any(chat.reasoning_of(m) for m in messages)
        prompt = self.renderer.text(
            messages[: last_user + 1], record.tools, add_generation_prompt=True, thinking=thinking
        )
        pieces = self.segments(record)
        whole = "".join(text for text, _ in pieces)
        if not whole.startswith(prompt):  # the prompt renders otherwise alone (a turn the next one changes)
            return prompt, "".join(text for text, trained in pieces if trained)
        return prompt, whole[len(prompt) :]

    def segments(self, record: Record) -> list[tuple[str, bool]]:
        """The record's text in pieces, each with whether it carries loss (the model's turns do).

        The newline the template writes after the last turn is left off: <eos> follows the model's turn end, where
        generation stops, and a pair's answer is its last piece (pairs.py).
        """
        messages = chat.messages_of(record)
        pieces = self.renderer.segments(messages, record.tools)
        if pieces[-1] == ("\n", False):
            pieces = pieces[:-1]
        if record.prompt_messages:  # a completion-chat record: its prompt's model turns are not trained
            thinking = any(chat.reasoning_of(m) for m in messages)
            prompt = self.renderer.text(
                messages[: record.prompt_messages], record.tools, add_generation_prompt=True, thinking=thinking
            )
            if not "".join(text for text, _ in pieces).startswith(prompt):
                raise UserError(
                    f"{record.where}: the {self.renderer.file} chat template renders this prompt otherwise once "
                    "its completion follows it; give the conversation as `messages`"
                )
            pieces = chat.untrained_before(pieces, len(prompt))
        return pieces


class Gemma4Chat(GemmaChat):
    """Gemma 4's chat template (chat_templates/gemma4.jinja): <|turn>user ... <turn|>, then <|turn>model ...

    It renders a system turn of its own, tool declarations in it, the model's tool calls and thinking in its
    turn, and tool responses inside the model's turn (not trained). keras-hub's Gemma4CausalLM stops generating
    at <turn|> too; generation also stops where a tool call hands over to the tool (<|tool_response>), so the call
    is the model's answer, as Gemma 4's generation config stops there.
    """

    name = "gemma4-chat"
    stop_tokens = ("<eos>", "<turn|>", "<|tool_response>")
    renderer = chat.GEMMA4
    tools = chat.GEMMA4.tools


class NoTemplate(Template):
    """No template: the prompt as written, then the completion, trained on; a text record is all completion.

    TRL's prompt-completion format without a chat template: nothing is added
    between the two, so the data's own spacing is what the model sees.
    """

    name = "none"
    stop_tokens = ("<eos>",)

    def apply(self, record: Record) -> tuple[str, str]:
        return record.instruction, record.response

    def sample_prompt(self, record: Record) -> str:
        """A text record's sample continues its opening words (a quarter of them, at most 16); an empty
        prompt would give every sample the same greedy text."""
        if record.instruction:
            return record.instruction
        words = re.findall(r"\S+\s*", record.response)
        return "".join(words[: max(1, min(16, len(words) // 4))]).rstrip()

    def sample_reference(self, record: Record) -> str:
        """The rest of a text record after its sample prompt's opening words: what the model would go on with."""
        if record.instruction:
            return record.response
        return record.response[len(self.sample_prompt(record)) :].lstrip()


TEMPLATES = {t.name: t for t in (Dolly(), Alpaca(), GemmaChat(), Gemma4Chat(), NoTemplate())}
CHAT = ("gemma-chat", "gemma4-chat")
# The template --template auto gives each format that is not chat.
OWN = {"dolly": "dolly", "alpaca": "alpaca", "completion": "none", "text": "none", "preference": "none",
       "prompts": "none"}  # fmt: skip


def pair_segments(template: Template, record: Record) -> tuple[list, list]:
    """(chosen, rejected) segments of a preference pair: the same prompt pieces, then each answer last."""
    return template.segments(record), template.rejected_segments(record)


def read_as_text(name: str, records):
    """The first of `records` given as a conversation (turns or messages) that the template `name`, one of text
    (dolly, alpaca, none), would read as plain text, its other turns dropped; None where it renders them all."""
    if name in CHAT:
        return None
    return next((r for r in records if r.turns or r.messages), None)


def get(name: str):
    return TEMPLATES[name]


def for_data(
    name: str, found: str, family_chat: str, preset: str, path: str, trained: bool = False
) -> tuple[str, str | None]:
    """(the template a run uses, a note when it was chosen for the user), for data of format `found`; tool-chat
    records only with a template that renders tools (Gemma 4's)."""
    chosen, note = _for_data(name, found, family_chat, preset, path, trained)
    if found == "tool-chat" and not TEMPLATES[chosen].tools:
        raise UserError(
            f"{path} holds chat records with tools, tool calls or thinking, which the {chosen} template does not "
            "render (Gemma 3's chat template has no tool turns); train them on a Gemma 4 preset (--template "
            "gemma4-chat), or take the tools out of the records"
        )
    return chosen, note


def _for_data(
    name: str, found: str, family_chat: str, preset: str, path: str, trained: bool = False
) -> tuple[str, str | None]:
    """(the template a run uses, a note when it was chosen for the user), for data of format `found`.

    auto follows the data: its own template, or for chat and ShareGPT records
    the family's chat turns. A named template must render the data: chat
    records need a chat template (another family's turns are refused on an
    instruction-tuned preset), text records only go without one, and `none`
    has no place for an instruction's parts.

    trained: bool. `name` is a trained run's template (`finetune eval --data`): it is not the user's to change,
        so data it cannot render is refused as data of another format.
    """
    if trained:
        if not renders(name, found):
            raise UserError(
                f"{path} holds {found} records, which this run's template, {name}, cannot render; evaluate it on "
                "records of the format it was trained on"
            )
        return name, None
    if name == "auto":  # the data's own format; the run records what it became
        chosen = family_chat if found in CHAT_FORMATS else OWN[found]
        return chosen, f"template: {chosen}, for {found} records (--template names another)"
    if found == "text" and name != "none":
        raise UserError(f"{path} holds text records, with no prompt for the {name} template; use --template none")
    if name == "none" and found in ("dolly", "alpaca"):
        raise UserError(
            f"{path} holds {found} records, whose instruction and context need a template; "
            f"use --template {found} (or auto)"
        )
    if found not in CHAT_FORMATS:
        return name, None
    instruct = is_instruct(preset)
    if name in CHAT:
        if instruct and name != family_chat:
            raise UserError(
                f"{preset} was instruction-tuned in the {family_chat} turn format; train its chat records with "
                f"--template {family_chat}"
            )
        return name, None
    if instruct:
        return family_chat, f"note: chat records on the instruction-tuned {preset}: --template {family_chat}, its turns"
    raise UserError(f"{path} holds {found} records (turns); train them with --template {family_chat} (or auto)")


def renders(name: str, found: str) -> bool:
    """Whether template `name` renders records of format `found` as training would (for_data's rules)."""
    if found == "tool-chat":
        return name == "gemma4-chat"
    if found in CHAT_FORMATS:
        return name in CHAT
    if found == "text":
        return name == "none"
    return not (name == "none" and found in ("dolly", "alpaca"))


def is_instruct(preset: str) -> bool:
    """A keras-hub preset name (or kaggle:// handle) of an instruction-tuned model: gemma_instruct_2b_en,
    gemma4_instruct_4b, gemma3n_e4b_it."""
    parts = preset.removeprefix("kaggle://").rstrip("/").split("/")
    name = parts[3] if preset.startswith("kaggle://") and len(parts) > 3 else parts[-1]
    return "_instruct_" in name or name.endswith("_it")
