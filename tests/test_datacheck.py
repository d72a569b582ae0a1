"""`finetune data FILE` (datacheck.py): the format, the template, the tokens and packing, and an example with the
trained text marked.

How each format is read is test_data.py's; how each is rendered and weighted is test_templates.py's.
"""

import os
import re

import numpy as np
import pytest
from conftest import CHAT, completion, text, write
from typer.testing import CliRunner

from finetune.cli import app
from finetune.data import formats, templates
from finetune.tools import datacheck


def test_finetune_data_reports_the_format_tokens_packing_and_a_marked_example(tmp_path):
    path = write(tmp_path / "c.csv", [completion(i) for i in range(30)])
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny", "--seq-len", "64", "--example", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "format: completion (prompt, completion), 30 records" in lines
    assert "template: none (auto, for this format)" in lines
    assert any(line.startswith("tokens (tiny's tokenizer") for line in lines)
    assert any(line.startswith("packing at seq-len 64: 30 rows -> ") for line in lines)
    unpacked = next(line for line in lines if line.startswith("--packing off, batches of 8 cut to their longest"))
    shuffled, grouped = (int(share) for share in re.findall(r"(\d+)%", unpacked))
    assert grouped <= shuffled, unpacked
    assert lines[-1] == "  1 plus 1 is« 2.<eos>»"


def test_finetune_data_counts_a_classifier_s_labels_in_the_order_a_run_numbers_them(tmp_path):
    """Records with a `label` are what --method classify trains on: its classes (whole numbers as numbers), each
    one's records, and the records a classifier would refuse."""
    labels = [10, 2, "x", 2, None, True, 2]
    path = write(tmp_path / "l.jsonl", [{"text": f"record {i}", "label": label} for i, label in enumerate(labels)])
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny"])
    assert result.exit_code == 0, result.output
    assert ("labels (for --method classify): 3 classes: 2: 3, 10: 1, x: 1; 2 records without a usable label "
            "(text or a whole number)") in result.output.splitlines()  # fmt: skip
    one = write(tmp_path / "one.jsonl", [{"text": f"record {i}", "label": "a"} for i in range(3)])
    result = CliRunner().invoke(app, ["data", str(one), "--preset", "tiny"])
    assert "1 class: a: 3; a classifier needs records of at least 2 labels" in result.output
    plain = CliRunner().invoke(app, ["data", str(write(tmp_path / "t.jsonl", [text(i) for i in range(3)])),
                                     "--preset", "tiny"])  # fmt: skip
    assert "labels" not in plain.output
    floats = write(
        tmp_path / "f.jsonl", [{"text": f"record {i}", "label": label} for i, label in enumerate([1.5, True])]
    )
    result = CliRunner().invoke(app, ["data", str(floats), "--preset", "tiny"])
    assert "none of the 2 records has a usable label (text or a whole number)" in result.output


def test_finetune_data_reports_prompts_as_grpo_takes_them(tmp_path):
    """Prompts alone: no loss, packing or skipped records to report (it reported SFT's); their tokens and one."""
    path = write(tmp_path / "p.jsonl", [{"prompt": f"Tell me about {i}.", "answer": str(i)} for i in range(7)])
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny", "--example", "3"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "format: prompts (prompt alone, as text), 7 prompts" in lines and lines[-1] == "  Tell me about 2."
    assert any(line.startswith("prompt tokens (tiny's tokenizer, with <bos>): min ") for line in lines)
    assert not any(line.startswith(("loss on", "packing", "seq-len")) for line in lines), lines


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
    pieces = templates.get("gemma-chat").segments(formats._record(CHAT, "x", "chat"))
    rendered = datacheck.render(pieces)
    assert rendered.count("«") == 2 and rendered.endswith("«6.<end_of_turn><eos>»")
    assert datacheck.render([("a", False), ("b", True)], train_on_prompt=True) == "«ab<eos>»"


def test_finetune_data_reads_a_compressed_file(tmp_path):
    import gzip

    plain = write(tmp_path / "c.jsonl", [completion(i) for i in range(5)])
    packed = tmp_path / "c.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    result = CliRunner().invoke(app, ["data", str(packed), "--preset", "tiny", "--seq-len", "64"])
    assert result.exit_code == 0, result.output
    assert "format: completion (prompt, completion), 5 records" in result.output.splitlines()


@pytest.mark.backend_neutral  # the split is read by `datasets`; the tokens are counted as in the tests above
def test_finetune_data_reads_the_split_a_run_would(tmp_path, monkeypatch):
    from test_formats import dolly, hub_layout

    pytest.importorskip("datasets")
    for name, value in (("HF_DATASETS_CACHE", str(tmp_path / "cache")), ("HF_HUB_OFFLINE", "1"),
                        ("HF_DATASETS_OFFLINE", "1")):  # fmt: skip
        monkeypatch.setenv(name, value)
    folder = hub_layout(tmp_path / "set", {"main": {"train": [dolly(i) for i in range(4)], "test": [dolly(9)]}})
    command = ["data", f"hf:{folder}:main", "--preset", "tiny", "--seq-len", "64"]
    result = CliRunner().invoke(app, [*command, "--data-split", "test"])
    assert result.exit_code == 0, result.output
    assert ", 1 records" in result.output  # the test split's
    assert "What is 9 plus 10?" in result.output
    assert "4 records" in CliRunner().invoke(app, command).output  # train, as a run reads by default
    refused = CliRunner().invoke(app, [*command, "--data-split", "validation"])
    assert refused.exit_code == 2 and "choose one of train, test with --data-split" in refused.output


def test_records_longer_than_any_cap_are_counted_whole_and_the_example_says_where_the_sequence_cuts(tmp_path):
    """A record past 8,192 tokens was counted as 8,193, and one whose prompt alone was longer left out of the counts
    (while still counted as skipped); the example marked text a run would never train on."""
    from finetune.model import builder, presets

    records = [{"instruction": "What is 2+2?", "response": "4."},
               {"instruction": "Summarise.", "context": "word " * 4000, "response": "short"},
               {"instruction": "Summarise.", "context": "text " * 4000, "response": "short " * 40}]  # fmt: skip
    path = write(tmp_path / "long.jsonl", records)
    renderer, tokenizer = templates.get("dolly"), builder.load_tokenizer(presets.resolve("tiny"))
    read, _ = formats.read(str(path))
    whole = [1 + sum(len(tokenizer.tokenize(t)) for t, _ in renderer.segments(r)) + 1 for r in read]
    assert max(whole) > 8193
    report = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny", "--seq-len", "64", "--example", "3"])
    assert report.exit_code == 0, report.output
    lines = report.output.splitlines()
    assert f"max {max(whole):,}" in next(line for line in lines if line.startswith("tokens ("))
    assert (
        next(line for line in lines if line.startswith("loss on ")).split(" (")[0].endswith(f"of {sum(whole):,} tokens")
    )
    assert "seq-len 64: 2 records are cut at the end, 2 of them skipped" in report.output
    assert lines[-1] == (f"at --seq-len 64 this record is skipped: its prompt fills the sequence ({whole[2]:,} tokens "
                         "in all), so none of its marked text trains")  # fmt: skip
    short = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny", "--seq-len", "64", "--example", "1"])
    assert short.output.splitlines()[-1].endswith("»"), short.output  # nothing cut: no note
    dolly = write(tmp_path / "cut.jsonl", [{"instruction": "Say it.", "response": "word " * 100}])
    cut = CliRunner().invoke(app, ["data", str(dolly), "--preset", "tiny", "--seq-len", "32"])
    assert re.fullmatch(
        r"at --seq-len 32 this record is cut to 33 of its [\d,]+ tokens: the loss is on \d+ of its "
        r"[\d,]+ marked tokens, those before the cut",
        cut.output.splitlines()[-1],
    ), cut.output


def test_rows_that_fill_the_sequence_report_no_negative_padding(tmp_path):
    """Records longer than --seq-len fill every position: an example's tokens are one more than its positions (the
    targets shift by one), which the report counted as positions, and said "padding -1%"."""
    path = write(tmp_path / "long.jsonl", [{"prompt": f"Say {i}.", "completion": "word " * 200} for i in range(16)])
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny", "--seq-len", "32"])
    assert result.exit_code == 0, result.output
    unpacked = next(line for line in result.output.splitlines() if line.startswith("--packing off, batches of 8"))
    assert re.findall(r"padding (-?\d+)% of the positions computed, (-?\d+)%", unpacked) == [("0", "0")], unpacked


def test_computed_padding_counts_each_batch_cut_to_its_longest_row():
    """Rows of 16 and 48 tokens in batches of 2: a batch of two 48s or two 16s computes no padding, a mixed one 32
    positions of it. Grouping by length mixes fewer; full rows of 64 would hold half."""
    lengths = np.array([16, 48] * 8)
    grouped = datacheck.computed_padding(lengths, 2, 64, grouped=True)
    shuffled = datacheck.computed_padding(lengths, 2, 64, grouped=False)
    order = datacheck.batching.EpochRows(16, 2, 0)
    positions = sum(2 * lengths[order(step)].max() for step in range(8))
    assert shuffled == pytest.approx(1 - lengths.sum() / positions)
    assert 0 <= grouped < shuffled < 1 / 3 < 0.5


def test_an_unknown_keras_backend_is_refused_as_the_run_refuses_it(tmp_path, monkeypatch):
    """`finetune data` loads the tokenizer through keras, on KERAS_BACKEND: an unknown one was an exit 1."""
    path = write(tmp_path / "c.csv", [completion(i) for i in range(4)])
    monkeypatch.setenv("KERAS_BACKEND", "bogus")
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny"])
    assert result.exit_code == 2 and "unknown backend 'bogus' (from KERAS_BACKEND)" in result.output, result.output


def test_finetune_data_reports_prompts_with_pictures_as_grpo_takes_them(tmp_path):
    """GRPO's prompts with pictures are never cut (a longer one is refused), and their pictures are counted."""
    from test_images import square

    records = [{"prompt": "<image>What colour?", "images": [square(tmp_path / f"{i}.png")], "answer": "red"}
               for i in range(3)]  # fmt: skip
    path = write(tmp_path / "p.jsonl", records)
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny-gemma3-vision"])
    assert result.exit_code == 0, result.output
    assert "a prompt with pictures or clips is never cut: a longer one is refused" in result.output
    assert "images: 3 in 3 of 3 records" in result.output
    assert "each picture and clip as tiny-gemma3-vision's soft tokens" in result.output
    assert "the longest prompt with pictures or clips takes" in result.output and "p.jsonl:1)" in result.output


def test_finetune_data_reports_prompts_with_clips_as_grpo_takes_them(tmp_path):
    """GRPO's prompts with clips, as its pictures: never cut, and the longest named with its room."""
    from test_audio import clip

    records = [{"prompt": "<audio>What is this?", "audios": [clip(tmp_path / f"{i}.wav")]} for i in range(2)]
    path = write(tmp_path / "p.jsonl", [{"prompt": "Name a sound."}, *records])
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny-gemma4-audio"])
    assert result.exit_code == 0, result.output
    assert "a prompt with pictures or clips is never cut: a longer one is refused" in result.output
    assert "the longest prompt with pictures or clips takes" in result.output and "p.jsonl:2)" in result.output


def test_finetune_data_says_records_with_audio_train_unpacked(tmp_path):
    """Records with clips train unpacked, as pictures do: the line names audio (it said images)."""
    from test_audio import clip, llama_factory

    path = write(tmp_path / "s.jsonl", [llama_factory(clip(tmp_path / f"{i}.wav"), "tone") for i in range(2)])
    result = CliRunner().invoke(app, ["data", str(path), "--preset", "tiny-gemma4-audio"])
    assert result.exit_code == 0 and "packing: off for data with audio (" in result.output, result.output


@pytest.mark.one_backend  # a fresh process of its own
def test_finetune_data_into_a_reader_that_goes_away_exits_0_quietly(tmp_path):
    """`finetune data FILE | head -1`: the reader closes the pipe before the report is written; the command
    exits 0 with nothing on stderr, as a shell's own commands do (it exited 1 with a BrokenPipeError)."""
    import subprocess
    import sys
    from pathlib import Path

    command = Path(sys.executable).with_name("finetune")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    data = formats.SAMPLE_PATH
    with subprocess.Popen([str(command), "data", str(data), "--preset", "tiny"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, cwd=tmp_path, env=env) as done:  # fmt: skip
        done.stdout.close()  # before the command has started: its first line meets a closed pipe
        _, err = done.communicate(timeout=600)
    assert done.returncode == 0 and not err.strip(), err.decode()
