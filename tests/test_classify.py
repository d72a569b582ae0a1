"""--method classify end to end (methods/classify.py, model/classify_view.py): a classifier learns a hidden labelled
task from the command line in a fresh process on every backend, `finetune eval` and `finetune predict` read it back,
its macro F1 is sklearn's, its head reads the last token as transformers' GemmaForSequenceClassification does;
the refusals.

The task is learnable by the tiny model: a record's label is decided by one word placed among three random ones
("good": positive, "bad": negative).
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BACKEND, invoke, write_jsonl

from finetune.methods import classify

WORDS = ["apple", "river", "stone", "cloud", "green", "music", "paper", "light", "table", "glass"]


def labelled(n=192, seed=0, labels=("negative", "positive")):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.choice(labels)
        words = [rng.choice(WORDS) for _ in range(3)]
        words.insert(rng.randint(0, 3), "good" if label == "positive" else "bad")
        out.append({"text": " ".join(words), "label": label})
    return out


@pytest.fixture(scope="module")
def classify_run(tmp_path_factory):
    """`finetune gemma --method classify` as typed, in a fresh process: float32, 30 steps of 8 records, packed,
    a quarter of the 192 records held out."""
    root = tmp_path_factory.mktemp("classify")
    data = write_jsonl(root / "labelled.jsonl", labelled())
    out = root / "run"
    args = [sys.executable, "-m", "finetune", "gemma", "--preset", "tiny", "--backend", BACKEND, "--precision",
            "float32", "--method", "classify", "--data", str(data), "--seq-len", "32", "--batch-size", "8",
            "--max-steps", "30", "--lr", "1e-2", "--eval-fraction", "0.25", "--output", str(out)]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    return out, data, json.loads((out / "metrics.json").read_text()), done.stdout


def test_a_classifier_learns_a_labelled_task_from_the_command_line(classify_run):
    """Held-out accuracy and macro F1 near chance before training, above 0.8 after; the classes recorded in the
    run; the head beside the adapter."""
    out, _, metrics, stdout = classify_run
    assert metrics["method"] == "classify" and metrics["labels"] == ["negative", "positive"]
    assert metrics["eval_examples"] == 48
    assert metrics["eval_accuracy"] > 0.8 and metrics["eval_accuracy"] > metrics["eval_accuracy_before"] + 0.2
    assert metrics["eval_macro_f1"] > 0.8 and metrics["eval_loss"] < metrics["eval_loss_before"]
    assert "eval macro f1" in stdout
    assert (out / classify.HEAD).is_file()
    assert "None: a classifier run writes no text." in (out / "samples.md").read_text()  # not a bare header
    assert "- negative\n" in (out / "config.yaml").read_text()


def test_eval_and_predict_read_the_run_back(classify_run, tmp_path):
    """`finetune eval` reports the run's own held-out metrics; `finetune predict` writes each record's label and
    probabilities in order, the data file untouched, and gets most of them right."""
    out, data, metrics, _ = classify_run
    before = data.read_bytes()
    result = invoke("eval", "--run", out, "--backend", BACKEND)
    assert result.exit_code == 0, result.output
    assert f"eval_accuracy {metrics['eval_accuracy']:.4f}" in result.output and "examples 48" in result.output
    target = tmp_path / "predicted.jsonl"
    result = invoke("predict", "--run", out, "--data", data, "--output", target, "--backend", BACKEND)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    records = [json.loads(line) for line in before.decode().splitlines()]
    assert len(lines) == len(records) and data.read_bytes() == before
    assert [line["label"] for line in lines] == [r["label"] for r in records]
    assert all(abs(sum(line["probabilities"].values()) - 1) < 1e-6 for line in lines)
    assert np.mean([line["predicted"] == line["label"] for line in lines]) > 0.8
    # Records to label need none: a null label is none, as a missing one is.
    unlabelled = tmp_path / "unlabelled.jsonl"
    unlabelled.write_text("".join(json.dumps({**r, "label": None}) + "\n" for r in records[:2]))
    result = invoke("predict", "--run", out, "--data", unlabelled, "--output", tmp_path / "u.jsonl", "--backend",
                    BACKEND)  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    assert len((tmp_path / "u.jsonl").read_text().splitlines()) == 2


@pytest.mark.one_backend
def test_labels_sort_as_whole_numbers_only_where_they_are_ascii_digits():
    """'²' is a digit to str.isdigit() and no number to int(): it sorts as text (the run once exited 1 on it)."""
    assert sorted(["x", "²", "10", "-2", "9"], key=classify._order) == ["-2", "9", "10", "x", "²"]


@pytest.mark.one_backend
def test_a_whole_number_label_written_as_a_float_is_its_number():
    """pandas writes an integer column with a gap as floats: 1.0 is class 1, as CSV's "1" and JSON's 1 are; 1.5,
    NaN and true are no class."""
    assert [classify.label_text(v) for v in (1.0, 1, "1", -2.0, "pos")] == ["1", "1", "1", "-2", "pos"]
    assert [classify.label_text(v) for v in (1.5, float("nan"), True, "", None, [1])] == [None] * 6


@pytest.mark.backend_neutral
def test_refusals(tmp_path):
    """Exit 2, a short message and no run directory: a record without a label, one class, an --eval-data label the
    training data lacks, --labels on another method, predict over its own data and with an SFT run."""
    good = write_jsonl(tmp_path / "good.jsonl", labelled(16))
    unlabelled = write_jsonl(tmp_path / "unlabelled.jsonl", labelled(8) + [{"text": "no label here"}])
    single = write_jsonl(tmp_path / "single.jsonl", labelled(8, labels=("positive",)))
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": "so so", "label": "neutral"}])
    first = next(line for line, r in enumerate(labelled(16), start=1) if r["label"] == "negative")
    cases = {
        "unlabelled.jsonl:9: a record without a `label`": ["--data", unlabelled],  # its line, as a null label's
        "at least 2 labels": ["--data", single],
        "label 'neutral' is not one": ["--data", good, "--eval-data", other, "--eval-fraction", "0"],
        "--labels names a classifier": ["--data", good, "--method", "sft", "--labels", "a"],
        f"good.jsonl:{first}: label 'negative' is not one of --labels": [
            "--data",
            good,
            "--labels",
            "positive",
            "--labels",
            "x",
        ],
    }
    for message, flags in cases.items():
        out = tmp_path / "run"
        result = invoke("gemma", "--preset", "tiny", "--backend", BACKEND, "--method", "classify", "--seq-len",
                        "32", "--max-steps", "1", "--output", out, *flags)  # fmt: skip
        assert result.exit_code == 2 and message in result.output, (message, result.output)
        assert not out.exists()
    result = invoke("predict", "--run", tmp_path / "none", "--data", good, "--output", good)
    assert result.exit_code == 2 and "does not exist" in result.output


def test_predict_writes_over_no_file_of_the_run_nor_another_without_overwrite(classify_run, tmp_path):
    """--output in the run's directory (its config.yaml) is refused even with --overwrite; an existing file needs
    --overwrite; a directory that cannot be written is exit 2 before the model loads. Nothing is touched."""
    out, data, _, _ = classify_run
    config = (out / "config.yaml").read_bytes()
    kept = tmp_path / "kept.jsonl"
    kept.write_text("mine\n")
    for target, extra, said in ((out / "config.yaml", ["--overwrite"], "is in the run's directory"),
                                (kept, [], "exists; pass --overwrite"),
                                (Path("/proc/predicted.jsonl"), [], "give --output a path you can write")):  # fmt: skip
        result = invoke("predict", "--run", out, "--data", data, "--output", target, *extra)
        assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output
    assert (out / "config.yaml").read_bytes() == config and kept.read_text() == "mine\n"
    result = invoke("eval", "--run", out, "--generate", "2")
    assert result.exit_code == 2 and "`finetune eval --generate` is refused" in result.output, result.output
    result = invoke("predict", "--run", out, "--data", data, "--output", kept, "--overwrite", "--backend", BACKEND)
    assert result.exit_code == 0 and kept.read_text().count("\n") == len(data.read_text().splitlines())


@pytest.mark.backend_neutral
def test_macro_f1():
    """macro_f1 by hand (F1 0.5, 0.8 and 0 of a class labelled once and never predicted; a class neither labelled
    nor predicted is left out), and against sklearn's f1_score(average="macro", zero_division=0) where sklearn is
    installed."""
    assert classify.macro_f1(np.array([0, 0, 1, 1, 2]), np.array([0, 1, 1, 1, 0])) == pytest.approx(1.3 / 3)
    assert classify.macro_f1(np.array([1, 1]), np.array([1, 1])) == 1.0  # of 3 classes, one held out
    try:
        from sklearn.metrics import f1_score
    except ImportError:
        return
    rng = np.random.default_rng(0)
    for classes in (2, 3, 5):
        labels, predicted = rng.integers(0, classes, 40), rng.integers(0, classes - 1, 40)
        expected = f1_score(labels, predicted, average="macro", zero_division=0)
        assert classify.macro_f1(labels, predicted) == pytest.approx(expected)


@pytest.mark.backend_neutral
def test_the_resolved_run_says_who_chose_the_classes(tmp_path):
    """The training data's labels, sorted, or --labels as given: the table of decisions says which."""
    from finetune import config
    from finetune.data import formats
    from finetune.training import resolve, train

    data = write_jsonl(tmp_path / "labelled.jsonl", labelled(12))
    for given, order, why in (([], ["negative", "positive"], "the training data's, sorted"),
                              (["positive", "negative", "neutral"], ["positive", "negative", "neutral"], "set")):  # fmt: skip
        cfg = config.load(None, {"model.preset": "tiny", "data.path": str(data), "train.method": "classify",
                                 "train.labels": given})  # fmt: skip
        records, found = formats.read(str(data))
        decided = resolve.resolve(cfg, found, data=train.Data(records, found, ""))
        assert decided.config.train.labels == order and decided.decisions["labels"].why == why


@pytest.mark.skipif(BACKEND != "torch", reason="transformers and PEFT are checked in the PyTorch suite")
def test_the_hf_export_is_transformers_sequence_classifier_with_the_run_s_probabilities(classify_run, tmp_path):
    """`finetune export --format hf` of a classifier: transformers' GemmaForSequenceClassification, its labels
    named, giving `finetune predict`'s probabilities on right-padded rows; --format lora carries the head's file;
    the formats without a head are refused, nothing written."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out, data, _, _ = classify_run
    exported = tmp_path / "hf"
    result = invoke("export", "--run", out, "--format", "hf", "--output", exported, "--backend", BACKEND)
    assert result.exit_code == 0, result.output
    model = transformers.AutoModelForSequenceClassification.from_pretrained(exported, dtype=torch.float32)
    assert type(model).__name__ == "GemmaForSequenceClassification"
    assert model.config.id2label == {0: "negative", 1: "positive"}
    predicted = tmp_path / "predicted.jsonl"
    assert invoke("predict", "--run", out, "--data", data, "--output", predicted, "--backend", BACKEND).exit_code == 0
    ours = [json.loads(line)["probabilities"] for line in predicted.read_text().splitlines()[:6]]
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()[:6]]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    assert tokenizer.padding_side == "right" and (batch["attention_mask"] == 0).any()  # rows of several lengths
    with torch.no_grad():
        theirs = torch.softmax(model(**batch).logits, -1).numpy()
    np.testing.assert_allclose(theirs, [[p["negative"], p["positive"]] for p in ours], atol=1e-5)
    lora = tmp_path / "lora"
    assert invoke("export", "--run", out, "--format", "lora", "--output", lora).exit_code == 0
    assert (lora / classify.HEAD).read_bytes() == (out / classify.HEAD).read_bytes()
    for fmt in ("merged", "peft", "gguf"):
        result = invoke("export", "--run", out, "--format", fmt, "--output", tmp_path / fmt)
        assert result.exit_code == 2 and "--format hf or lora" in result.output, result.output
        assert not (tmp_path / fmt).exists()


@pytest.mark.backend_neutral  # the rows' layout is numpy's (prepare.Media, as SFT's); every suite trains pictures
def test_a_classifier_reads_its_records_pictures(tmp_path):
    """A picture's record is classified from the picture: red and blue squares under the same text and labels
    train apart (they were refused); `finetune predict` reads a record's picture too."""
    import csv

    from PIL import Image

    runs = []
    for colour in ("red", "blue"):
        Image.new("RGB", (8, 8), colour).save(tmp_path / f"{colour}.png")
        rows = [{"text": "<image>What colour is it?", "label": ["warm", "cold"][i % 2], "images": [f"{colour}.png"]}
                for i in range(8)]  # fmt: skip
        data = write_jsonl(tmp_path / f"{colour}.jsonl", rows)
        out = tmp_path / colour
        result = invoke("gemma", "--preset", "tiny-gemma3-vision", "--backend", BACKEND, "--method", "classify",
                        "--data", data, "--batch-size", "2", "--max-steps", "2", "--precision", "float32", "--output",
                        out)  # fmt: skip
        assert result.exit_code == 0, result.output
        with (out / "history.csv").open() as f:
            runs.append([float(r["grad_norm"]) for r in csv.DictReader(f) if r["train_loss"]])
    assert len(runs[0]) == 2 and np.isfinite(runs[0] + runs[1]).all() and runs[0] != runs[1]
    predicted = tmp_path / "predicted.jsonl"
    result = invoke("predict", "--run", tmp_path / "blue", "--data", tmp_path / "red.jsonl", "--output", predicted)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in predicted.read_text().splitlines()]
    assert len(lines) == 8 and set(lines[0]["probabilities"]) == {"warm", "cold"}


@pytest.mark.backend_neutral  # the check is numpy on the head's file
@pytest.mark.parametrize("broken", ["shape", "bytes"])
def test_export_checks_the_head_as_eval_does_and_writes_nothing(broken, classify_run, tmp_path):
    """A head of another shape than the run's classes (it wrote transformers' id2label beside a score of 5 rows),
    or a file that is no head (it was copied as is), is exit 2 before anything is written."""
    import shutil

    out, _, _, _ = classify_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    hidden = np.load(out / classify.HEAD)["kernel"].shape[0]
    if broken == "shape":
        np.savez(run / classify.HEAD, kernel=np.zeros((hidden, 5), np.float32))
    else:
        (run / classify.HEAD).write_bytes(b"not a head")
    for fmt in ("lora", "hf"):
        result = invoke("export", "--run", run, "--format", fmt, "--output", tmp_path / fmt)
        said = "holds a head of shape (" if broken == "shape" else "is not a readable score head"
        assert result.exit_code == 2 and said in result.output, result.output
        assert not (tmp_path / fmt).exists()
