"""Dolly, Alpaca and chat records, as JSON Lines or one JSON array: read, checked, rendered, weighted, trained."""

import json
import re

import pytest
from conftest import BACKEND, make_records, write_jsonl
from typer.testing import CliRunner

from finetune import batching, data, datacheck, presets, templates
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


# Every format, in every container that can hold it: one record builder per format.
def sharegpt(i):
    turns = [{"from": "human", "value": f"Add {i} and 1."}, {"from": "gpt", "value": f"{i + 1}."}]
    return {"conversations": turns} if i % 2 else {"system": "Be brief.", "conversations": turns}


def completion(i):
    return {"prompt": f"{i} plus 1 is", "completion": f" {i + 1}."}


def text(i):
    return {"text": f"The number after {i} is {i + 1}, and the one after that is {i + 2}."}


def dolly(i):
    return make_records(i + 1)[i]


BUILDERS = {
    "dolly": dolly,
    "alpaca": alpaca,
    "chat": chat,
    "sharegpt": sharegpt,
    "completion": completion,
    "text": text,
}
FLAT = ("dolly", "alpaca", "completion", "text")
CONTAINERS = ("jsonl", "json", "csv", "parquet")


def write(path, rows):
    """rows as the file its suffix names."""
    if path.suffix == ".jsonl":
        write_jsonl(path, rows)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif path.suffix == ".csv":
        import csv

        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("fmt", sorted(BUILDERS))
def test_every_container_reads_every_format_the_same(tmp_path, fmt, container):
    rows = [BUILDERS[fmt](i) for i in range(5)]
    path = write(tmp_path / f"d.{container}", rows)
    if container == "csv" and fmt not in FLAT:
        with pytest.raises(UserError, match=f"{fmt} records hold lists of turns, which a CSV cell cannot"):
            data.read(str(path))
        return
    records, found = data.read(str(path))
    assert found == fmt
    assert (records, found) == data.read(str(write(tmp_path / "same.jsonl", rows)))


def test_sharegpt_reads_as_chat_with_its_system_turn_first(tmp_path):
    (record,), found = data.read(str(write(tmp_path / "s.json", [sharegpt(0)])))
    assert found == "sharegpt"
    assert record.turns == (("user", "Be brief.\n\nAdd 0 and 1."), ("assistant", "1."))


def test_completion_and_text_records():
    assert data._record(completion(3), "x", "completion") == data.Record(instruction="3 plus 1 is", response=" 4.")
    assert data._record(text(1), "x", "text") == data.Record(instruction="", response=text(1)["text"])


def test_a_text_records_sample_starts_from_its_opening_words():
    record = data.Record(instruction="", response=text(5)["text"])
    assert templates.get("none").sample_prompt(record) == "The number after"
    assert templates.get("none").sample_prompt(data.Record(instruction="", response="One")) == "One"


def trained_and_not(fmt, i=0):
    """(ids that carry loss, ids that do not) of one record of `fmt`, rendered by the template auto picks."""
    tokenizer = presets.tiny_tokenizer()
    (record,), _ = data._records([("x", BUILDERS[fmt](i))], "x")
    name, _ = templates.for_data("auto", fmt, "gemma-chat", "tiny", "x")
    (example,), _ = batching.tokenize([templates.get(name).segments(record)], tokenizer, seq_len=256)
    trained = [t for t, w in zip(example.token_ids, example.weights) if w]
    untrained = [t for t, w in zip(example.token_ids, example.weights) if not w]
    return trained, untrained, lambda s: [int(t) for t in tokenizer.tokenize(s)]


@pytest.mark.parametrize(
    "fmt, loss_on, no_loss_on",
    [
        ("dolly", ["0 plus 1 is 1."], ["Instruction:\nWhat is 0 plus 1?\n\nContext:\nNumbers 0 and 1.\n\nResponse:\n"]),
        ("alpaca", ["1."], [templates.get("alpaca").apply(data.Record("Add 0 and 1.", "1.", "0 + 1"))[0]]),
        ("chat", ["1.<end_of_turn>"], ["<start_of_turn>user\nAdd 0 and 1.<end_of_turn>\n<start_of_turn>model\n"]),
        (
            "sharegpt",
            ["1.<end_of_turn>"],
            ["<start_of_turn>user\nBe brief.\n\nAdd 0 and 1.<end_of_turn>\n<start_of_turn>model\n"],
        ),
        ("completion", [" 1."], ["0 plus 1 is"]),
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


@pytest.mark.parametrize(
    "content, message",
    [
        ([{"question": "a", "answer": "b"}], "a record with 'question', 'answer' is in no format finetune reads"),
        ([{"prompt": [{"role": "user", "content": "a"}], "completion": "b"}], "as lists of turns are not read"),
        (
            [completion(0), {"prompt": "a"}],
            "item 2: record has no 'completion' field; this file is in prompt/completion",
        ),
        ([text(0), {"text": ""}], "item 2: field 'text' is empty"),
        ([{"conversations": [{"from": "robot", "value": "a"}]}], "message 1 has from 'robot'"),
        ([{"conversations": [{"from": "gpt", "value": "a"}]}], "message 1 should be the user's"),
        ([{"conversations": [{"from": "human", "text": "a"}]}], "an object with a `from` and a string `value`"),
        ([{"conversations": "hi"}], "`conversations` must be a non-empty list of {from, value} turns"),
    ],
)
def test_bad_records_of_the_newer_formats_name_the_item_and_the_fix(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(UserError, match=re.escape(message)):
        data.read(str(path))


def test_the_unknown_format_message_lists_every_format(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "a"}])
    with pytest.raises(UserError) as e:
        data.read(str(path))
    assert all(name in str(e.value) for name in data.FORMATS) and len(str(e.value).splitlines()) == 2


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("rows.csv", 'instruction,response\na,b\n"c,d\ne,f\n', "rows.csv:3: not valid CSV (unexpected end of data)"),
        ("rows.csv", 'instruction,response\na,"b"c\n', "rows.csv:2: not valid CSV"),
        ("rows.csv", "instruction,response\na,b,c\n", "rows.csv:2: this row has more cells than the header"),
        ("rows.csv", "instruction,response\n", "holds no records"),
        ("rows.parquet", "PAR1 but nothing else", "cannot read this Parquet file"),
        ("rows.parquet", '{"instruction": "a", "response": "b"}', "is not a Parquet file"),
        ("rows.csv", b"instruction,response\na,b\n\xff,c\n", "rows.csv:3 is not UTF-8 text"),
    ],
)
def test_bad_csv_and_parquet_files_name_the_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError, match=re.escape(message)):
        data.read(str(path))


@pytest.mark.parametrize("container", ["csv", "parquet"])
def test_pathological_cells_are_read(tmp_path, container):
    rows = [
        {"instruction": "Say hi.", "response": "Hi.", "blob": "x" * 5_000_000},  # past csv's 128 KiB field limit
        {"instruction": "NUL\x00inside", "response": "ok", "blob": "9" * 5000},
        {"instruction": 'quote " and, comma\nnewline', "response": "fine", "blob": ""},
    ]
    records, found = data.read(str(write(tmp_path / f"odd.{container}", rows)))
    assert found == "dolly" and [r.instruction for r in records] == [r["instruction"] for r in rows]


def test_deeply_nested_parquet_columns_are_ignored(tmp_path):
    deep = "x"
    for _ in range(40):
        deep = [deep]
    rows = [{"instruction": "a", "response": "b", "meta": deep}]
    (record,), _ = data.read(str(write(tmp_path / "deep.parquet", rows)))
    assert record.response == "b"


TRAIN_RUNS = [(fmt, c) for fmt in sorted(BUILDERS) for c in CONTAINERS if c != "csv" or fmt in FLAT]
# One container per format on every backend; the whole matrix on JAX, the quickest to build (the read test above
# shows every container gives the same records).
DIAGONAL = {("chat", "json"), ("sharegpt", "parquet"), ("dolly", "csv"), ("alpaca", "jsonl"), ("completion", "csv"),
            ("text", "parquet")}  # fmt: skip


@pytest.mark.parametrize("fmt, container", TRAIN_RUNS)
def test_every_format_trains_with_no_template(tmp_path, fmt, container):
    if BACKEND != "jax" and (fmt, container) not in DIAGONAL:
        pytest.skip("the whole matrix runs on JAX; one container per format on the other backends")
    rows = [BUILDERS[fmt](i) for i in range(24)]
    path = write(tmp_path / f"{fmt}.{container}", rows)
    args = f"gemma --preset tiny --backend {BACKEND} --seq-len 128 --batch-size 2 --max-steps 1"
    samples = "1" if fmt == "text" else "0"  # a text record's sample starts from its opening words
    result = CliRunner().invoke(
        app, [*args.split(), "--data", str(path), "--set", f"train.samples={samples}", "--output", str(tmp_path / "r")]
    )
    assert result.exit_code == 0, result.output + (result.stderr or "")
    assert f"read 24 records, {fmt} format" in result.output
    chosen = {"chat": "gemma-chat", "sharegpt": "gemma-chat", "completion": "none", "text": "none"}.get(fmt, fmt)
    assert f"template: {chosen}, for {fmt} records" in result.output
    assert (tmp_path / "r" / "adapter.lora.h5").is_file()
    if fmt == "text":
        assert "The number after" in (tmp_path / "r" / "samples.md").read_text()


def test_finetune_data_reports_the_format_tokens_packing_and_a_marked_example(tmp_path):
    path = write(tmp_path / "c.csv", [completion(i) for i in range(30)])
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny", "--seq-len", "64", "--example", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "format: completion (prompt, completion), 30 records" in lines
    assert "template: none (auto, for this format)" in lines
    assert any(line.startswith("tokens (tiny's tokenizer") for line in lines)
    assert any(line.startswith("packing at seq-len 64: 30 rows -> ") for line in lines)
    assert lines[-1] == "  1 plus 1 is« 2.<eos>»"


def test_finetune_data_without_a_tokenizer_still_reports_the_rest(tmp_path, monkeypatch):
    for name in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kaggle/kaggle.json
    path = write(tmp_path / "t.jsonl", [text(0)])
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "gemma_2b_en"])
    assert result.exit_code == 0, result.output
    assert "tokens: not counted (" in result.output
    assert result.output.rstrip().endswith("«The number after 0 is 1, and the one after that is 2.<eos>»")


def test_render_marks_every_trained_turn():
    pieces = templates.get("gemma-chat").segments(data._record(CHAT, "x", "chat"))
    rendered = datacheck.render(pieces)
    assert rendered.count("«") == 2 and rendered.endswith("«6.<end_of_turn><eos>»")
    assert datacheck.render([("a", False), ("b", True)], train_on_prompt=True) == "«ab<eos>»"
