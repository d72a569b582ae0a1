"""Dolly, Alpaca and chat records, as JSON Lines or one JSON array: read, checked, rendered, weighted, trained."""

import json
import re

import pytest
from conftest import BACKEND, make_records, write_jsonl
from typer.testing import CliRunner

from finetune import batching, data, presets, templates
from finetune.cli import app
from finetune.errors import UserError

CHAT = {
    "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "6."},
    ]
}


def alpaca(i):
    return {"instruction": f"Add {i} and 1.", "input": "" if i % 2 else f"{i} + 1", "output": f"{i + 1}."}


def chat(i):
    return {"messages": [{"role": "user", "content": f"Add {i} and 1."}, {"role": "assistant", "content": f"{i + 1}."}]}


def test_alpaca_records_read_with_input_as_context(tmp_path):
    records, found = data.read(str(write_jsonl(tmp_path / "a.jsonl", [alpaca(0), alpaca(1)])))
    assert found == "alpaca"
    assert records[0] == data.Record(instruction="Add 0 and 1.", response="1.", context="0 + 1")
    assert records[1].context == ""


def test_a_json_array_reads_like_json_lines(tmp_path):
    rows = make_records(3)
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=2))
    write_jsonl(tmp_path / "d.jsonl", rows)
    assert data.read(str(tmp_path / "d.json")) == data.read(str(tmp_path / "d.jsonl"))


def test_chat_records_keep_every_turn_and_put_the_system_turn_first(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps([CHAT]))
    (record,), found = data.read(str(tmp_path / "c.json"))
    assert found == "chat"
    assert record.turns == (
        ("user", "Answer briefly.\n\nWhat is 2 plus 2?"),
        ("assistant", "4."),
        ("user", "And 3 plus 3?"),
        ("assistant", "6."),
    )
    assert record.response == "6."


@pytest.mark.parametrize(
    "content, message",
    [
        (
            [alpaca(0), {"instruction": "x", "input": "y"}],
            "item 2: record has no 'output' field; this file is in Alpaca",
        ),
        ([{"messages": []}], "item 1: `messages` must be a non-empty list"),
        ([{"messages": [{"role": "assistant", "content": "hi"}]}], "message 1 should be the user's"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "the last message must be the assistant's"),
        ([{"messages": [{"role": "robot", "content": "hi"}]}], "message 1 has role 'robot'"),
        (
            [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}],
            "message 2 is empty",
        ),
        ([{"messages": [{"role": "user", "content": 3}]}], "message 1 must be an object with a `role` and a string"),
        ([], "the JSON array is empty"),
    ],
)
def test_bad_records_name_the_item_and_the_fix(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(UserError, match=re.escape(message)):
        data.read(str(path))


def test_gemma_chat_trains_on_every_assistant_turn_and_nothing_else():
    record = data.Record(
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
    record = data.Record(instruction="a", response="b", turns=(("user", "a"), ("assistant", "b")))
    with pytest.raises(UserError, match="need --template gemma-chat"):
        templates.get("dolly").segments(record)


@pytest.mark.parametrize(
    "name, rows, template",
    [
        ("alpaca.jsonl", [alpaca(i) for i in range(24)], "alpaca"),
        ("dolly.json", make_records(24), "dolly"),
        ("chat.json", [chat(i) for i in range(23)] + [CHAT], "gemma-chat"),
    ],
)
def test_every_format_trains(tmp_path, name, rows, template):
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps(rows))
    else:
        write_jsonl(path, rows)
    args = f"gemma --preset tiny --backend {BACKEND} --seq-len 128 --batch-size 2 --max-steps 1 --template {template}"
    result = CliRunner().invoke(
        app, [*args.split(), "--data", str(path), "--set", "train.samples=0", "--output", str(tmp_path / "run")]
    )
    assert result.exit_code == 0, result.output + (result.stderr or "")
    assert f"read {len(rows)} records, {name.split('.')[0]} format" in result.output
    assert (tmp_path / "run" / "adapter.lora.h5").is_file()
