import pytest

from finetune import templates
from finetune.data import Record
from finetune.errors import UserError

PLAIN = Record(instruction="Name a colour.", response="Blue.")
WITH_CONTEXT = Record(instruction="Summarize.", context="It rained.", response="Rain.")


def test_dolly_matches_the_keras_tutorial():
    prompt, response = templates.get("dolly").apply(PLAIN)
    assert prompt + response == "Instruction:\nName a colour.\n\nResponse:\nBlue."
    assert response == "Blue."


def test_dolly_puts_context_in_its_own_block():
    prompt, _ = templates.get("dolly").apply(WITH_CONTEXT)
    assert prompt == "Instruction:\nSummarize.\n\nContext:\nIt rained.\n\nResponse:\n"


def test_alpaca_with_and_without_input():
    prompt, response = templates.get("alpaca").apply(WITH_CONTEXT)
    assert prompt.endswith("### Instruction:\nSummarize.\n\n### Input:\nIt rained.\n\n### Response:\n")
    assert prompt.startswith("Below is an instruction that describes a task, paired with an input")
    assert response == "Rain."
    prompt, _ = templates.get("alpaca").apply(PLAIN)
    assert "### Input:" not in prompt
    assert prompt.endswith("### Instruction:\nName a colour.\n\n### Response:\n")


def test_gemma_chat_turns():
    prompt, response = templates.get("gemma-chat").apply(WITH_CONTEXT)
    assert prompt == "<start_of_turn>user\nSummarize.\n\nIt rained.<end_of_turn>\n<start_of_turn>model\n"
    assert response == "Rain.<end_of_turn>"
    assert "<end_of_turn>" in templates.get("gemma-chat").stop_tokens


CHAT = Record(instruction="", response="", turns=(("user", "Hi."), ("assistant", "Hello."), ("user", "Bye."),
                                                  ("assistant", "Goodbye.")))  # fmt: skip


def test_gemma4_chat_turns():
    template = templates.get("gemma4-chat")
    prompt, response = template.apply(WITH_CONTEXT)
    assert prompt == "<|turn>user\nSummarize.\n\nIt rained.<turn|>\n<|turn>model\n" and response == "Rain.<turn|>"
    assert template.segments(CHAT) == [
        ("<|turn>user\nHi.<turn|>\n<|turn>model\n", False), ("Hello.<turn|>", True),
        ("\n<|turn>user\nBye.<turn|>\n<|turn>model\n", False), ("Goodbye.<turn|>", True),
    ]  # fmt: skip
    assert "<turn|>" in template.stop_tokens


def test_gemma4_chat_markers_are_single_special_tokens():
    """Token for token: each turn marker is one id of the family's tokenizer, the text between them its own ids."""
    from finetune import batching, presets

    tokenizer = presets.tiny_tokenizer("tiny-gemma4")
    opening, closing = tokenizer.token_to_id("<|turn>"), tokenizer.token_to_id("<turn|>")
    ids = batching._ids(tokenizer, "".join(text for text, _ in templates.get("gemma4-chat").segments(CHAT)))
    text = batching._ids
    expected = [opening, *text(tokenizer, "user\nHi."), closing, *text(tokenizer, "\n"), opening,
                *text(tokenizer, "model\nHello."), closing, *text(tokenizer, "\n"), opening,
                *text(tokenizer, "user\nBye."), closing, *text(tokenizer, "\n"), opening,
                *text(tokenizer, "model\nGoodbye."), closing]  # fmt: skip
    assert ids == expected


def test_chat_records_take_the_family_s_own_turns_on_an_instruction_tuned_preset():
    choose = templates.for_data
    assert choose("dolly", "dolly", "gemma4-chat", "gemma4_instruct_4b", "d.jsonl") == ("dolly", None)
    chosen, note = choose("dolly", "chat", "gemma4-chat", "gemma4_instruct_4b", "d.jsonl")
    assert chosen == "gemma4-chat" and "gemma4_instruct_4b" in note
    assert (
        choose("alpaca", "chat", "gemma-chat", "kaggle://keras/gemma-3n/keras/gemma3n_e4b_it/1", "d")[0] == "gemma-chat"
    )
    assert choose("gemma-chat", "chat", "gemma4-chat", "gemma4_4b", "d.jsonl") == ("gemma-chat", None)  # a base preset
    with pytest.raises(UserError, match="instruction-tuned in the gemma4-chat turn format"):
        choose("gemma-chat", "chat", "gemma4-chat", "gemma4_instruct_2b", "d.jsonl")
    with pytest.raises(UserError, match="d.jsonl holds chat records .*--template gemma4-chat"):
        choose("dolly", "chat", "gemma4-chat", "tiny-gemma4", "d.jsonl")
    # No --template: the data's own format picks it, and the run says so.
    for found, family_chat, expected in [("chat", "gemma4-chat", "gemma4-chat"), ("chat", "gemma-chat", "gemma-chat"),
                                         ("alpaca", "gemma-chat", "alpaca"), ("dolly", "gemma-chat", "dolly")]:  # fmt: skip
        chosen, note = choose("auto", found, family_chat, "tiny", "d.jsonl")
        assert chosen == expected and f"for {found} records" in note
