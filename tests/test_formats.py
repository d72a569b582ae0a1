import json
import re

import pytest
from conftest import (
    BUILDERS,
    CHAT,
    CONTAINERS,
    FLAT,
    alpaca,
    completion,
    completion_chat,
    dolly,
    make_records,
    sharegpt,
    text,
    write,
    write_jsonl,
)

from finetune.data import formats
from finetune.platform.errors import UserError

pytestmark = pytest.mark.one_backend  # no Keras backend in these: they run in one suite


def test_reads_records_and_ignores_extra_keys(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "response": "b", "id": 7, "context": None}])
    assert formats.load_records(str(path)) == [formats.Record(instruction="a", response="b", context="", category="")]


def test_bom_and_crlf_are_valid(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in make_records(3)]
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    records = formats.load_records(str(path))
    assert len(records) == 3
    assert records[0].instruction == "What is 0 plus 1?"


def test_the_sample_loads():
    records = formats.load_records("sample")
    assert len(records) >= 200
    assert any(r.context for r in records) and any(not r.context for r in records)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "is empty"),
        (b"\n  \n", "is empty"),
        (b'{"instruction": "a", "response": "b"}\n{not json}\n', r":2: not valid JSON"),
        (b'{"instruction": "a"}\n', r":1: record has no 'response' field"),
        (b'{"response": "a"}\n', r":1: a record with 'response' is in no format finetune reads"),
        (b'{"instruction": "a", "response": 3}\n', r":1: field 'response' must be a string, got a number"),
        (b'{"instruction": "a", "response": null}\n', r":1: field 'response' must be a string, got null"),
        (b'{"instruction": "a", "response": "b", "context": ["x"]}\n', r"field 'context' must be a string"),
        (b'["a", "b"]\n', "expected a JSON object"),
        (b'{"instruction": "a", "response": "  "}\n', "field 'response' is empty"),
        ('{"instruction": "caf\u00e9", "response": "b"}\n'.encode("latin-1"), "is not UTF-8"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message):
        formats.load_records(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        formats.load_records(str(tmp_path / "nope.jsonl"))


def test_a_path_from_home_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_jsonl(tmp_path / "mine.jsonl", make_records(2))
    assert len(formats.load_records("~/mine.jsonl")) == 2


def test_a_folder_or_an_empty_path_is_refused_naming_a_data_file_to_give(tmp_path):
    write_jsonl(tmp_path / "mine.jsonl", make_records(2))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match=f"data path {tmp_path} is a folder; give the path of one data file, such as "):
        formats.load_records(str(tmp_path))
    with pytest.raises(UserError, match="the data path is empty"):
        formats.load_records(" ")
    with pytest.raises(UserError, match="hf: names no dataset"):
        formats.load_records("hf:")


GOOD_RECORD = {"instruction": "Say hi.", "response": "Hi."}
# What a careless user hands over, each refused with its file and line and the way out.
CARELESS = {
    "a role that is a list": (
        "c.jsonl",
        json.dumps({"messages": [{"role": ["user"], "content": "a"}, {"role": "assistant", "content": "b"}]}),
        "c.jsonl:1: message 1 has role ['user']; use system (first only), user, assistant, model",
    ),
    "a role that is an object": (
        "c.jsonl",
        json.dumps({"conversations": [{"from": {"who": "human"}, "value": "a"}]}),
        "c.jsonl:1: message 1 has from {'who': 'human'}",
    ),
    "a column named twice": ("d.csv", "instruction,instruction,response\na,b,c\n", "d.csv:1: the header names 'instruction' more than once"),
    "semicolons in a .csv": ("d.csv", "instruction;response\na;b\n", "d.csv:1: the header is one column, 'instruction;response'"),
    "records under a key": ("d.json", json.dumps({"data": [GOOD_RECORD]}), "d.json:1: the records are in a list under 'data'"),
    "a pretty-printed object": ("d.json", json.dumps(GOOD_RECORD, indent=2), "d.json is one JSON object over many lines (a single object)"),
    "pretty-printed records under a key": ("d.json", json.dumps({"rows": [GOOD_RECORD]}, indent=2), "(records under 'rows')"),
    "an array broken on its third line": ("d.json", "[\n" + json.dumps(GOOD_RECORD) + ",\n{oops}\n]", "d.json:3: not valid JSON"),
    "an array nested too deep on its third line": (
        "d.json",
        "[\n" + json.dumps(GOOD_RECORD) + ',\n{"x": ' + "[" * 100_000 + "]" * 100_000 + "}\n]",
        "d.json:3: JSON nested too deeply",
    ),
    "a 5000-digit number as text": ("d.jsonl", '{"instruction": ' + "9" * 5000 + ', "response": "b"}', "d.jsonl:1: field 'instruction' must be a string, got a number"),
    "a 5000-digit number as a record": ("d.jsonl", "9" * 5000, "d.jsonl:1: expected a JSON object (a record), got a number"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CARELESS))
def test_careless_files_are_refused_with_file_line_and_fix(tmp_path, case):
    name, content, message = CARELESS[case]
    (tmp_path / name).write_text(content + "\n", encoding="utf-8")
    with pytest.raises(UserError) as refused:
        formats.read(str(tmp_path / name))
    assert message in str(refused.value) and str(tmp_path / name) in str(refused.value)
    assert len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize(
    "header, row",
    [
        ("instruction, response", "Say hi., Hi."),  # spaces after the commas of a hand-typed header
        ("instruction,response,", "Say hi.,Hi.,"),  # a spreadsheet's empty last column
    ],
)
def test_csv_headers_as_spreadsheets_and_people_write_them_are_read(tmp_path, header, row):
    (tmp_path / "d.csv").write_text(f"{header}\n{row}\n", encoding="utf-8")
    (record,), found = formats.read(str(tmp_path / "d.csv"))
    assert found == "dolly" and record.instruction == "Say hi." and record.response.strip() == "Hi."


def test_parquet_strings_stored_as_binary_are_read_as_text(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = {"instruction": [b"Say hi.", b"Say bye."], "response": [b"Hi.", b"Bye."], "raw": [b"\xff", b"\x00"]}
    pq.write_table(pa.table(rows), tmp_path / "spark.parquet")  # older Spark and Hive write strings as binary
    records, found = formats.read(str(tmp_path / "spark.parquet"))
    assert found == "dolly" and [r.response for r in records] == ["Hi.", "Bye."]
    pq.write_table(pa.table({"instruction": [b"\xff"], "response": [b"Hi."]}), tmp_path / "latin.parquet")
    with pytest.raises(UserError, match=r"latin.parquet row 1: field 'instruction' must be a string, got binary data"):
        formats.read(str(tmp_path / "latin.parquet"))


def test_filters():
    records = [formats.Record(**r) for r in make_records(12)]
    no_context = formats.filter_records(records, drop_context=True)
    assert no_context and all(not r.context for r in no_context)
    only_open = formats.filter_records(records, categories=["open_qa"])
    assert {r.category for r in only_open} == {"open_qa"}
    assert len(formats.filter_records(records, max_records=5)) == 5
    with pytest.raises(UserError, match="no usable records"):
        formats.filter_records(records, categories=["poetry"])


def test_split_is_seeded_and_holds_out_at_least_min_eval():
    records = [formats.Record(**r) for r in make_records(40)]
    train, held = formats.split(records, 0.05, seed=3, min_eval=4)
    assert len(held) == 4 and len(train) == 36
    assert set(train).isdisjoint(held)
    assert formats.split(records, 0.05, seed=3, min_eval=4) == (train, held)
    assert formats.split(records, 0.05, seed=4, min_eval=4)[1] != held
    with pytest.raises(UserError, match="too few"):
        formats.split(records[:2], 0.5, seed=0, min_eval=2)


def test_hugging_face_datasets_are_read_and_checked_row_by_row(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from finetune.platform import platforms

    monkeypatch.setattr(platforms, "reachable", lambda *a, **k: True)
    rows = [
        {"instruction": "a", "context": None, "response": "b", "category": "open_qa"},
        {"instruction": "c", "response": ""},
    ]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: rows[:1] if name == "good/set" else rows)
    assert formats.load_records("hf:good/set") == [formats.Record("a", "b", "", "open_qa")]
    with pytest.raises(UserError, match=r"hf:bad/set row 1: field 'response' is empty"):
        formats.load_records("hf:bad/set")

    def offline(name, split):
        raise ConnectionError("no route")

    chat = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: chat)
    (record,), found = formats.read("hf:chat/set")  # every format is detected from the Hub's rows too
    assert found == "chat" and record.turns == (("user", "a"), ("assistant", "b"))

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError, match="could not load Hugging Face dataset 'x/y'.*--data FILE.jsonl"):
        formats.load_records("hf:x/y")


def test_a_hugging_face_config_and_split_are_passed_to_datasets(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from finetune.platform import platforms

    monkeypatch.setattr(platforms, "reachable", lambda *a, **k: True)
    asked = []

    def load_dataset(path, name=None, split=None):
        asked.append((path, name, split))
        return [{"instruction": "a", "response": "b"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    formats.read("hf:org/set")
    formats.read("hf:org/set:main", split="test[:10]")
    assert asked == [("org/set", None, "train"), ("org/set", "main", "test[:10]")]
    with pytest.raises(UserError, match="--data-split test picks a split of a Hugging Face dataset"):
        formats.read("sample", split="test")


def hub_layout(root, configs: dict) -> str:
    """A dataset folder as the Hub lays one out: Parquet files per split, configs named in README.md's header."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    header = ["---", "configs:"]
    for config, splits in configs.items():
        header += [f"- config_name: {config}", "  data_files:"]
        for split, rows in splits.items():
            (root / config).mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows), root / config / f"{split}.parquet")
            header += [f"  - split: {split}", f"    path: {config}/{split}.parquet"]
    (root / "README.md").write_text("\n".join([*header, "---", ""]), encoding="utf-8")
    return str(root)


def test_a_local_hugging_face_dataset_is_read_by_config_and_split_offline(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [dolly(i) for i in range(6)]
    folder = hub_layout(tmp_path / "set", {"easy": {"train": rows[:4], "test": rows[4:]}, "hard": {"train": rows}})
    records, found = formats.read(f"hf:{folder}:easy", split="test")
    assert found == "dolly" and [r.instruction for r in records] == [r["instruction"] for r in rows[4:]]
    assert len(formats.load_records(f"hf:{folder}:hard")) == 6
    with pytest.raises(UserError, match=r"has no split 'validation'; choose one of train, test with --data-split"):
        formats.read(f"hf:{folder}:easy", split="validation")
    with pytest.raises(UserError, match=r"has no config 'medium'; name one of easy, hard as hf:"):
        formats.read(f"hf:{folder}:medium")
    with pytest.raises(UserError, match=r"has several configs: name one as hf:.*:CONFIG, one of easy, hard"):
        formats.read(f"hf:{folder}")


def test_the_sample_is_exactly_what_its_generator_writes(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "sample.jsonl"
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_sample_data.py"), str(out)], check=True, capture_output=True
    )
    assert out.read_bytes() == formats.SAMPLE_PATH.read_bytes()


GOOD = '{"instruction": "Say hi.", "response": "Hi."'
PATHOLOGICAL = {  # valid JSON a user's file may hold, in a key finetune ignores
    "deep nesting": GOOD + ', "meta": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "a 5000-digit integer": GOOD + ', "id": ' + "9" * 5000 + "}",
    "a huge string": GOOD + ', "blob": "' + "x" * 5_000_000 + '"}',
    "a NUL escape": GOOD + ', "note": "a\\u0000b"}',
}


@pytest.mark.parametrize("case", sorted(PATHOLOGICAL))
@pytest.mark.parametrize("shape", ["jsonl", "array"])
def test_pathological_valid_json_is_read_or_refused_with_its_line(tmp_path, case, shape):
    record = PATHOLOGICAL[case]
    text = f"{GOOD}}}\n{record}\n" if shape == "jsonl" else f"[{GOOD}}},\n{record}]"
    path = tmp_path / f"data.{shape}"
    path.write_text(text, encoding="utf-8")
    try:
        records = formats.load_records(str(path))
    except UserError as e:  # refused: one line naming the file and the line of the record
        assert case == "deep nesting" and f"{path}:2: JSON nested too deeply" in str(e) and "\n" not in str(e)
    else:
        assert len(records) == 2 and records[1].response == "Hi."


def test_invalid_utf8_in_the_middle_of_a_file_names_the_byte(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_bytes(('{"instruction": "a", "response": "b"}\n' * 3).encode() + b'{"instruction": "\xff"}\n')
    with pytest.raises(UserError, match="not UTF-8 text"):
        formats.load_records(str(path))


@pytest.mark.parametrize("body", ["a: " + "[" * 50_000 + "]" * 50_000, "seed: " + "7" * 5000])
def test_a_pathological_recipe_is_a_user_error(tmp_path, body):
    from finetune import config

    path = tmp_path / "recipe.yaml"
    path.write_text(body + "\n", encoding="utf-8")
    with pytest.raises(UserError, match="recipe"):
        config.read_recipe(str(path))


def test_alpaca_records_read_with_input_as_context(tmp_path):
    records, found = formats.read(str(write_jsonl(tmp_path / "a.jsonl", [alpaca(0), alpaca(1)])))
    assert found == "alpaca"
    assert records[0] == formats.Record(instruction="Add 0 and 1.", response="1.", context="0 + 1")
    assert records[1].context == ""


def test_a_json_array_reads_like_json_lines(tmp_path):
    rows = make_records(3)
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=2))
    write_jsonl(tmp_path / "d.jsonl", rows)
    assert formats.read(str(tmp_path / "d.json")) == formats.read(str(tmp_path / "d.jsonl"))


def test_chat_records_keep_every_turn_and_put_the_system_turn_first(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps([CHAT]))
    (record,), found = formats.read(str(tmp_path / "c.json"))
    assert found == "chat"
    assert record.turns == (
        ("user", "Answer briefly.\n\nWhat is 2 plus 2?"),
        ("assistant", "4."),
        ("user", "And 3 plus 3?"),
        ("assistant", "6."),
    )
    assert record.response == "6."


def test_a_first_developer_message_is_the_system_prompt(tmp_path):
    """OpenAI's newer name for the system message, which Gemma 4's template renders as one: read as the system
    turn of a chat and of a tool chat (it was refused, exit 2)."""
    developer = {**CHAT, "messages": [{**CHAT["messages"][0], "role": "developer"}, *CHAT["messages"][1:]]}
    assert CHAT["messages"][0]["role"] == "system"
    tools = {"tools": [], **developer}
    tools["messages"] = [
        *developer["messages"][:2],
        {"role": "assistant", "content": "4.", "reasoning_content": "Add."},
    ]
    (tmp_path / "c.jsonl").write_text(json.dumps(developer) + "\n")
    (tmp_path / "t.jsonl").write_text(json.dumps(tools) + "\n")
    (read,), _ = formats.read(str(tmp_path / "c.jsonl"))
    (tmp_path / "s.jsonl").write_text(json.dumps(CHAT) + "\n")
    (system,), _ = formats.read(str(tmp_path / "s.jsonl"))
    assert read == system
    (tool_chat,), found = formats.read(str(tmp_path / "t.jsonl"))
    assert found == "tool-chat" and tool_chat.messages[0] == {
        "role": "system",
        "content": CHAT["messages"][0]["content"],
    }


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
        formats.read(str(path))


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("fmt", sorted(BUILDERS))
def test_every_container_reads_every_format_the_same(tmp_path, fmt, container):
    rows = [BUILDERS[fmt](i) for i in range(5)]
    path = write(tmp_path / f"d.{container}", rows)
    if container == "csv" and fmt not in FLAT:
        said = "holds a list of messages written as text" if fmt == "completion-chat" else f"{fmt} records hold lists"
        with pytest.raises(UserError, match=said):
            formats.read(str(path))
        return
    records, found = formats.read(str(path))
    assert found == fmt
    assert (records, found) == formats.read(str(write(tmp_path / "same.jsonl", rows)))


def test_sharegpt_reads_as_chat_with_its_system_turn_first(tmp_path):
    (record,), found = formats.read(str(write(tmp_path / "s.json", [sharegpt(0)])))
    assert found == "sharegpt"
    assert record.turns == (("user", "Be brief.\n\nAdd 0 and 1."), ("assistant", "1."))


def test_kto_s_unpaired_preferences_are_refused_not_trained_as_sft(tmp_path):
    """TRL's unpaired form (prompt, completion, a true/false label) trained as SFT, imitating the completions
    labelled false too; it is refused before anything is written, in a fresh process as typed."""
    from test_as_typed import finetune_exits

    rows = [{"prompt": "Q1", "completion": " good", "label": True}, {"prompt": "Q1", "completion": " awful",
            "label": False}]  # fmt: skip
    path = write(tmp_path / "kto.jsonl", rows)
    with pytest.raises(UserError, match="unpaired preference form"):
        formats.read(str(path))
    chat = [{"prompt": [{"role": "user", "content": "Q1"}], "completion": [{"role": "assistant", "content": "x"}],
             "label": False}]  # fmt: skip
    with pytest.raises(UserError, match="KTO's"):
        formats.read(str(write(tmp_path / "kto_chat.jsonl", chat)))
    done = finetune_exits(2, "gemma", "--preset", "tiny", "--data", "kto.jsonl", "--output", "run", cwd=tmp_path)
    assert "kto.jsonl" in done.stderr and "--method dpo" in done.stderr and not (tmp_path / "run").exists()


def test_completion_and_text_records():
    assert formats._record(completion(3), "x", "completion") == formats.Record(
        instruction="3 plus 1 is", response=" 4."
    )
    assert formats._record(text(1), "x", "text") == formats.Record(instruction="", response=text(1)["text"])


@pytest.mark.parametrize(
    "content, message",
    [
        ([{"question": "a", "answer": "b"}], "a record with 'question', 'answer' is in no format finetune reads"),
        (
            [{"prompt": [{"role": "user", "content": "a"}], "completion": "b"}],
            "item 1: `completion` must be a non-empty list of {role, content} messages",
        ),
        (
            [completion(0), {"prompt": [{"role": "user", "content": "a"}], "completion": "b"}],
            "item 2: prompt and completion as lists of messages, in a file whose first record has them as text",
        ),
        (
            [{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "b"}]}],
            "the completion must open with the assistant's message",
        ),
        (
            [
                {
                    "prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                    "completion": [{"role": "assistant", "content": "c"}],
                }
            ],
            "message 3 should be the user's",
        ),  # fmt: skip
        (
            [
                {
                    "prompt": [{"role": "user", "content": "a"}],
                    "tools": [],
                    "completion": [{"role": "assistant", "content": "c"}, {"role": "tool", "content": "d"}],
                }
            ],
            "message 3 is a tool's answer with no assistant tool_calls before it",
        ),  # fmt: skip
        (
            [{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": ["assistant"], "content": "c"}]}],
            "the completion must open with the assistant's message",
        ),
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
        formats.read(str(path))


def test_the_unknown_format_message_lists_every_format(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "a"}])
    with pytest.raises(UserError) as e:
        formats.read(str(path))
    assert all(name in str(e.value) for name in formats.FORMATS) and len(str(e.value).splitlines()) == 2


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
        formats.read(str(path))


@pytest.mark.parametrize("container", ["csv", "parquet"])
def test_pathological_cells_are_read(tmp_path, container):
    rows = [
        {"instruction": "Say hi.", "response": "Hi.", "blob": "x" * 5_000_000},  # past csv's 128 KiB field limit
        {"instruction": "NUL\x00inside", "response": "ok", "blob": "9" * 5000},
        {"instruction": 'quote " and, comma\nnewline', "response": "fine", "blob": ""},
    ]
    records, found = formats.read(str(write(tmp_path / f"odd.{container}", rows)))
    assert found == "dolly" and [r.instruction for r in records] == [r["instruction"] for r in rows]


def test_deeply_nested_parquet_columns_are_ignored(tmp_path):
    deep = "x"
    for _ in range(40):
        deep = [deep]
    rows = [{"instruction": "a", "response": "b", "meta": deep}]
    (record,), _ = formats.read(str(write(tmp_path / "deep.parquet", rows)))
    assert record.response == "b"


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("compression", ["gz", "bz2", "xz"])
def test_a_compressed_file_is_read_as_it_is(tmp_path, container, compression):
    import bz2
    import gzip
    import lzma

    plain = write(tmp_path / f"records.{container}", [dolly(i) for i in range(3)])
    packed = tmp_path / f"records.{container}.{compression}"
    packed.write_bytes({"gz": gzip, "bz2": bz2, "xz": lzma}[compression].compress(plain.read_bytes()))
    assert formats.read(str(packed)) == formats.read(str(plain))


def test_a_gzip_file_without_its_suffix_is_still_read(tmp_path):
    import gzip

    path = tmp_path / "records.jsonl"
    path.write_bytes(gzip.compress(b'{"instruction": "a", "response": "b"}\n'))
    assert formats.load_records(str(path))[0].response == "b"


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("cut.jsonl.gz", b"\x1f\x8b\x08\x00", "is not a whole gzip file"),
        ("plain.jsonl.bz2", b'{"instruction": "a"}', "is not a whole bzip2 file"),
        ("data.zip", b"PK\x03\x04rest", "is a zip archive; extract the data file"),
    ],
)
def test_a_broken_compressed_file_is_named(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=message):
        formats.load_records(str(tmp_path / name))


def test_zstandard_is_read_where_its_package_is_installed(tmp_path):
    path = tmp_path / "records.jsonl.zst"
    try:
        import zstandard
    except ImportError:
        path.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 8)
        with pytest.raises(UserError, match="needs the zstandard package"):
            formats.load_records(str(path))
        return
    path.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "a"}\n'))
    assert formats.load_records(str(path))[0].response == "a"


def test_a_folder_suggests_a_compressed_data_file_in_it(tmp_path):
    (tmp_path / "records.jsonl.gz").write_bytes(b"")
    with pytest.raises(UserError, match="records.jsonl.gz"):
        formats.load_records(str(tmp_path))


def test_a_conversational_prompt_completion_reads_as_a_chat_whose_prompt_is_not_trained(tmp_path):
    """TRL's conversational prompt-completion: the two lists joined, a system message first, the count of the
    prompt's messages kept (templates.py leaves their model turns untrained: test_templates); pictures as TRL's
    content parts in either list."""
    row = {"prompt": [{"role": "system", "content": "Be brief."}, *completion_chat(0)["prompt"]],
           "completion": completion_chat(0)["completion"]}  # fmt: skip
    (record,), found = formats.read(str(write_jsonl(tmp_path / "c.jsonl", [row])))
    assert found == "completion-chat" and record.prompt_messages == 4
    assert [m["role"] for m in record.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert record.turns[-1] == ("assistant", "2.") and record.response == "2."


def test_a_csv_row_holding_messages_written_as_text_is_refused_on_any_row(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('prompt,completion\n1 plus 1 is, 2.\n"[{""role"": ""user"", ""content"": ""a""}]",b\n')
    with pytest.raises(UserError, match=r"d.csv:3: the 'prompt' cell holds a list of messages written as text"):
        formats.read(str(path))
