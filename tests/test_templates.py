from finetune import templates
from finetune.data import Record

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
