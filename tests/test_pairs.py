"""Preference pairs (pairs.py, and how formats.py reads them): each of TRL's forms read to its prompt, chosen and
rejected answers; bad pairs named by their line; pairs tokenized to two Examples that share their prompt ids, a
long prompt cut from its left. The losses and training on pairs are tested beside the objective.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write
from typer.testing import CliRunner

from finetune.cli import app
from finetune.data import batching, formats, pairs, templates
from finetune.model import presets
from finetune.platform.errors import UserError

pytestmark = pytest.mark.one_backend  # reading and tokenizing text touch no Keras backend


def message(role, content):
    return {"role": role, "content": content}


SKY = [message("user", "What color is the sky?")]
HH = "\n\nHuman: What color is the sky?\n\nAssistant:"
# Each form, and the (prompt, chosen, rejected) it reads as; a conversational prompt as its (role, text) turns.
FORMS = {
    "standard": (
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        ("preference", "The sky is", " blue.", " green."),
    ),
    "implicit": (
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        ("preference", "The sky is", " blue.", " green."),
    ),
    # The answers share their first word: the prompt still ends at the last "\n\nAssistant:".
    "hh": (
        {"chosen": f"{HH} It is blue.", "rejected": f"{HH} It is green."},
        ("preference", HH, " It is blue.", " It is green."),
    ),
    "conversational": (
        {"prompt": SKY, "chosen": [message("assistant", "Blue.")], "rejected": [message("assistant", "Green.")]},
        ("preference-chat", (("user", "What color is the sky?"),), "Blue.", "Green."),
    ),
    "implicit-conversational": (
        {"chosen": [*SKY, message("assistant", "Blue.")], "rejected": [*SKY, message("assistant", "Green.")]},
        ("preference-chat", (("user", "What color is the sky?"),), "Blue.", "Green."),
    ),
    # HuggingFaceH4/ultrafeedback_binarized: the prompt as text beside whole conversations, and `messages` too.
    "ultrafeedback": (
        {
            "prompt": "What color is the sky?",
            "prompt_id": "0a1b",
            "chosen": [*SKY, message("assistant", "Blue.")],
            "rejected": [*SKY, message("assistant", "Green.")],
            "messages": [*SKY, message("assistant", "Blue.")],
            "score_chosen": 8.0,
            "score_rejected": 3.5,
        },
        ("preference-chat", (("user", "What color is the sky?"),), "Blue.", "Green."),
    ),
}


def read_as(record):
    """(format, prompt, chosen, rejected) of a record as read: a conversational prompt as its turns."""
    fmt = formats.detect_format(record)
    read = formats._record(record, "x.jsonl:1", fmt)
    prompt = read.turns[:-1] if read.turns else read.instruction
    return fmt, prompt, read.response, read.rejected


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_form_reads_to_its_prompt_chosen_and_rejected(tmp_path, form):
    record, expected = FORMS[form]
    path = write(tmp_path / "pairs.jsonl", [record, record])
    records, found = formats.read(str(path))
    assert found == expected[0]
    assert read_as(record) == expected
    assert [r.is_pair for r in records] == [True, True]
    assert records[1].where == f"{path}:2"


def test_a_conversational_prompt_keeps_its_system_turn_and_earlier_turns():
    prompt = [message("system", "Be brief."), *SKY, message("assistant", "Blue."), message("user", "And grass?")]
    record = {"prompt": prompt, "chosen": [message("assistant", "Green.")], "rejected": [message("model", "Red.")]}
    turns = (("user", "Be brief.\n\nWhat color is the sky?"), ("assistant", "Blue."), ("user", "And grass?"))
    assert read_as(record) == ("preference-chat", turns, "Green.", "Red.")


def test_parquet_and_csv_read_as_json_lines_do(tmp_path):
    grass = [message("user", "And grass?")]
    second = {"prompt": "And grass?", "chosen": [*grass, message("assistant", "Green.")],
              "rejected": [*grass, message("assistant", "Red.")]}  # fmt: skip
    conversational = [{k: FORMS["ultrafeedback"][0][k] for k in second}, second]
    from_parquet, found = formats.read(str(write(tmp_path / "p.parquet", conversational)))
    assert found == "preference-chat"
    assert from_parquet == formats.read(str(write(tmp_path / "p.jsonl", conversational)))[0]
    standard = [FORMS["standard"][0], {"prompt": "Grass is", "chosen": " green.", "rejected": " blue."}]
    from_csv, found = formats.read(str(write(tmp_path / "p.csv", standard)))
    assert found == "preference"
    assert from_csv == formats.read(str(write(tmp_path / "p.jsonl", standard)))[0]
    assert from_csv[1].where == f"{tmp_path / 'p.csv'}:3"


def test_hh_and_ultrafeedback_read_from_the_hub_as_they_come(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from finetune.platform import platforms

    monkeypatch.setattr(platforms, "reachable", lambda *a, **k: True)
    hub = {"Anthropic/hh-rlhf": [FORMS["hh"][0]], "HuggingFaceH4/ultrafeedback_binarized": [FORMS["ultrafeedback"][0]]}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: hub[name])
    (hh,), found = formats.read("hf:Anthropic/hh-rlhf")
    assert found == "preference" and (hh.instruction, hh.rejected) == (HH, " It is green.")
    (uf,), found = formats.read("hf:HuggingFaceH4/ultrafeedback_binarized", "train_prefs")
    assert found == "preference-chat" and (uf.response, uf.rejected) == ("Blue.", "Green.")
    assert uf.where == "hf:HuggingFaceH4/ultrafeedback_binarized (train_prefs) row 0"
    # A resume refuses pairs whose rejected answer changed.
    assert formats.fingerprint([hh]) != formats.fingerprint([formats.Record(HH, " It is blue.", rejected=" Red.")])


def test_the_implicit_prompt_is_trls():
    data_utils = pytest.importorskip("trl.data_utils")
    texts = [
        ("The sky is blue.", "The sky is green."),
        ("Sky: blue", "Sky:green"),  # no space before the difference
        ("abc", "abcd"),  # one begins the other
        ("Blue.", "Green."),  # nothing shared
        ("\n\nHuman: Hi\n\nAssistant: Hello!", "\n\nHuman: Hi\n\nAssistant: Go."),
    ]
    for chosen, rejected in texts:
        trl = data_utils.maybe_extract_prompt({"chosen": chosen, "rejected": rejected})
        assert formats.implicit_prompt(chosen, rejected) == (trl["prompt"], trl["chosen"], trl["rejected"])
    sides = [[*SKY, message("assistant", answer)] for answer in ("Blue.", "Green.")]
    trl = data_utils.maybe_extract_prompt(
        {"prompt": "What color is the sky?", "chosen": sides[0], "rejected": sides[1]}
    )
    assert read_as({"prompt": "What color is the sky?", "chosen": sides[0], "rejected": sides[1]}) == (
        "preference-chat",
        tuple((m["role"], m["content"]) for m in trl["prompt"]),
        trl["chosen"][0]["content"],
        trl["rejected"][0]["content"],
    )


GOOD = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
BAD = {
    "no-rejected": ({"prompt": "The sky is", "chosen": " blue."}, "record has no 'rejected' field"),
    "no-chosen": ({"prompt": "The sky is", "rejected": " blue."}, "record has no 'chosen' field"),
    "empty-chosen": ({**GOOD, "chosen": " "}, "field 'chosen' is empty"),
    "empty-rejected": ({**GOOD, "rejected": ""}, "field 'rejected' is empty"),
    "identical": ({**GOOD, "rejected": " blue."}, "chosen and rejected are the same answer"),
    "identical-implicit": ({"chosen": "Sky: blue.", "rejected": "Sky: blue."}, "chosen and rejected are the same"),
    "prompt-as-messages": ({**GOOD, "prompt": SKY}, "the prompt is a list of messages but chosen and rejected"),
    "sft-record-after-pairs": ({"prompt": "The sky is", "completion": " blue."}, "an SFT record, with no chosen"),
}
CHAT_GOOD = {"prompt": SKY, "chosen": [message("assistant", "Blue.")], "rejected": [message("assistant", "Green.")]}
BAD_CHAT = {
    "answer-by-the-user": ({**CHAT_GOOD, "rejected": [message("user", "Green.")]}, "one assistant message"),
    "two-answers": ({**CHAT_GOOD, "chosen": [message("assistant", "a"), message("assistant", "b")]}, "is 2 message"),
    "prompt-ends-with-assistant": (
        {**CHAT_GOOD, "prompt": [*SKY, message("assistant", "Blue.")]},
        "turns must alternate, user first",
    ),
    "unknown-role": ({**CHAT_GOOD, "prompt": [message("narrator", "Once")]}, "message 1 has role 'narrator'"),
    "differ-before-the-answer": (
        {
            "chosen": [*SKY, message("assistant", "Blue.")],
            "rejected": [message("user", "Sky?"), message("assistant", "x")],
        },
        "after the prompt, `chosen` must be one assistant message",
    ),
    "empty-answer": ({**CHAT_GOOD, "rejected": [message("assistant", " ")]}, "the rejected answer is empty"),
    "answer-as-text": ({**CHAT_GOOD, "rejected": "Green."}, "`rejected` must be a non-empty list of {role, content}"),
}


@pytest.mark.parametrize("case", sorted(BAD) + sorted(BAD_CHAT))
def test_a_bad_pair_exits_2_naming_its_line(tmp_path, case):
    bad, says = BAD.get(case) or BAD_CHAT[case]
    good = GOOD if case in BAD else CHAT_GOOD
    path = write(tmp_path / "bad.jsonl", [good, bad])
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny"])
    assert result.exit_code == 2, result.output
    assert f"{path}:2: " in result.output and says in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_a_pair_in_a_file_of_sft_records_names_its_line(tmp_path):
    path = write(tmp_path / "mixed.jsonl", [{"prompt": "1 plus 1 is", "completion": " 2."}, GOOD])
    with pytest.raises(
        UserError, match=r"mixed.jsonl:2: a preference pair \(chosen, rejected\) in a file of completion"
    ):
        formats.read(str(path))


@pytest.fixture(scope="module")
def tokenizer():
    return presets.tiny_tokenizer()


def ids(tokenizer, text):
    return batching.leading_ids(tokenizer, [text], 10_000)[0]


def test_chosen_and_rejected_share_their_prompt_ids_and_weigh_only_the_answer(tokenizer):
    multi_turn = {**CHAT_GOOD, "prompt": [*SKY, message("assistant", "Blue."), message("user", "And grass?")]}
    for record, template in ((GOOD, "none"), (GOOD, "dolly"), (multi_turn, "gemma-chat")):
        read = formats._record(record, "x:1", formats.detect_format(record))
        [pair], cut = pairs.pairs([read], templates.get(template), tokenizer, 128)
        assert cut == 0
        n = pair.prompt_length
        assert pair.chosen.token_ids[:n] == pair.rejected.token_ids[:n]
        assert pair.chosen.token_ids[n:] != pair.rejected.token_ids[n:]
        for side in (pair.chosen, pair.rejected):
            assert side.weights == [0.0] * n + [1.0] * (len(side.token_ids) - n)
            assert side.token_ids[0] == batching.BOS and side.token_ids[-1] == batching.EOS
        # The chosen side is what SFT makes of the same record, with the loss on the last answer alone.
        [sft], _ = batching.tokenize([templates.get(template).segments(read)], tokenizer, 128)
        assert pair.chosen.token_ids == sft.token_ids


def test_a_long_prompt_is_cut_from_its_left_and_both_sides_keep_the_same_cut(tokenizer):
    prompt = " ".join(f"word{i}" for i in range(12))
    whole, answer = ids(tokenizer, prompt), ids(tokenizer, " yes it is")
    seq_len = len(whole) + 4  # the prompt fits alone, not with the answer
    long = formats.Record(instruction=prompt, response=" yes it is", rejected=" no", where="p.jsonl:1")
    short = formats.Record(instruction="Hi", response=" yes", rejected=" no", where="p.jsonl:2")
    made, cut = pairs.pairs([long, short], templates.get("none"), tokenizer, seq_len)
    assert cut == 1
    pair = made[0]
    kept = pair.chosen.token_ids[1 : pair.prompt_length]
    assert kept == whole[len(whole) - len(kept) :] and len(kept) < len(whole)
    assert pair.chosen.token_ids[pair.prompt_length :] == [*answer, batching.EOS]  # the answers whole
    assert pair.rejected.token_ids[: pair.prompt_length] == pair.chosen.token_ids[: pair.prompt_length]
    assert len(pair.chosen.token_ids) == seq_len + 1
    assert made[1].chosen.token_ids == [batching.BOS, *ids(tokenizer, "Hi"), *ids(tokenizer, " yes"), batching.EOS]


def test_a_prompt_longer_than_seq_len_is_cut_to_half_the_sequence_and_keeps_its_answers(tokenizer):
    """A prompt that alone fills --seq-len was a UserError that stopped the whole run; it is cut as any long prompt
    is: from its left, to half the sequence, then the answers at their end."""
    prompt = " ".join(f"word{i}" for i in range(80))
    whole = ids(tokenizer, prompt)
    assert len(whole) > 32
    record = formats.Record(instruction=prompt, response=" yes " * 30, rejected=" no", where="p.jsonl:7")
    [pair], cut = pairs.pairs([record], templates.get("none"), tokenizer, 32)
    assert cut == 1 and pair.prompt_length == 1 + 31 // 2
    assert pair.chosen.token_ids[1 : pair.prompt_length] == whole[-(31 // 2) :]
    assert pair.rejected.token_ids[: pair.prompt_length] == pair.chosen.token_ids[: pair.prompt_length]
    assert len(pair.chosen.token_ids) == 33 and pair.rejected.token_ids[-1] == batching.EOS
    for side in (pair.chosen, pair.rejected):
        assert sum(side.weights[1:]) >= 1  # an answer token to compare


@pytest.mark.parametrize("template", ["none", "gemma-chat"])
def test_a_prompt_of_many_thousand_characters_keeps_its_end(tokenizer, template):
    """Tokenizing is cut short for a very long text (batching.leading_ids: 32 characters an id kept); a prompt is
    cut from its left, so it keeps its end: the question, and a chat's turn header before the answer. It kept a
    slice from its middle, cut mid-word, where the prompt ran past 32 x (seq_len + 1) characters."""
    question = "\n\nQUESTION: what colour is the sky?"
    prompt = "Background: " + " ".join(f"word{i}" for i in range(1500)) + question
    record = formats.Record(instruction=prompt, response=" Blue.", rejected=" Green.", where="p.jsonl:1")
    if template == "gemma-chat":
        record = formats.Record(prompt, " Blue.", turns=(("user", prompt), ("assistant", " Blue.")), rejected=" Green.",
                                where="p.jsonl:1")  # fmt: skip
    renderer = templates.get(template)
    for seq_len in (64, 256):
        assert len(prompt) > 32 * (seq_len + 1)
        [pair], cut = pairs.pairs([record], renderer, tokenizer, seq_len)
        assert cut == 1 and pair.prompt_cut
        whole = [i for text, _ in templates.pair_segments(renderer, record)[0][:-1] for i in ids(tokenizer, text)]
        kept = pair.chosen.token_ids[1 : pair.prompt_length]
        assert kept == whole[-len(kept) :], seq_len  # the prompt's own last ids
        assert pair.chosen.token_ids[0] == batching.BOS


def test_finetune_data_reports_pairs_tokens_cuts_and_an_example(tmp_path):
    rows = [FORMS["hh"][0], {"chosen": f"{HH} " + "very " * 30 + "blue.", "rejected": f"{HH} Green."}]
    path = write(tmp_path / "hh.jsonl", rows)
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny", "--seq-len", "64"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "format: preference (chosen, rejected, and prompt or none, as text), 2 pairs" in lines
    assert "template: none (auto, for this format)" in lines
    assert [line.split(":")[0] for line in lines if line.startswith("  ") and "median" in line] == [
        "  prompt",
        "  chosen",
        "  rejected",
    ]
    assert (
        "seq-len 64: 1 of 2 pairs are cut (the prompt from its left, keeping at least half the sequence, then the "
        "answers at their end), none skipped"
    ) in lines
    assert lines[-4:] == ["  chosen:", "    « It is blue.<eos>»", "  rejected:", "    « It is green.<eos>»"]


def test_pairs_the_cut_leaves_alike_are_counted_as_skipped_by_the_run_and_by_finetune_data(tmp_path, capsys):
    """Two pairs whose answers differ only past --seq-len: the run skips them and says so, and neither it nor
    `finetune data` says "none skipped" (both did, beside the note that they were skipped)."""
    from types import SimpleNamespace

    from finetune.methods import preference

    late = [{"prompt": f"Q{i}", "chosen": " " + "same words " * 80 + "GOOD", "rejected": " " + "same words " * 80 + "BAD"}
            for i in range(2)]  # fmt: skip
    rows = late + [{"prompt": f"P{i}", "chosen": " yes", "rejected": " no"} for i in range(8)]
    path = write(tmp_path / "late.jsonl", rows)
    records, _ = formats.read(str(path))
    cfg = SimpleNamespace(model=SimpleNamespace(seq_len=64, preset="tiny"))
    kept = preference.pair_examples(records, templates.get("none"), presets.tiny_tokenizer(), cfg, "late.jsonl")
    said = capsys.readouterr().out
    assert len(kept) == 8 and "note: 2 pairs skipped: cut to --seq-len 64" in said, said
    assert "pairs cut to" not in said and "none skipped" not in said  # the only cut pairs were skipped
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny", "--seq-len", "64"])
    assert result.exit_code == 0, result.output
    assert "seq-len 64: 2 of 10 pairs are cut" in result.output and "2 of them skipped" in result.output
    assert "none skipped" not in result.output


def test_finetune_data_counts_a_prompt_over_seq_len_as_cut(tmp_path):
    """`finetune data` exited 2 on a prompt that alone fills --seq-len; it reports it among the cut pairs."""
    rows = [GOOD, {**GOOD, "prompt": "The sky, " * 40 + "is"}]
    path = write(tmp_path / "long.jsonl", rows)
    command = Path(sys.executable).with_name("finetune")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run(
        [str(command), "data", str(path), "--preset", "tiny", "--seq-len", "32"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "seq-len 32: 1 of 2 pairs are cut" in done.stdout and "none skipped" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.jsonl"]
