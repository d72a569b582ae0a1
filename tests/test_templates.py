import json
import re

import pytest
from conftest import BUILDERS, text

from finetune.data import batching, formats, templates
from finetune.data.formats import Record
from finetune.model import presets
from finetune.platform.errors import UserError

pytestmark = pytest.mark.one_backend  # no Keras backend in these: they run in one suite

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
    from finetune.data import batching
    from finetune.model import presets

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


def test_gemma_chat_trains_on_every_assistant_turn_and_nothing_else():
    record = formats.Record(
        instruction="",
        response="",
        turns=(("user", "Hi."), ("assistant", "Hello."), ("user", "Bye."), ("assistant", "Bye!")),
    )
    template = templates.get("gemma-chat")
    pieces = template.segments(record)
    assert [trained for _, trained in pieces] == [False, True, False, True]
    prompt, response = template.apply(record)
    assert prompt.endswith("Bye.<end_of_turn>\n<start_of_turn>model\n") and response == "Bye!<end_of_turn>"
    assert prompt + response == "".join(text for text, _ in pieces)
    tokenizer = presets.tiny_tokenizer()
    (example,), _ = batching.tokenize([pieces], tokenizer, seq_len=256)
    trained = [i for i, w in zip(example.token_ids, example.weights) if w]
    expected = [int(t) for text in ("Hello.<end_of_turn>", "Bye!<end_of_turn>") for t in tokenizer.tokenize(text)]
    assert trained == expected + [batching.EOS]


def test_chat_records_with_an_instruction_template_are_refused():
    record = formats.Record(instruction="a", response="b", turns=(("user", "a"), ("assistant", "b")))
    with pytest.raises(UserError, match="need --template gemma-chat"):
        templates.get("dolly").segments(record)


def test_a_text_records_sample_starts_from_its_opening_words():
    record = formats.Record(instruction="", response=text(5)["text"])
    assert templates.get("none").sample_prompt(record) == "The number after"
    assert templates.get("none").sample_prompt(formats.Record(instruction="", response="One")) == "One"
    # Its reference is the rest, what the model would go on with: prompt and reference make the whole text.
    reference = templates.get("none").sample_reference(record)
    assert not reference.startswith("The") and record.response == f"The number after {reference}"
    dolly = formats.Record(instruction="Say a", response="a")
    assert templates.get("dolly").sample_reference(dolly) == "a"


def trained_and_not(fmt, i=0):
    """(ids that carry loss, ids that do not) of one record of `fmt`, rendered by the template auto picks."""
    tokenizer = presets.tiny_tokenizer()
    (record,), _ = formats._records([("x", BUILDERS[fmt](i))], "x")
    name, _ = templates.for_data("auto", fmt, "gemma-chat", "tiny", "x")
    (example,), _ = batching.tokenize([templates.get(name).segments(record)], tokenizer, seq_len=256)
    trained = [t for t, w in zip(example.token_ids, example.weights) if w]
    untrained = [t for t, w in zip(example.token_ids, example.weights) if not w]
    return trained, untrained, lambda s: [int(t) for t in tokenizer.tokenize(s)]


@pytest.mark.parametrize(
    "fmt, loss_on, no_loss_on",
    [
        ("dolly", ["0 plus 1 is 1."], ["Instruction:\nWhat is 0 plus 1?\n\nContext:\nNumbers 0 and 1.\n\nResponse:\n"]),
        ("alpaca", ["1."], [templates.get("alpaca").apply(formats.Record("Add 0 and 1.", "1.", "0 + 1"))[0]]),
        ("chat", ["1.<end_of_turn>"], ["<start_of_turn>user\nAdd 0 and 1.<end_of_turn>\n<start_of_turn>model\n"]),
        (
            "sharegpt",
            ["1.<end_of_turn>"],
            ["<start_of_turn>user\nBe brief.\n\nAdd 0 and 1.<end_of_turn>\n<start_of_turn>model\n"],
        ),
        ("completion", [" 1."], ["0 plus 1 is"]),
        (
            "completion-chat",
            ["2.<end_of_turn>"],
            [
                "<start_of_turn>user\nAdd 0 and 1.<end_of_turn>\n<start_of_turn>model\n1.<end_of_turn>\n"
                "<start_of_turn>user\nAnd 2?<end_of_turn>\n<start_of_turn>model\n"
            ],
        ),  # fmt: skip
        ("text", ["The number after 0 is 1, and the one after that is 2."], []),
    ],
)
def test_which_tokens_carry_the_loss_in_each_format(fmt, loss_on, no_loss_on):
    trained, untrained, ids = trained_and_not(fmt)
    assert trained == [i for s in loss_on for i in ids(s)] + [batching.EOS]
    assert untrained == [batching.BOS] + [i for s in no_loss_on for i in ids(s)]


@pytest.mark.parametrize(
    "fmt, template, message",
    [
        ("text", "dolly", "holds text records, with no prompt for the dolly template; use --template none"),
        ("dolly", "none", "holds dolly records, whose instruction and context need a template; use --template dolly"),
        ("sharegpt", "alpaca", "holds sharegpt records (turns); train them with --template gemma-chat"),
    ],
)
def test_a_template_that_cannot_render_the_data_is_refused(fmt, template, message):
    with pytest.raises(UserError, match=re.escape(message)):
        templates.for_data(template, fmt, "gemma-chat", "gemma_2b_en", "d.jsonl")


def test_completion_records_take_an_instruction_template_when_asked():
    assert templates.for_data("dolly", "completion", "gemma-chat", "tiny", "d") == ("dolly", None)


def test_generation_stops_at_the_stop_tokens_the_tokenizer_has_and_gemma4_at_a_tool_call_s_hand_over():
    """Gemma 4's chat stops where a tool call hands over to the tool; a tokenizer without one of the stop tokens
    as a piece (tiny-gemma4's lacks <|tool_response>) stops at the others, not at its unknown id."""
    template = templates.get("gemma4-chat")
    assert "<|tool_response>" in template.stop_tokens
    tokenizer = presets.tiny_tokenizer("tiny-gemma4")
    ids = template.stop_ids(tokenizer)
    unknown = tokenizer.token_to_id("<|tool_response>")
    assert unknown not in ids and tokenizer.token_to_id("<turn|>") in ids and tokenizer.token_to_id("<eos>") in ids


def test_a_tool_chat_sample_is_compared_with_the_call_it_trains_after_its_prompt(tmp_path):
    """After the sample prompt (the system turn with the declarations, the user's turn) a tool-chat record trains
    the model to call the tool, where generation stops (<|tool_response>): that call is the reference, not the
    final reply, which only follows the tool's response."""
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Lima"}}}
    tool = {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    record = {"tools": [tool], "messages": [{"role": "user", "content": "Weather in Lima?"},
              {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "name": "weather", "content": "28"},
              {"role": "assistant", "content": "It is 28 degrees."}]}  # fmt: skip
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(record) + "\n")
    records, found = formats.read(str(path), "train")
    gemma4 = templates.get("gemma4-chat")
    reference = gemma4.sample_reference(records[0])
    assert found == "tool-chat" and reference.startswith("<|tool_call>call:weather{") and "Lima" in reference
    assert reference.endswith("<tool_call|>") and "28 degrees" not in reference
    whole = "".join(text for text, _ in gemma4.segments(records[0]))
    assert whole.startswith(gemma4.sample_prompt(records[0]) + reference)
