"""End to end on this process' backend: train, write every output, reopen the adapter."""

import csv
import json

import pytest
import yaml
from conftest import BACKEND, SHARED_DOLLY
from typer.testing import CliRunner

from finetune import model, presets
from finetune.cli import app

runner = CliRunner()
RUN_FILES = {"config.yaml", "adapter.lora.h5", "metrics.json", "history.csv", "samples.md", "loss.png"}
METRIC_KEYS = {
    "backend",
    "preset",
    "rank",
    "train_loss",
    "eval_loss_before",
    "eval_loss",
    "eval_perplexity",
    "eval_accuracy",
    "trained_tokens",
    "tokens_per_second",
    "seconds",
    "peak_memory_mb",
}


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + (result.stderr or "")
    return result


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "two-steps"
    result = invoke(
        "gemma",
        "--preset",
        "tiny",
        "--backend",
        BACKEND,
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--max-steps",
        "2",
        "--rank",
        "2",
        "--alpha",
        "4",
        "--set",
        "train.samples=2",
        "--set",
        "train.max_new_tokens=4",
        "--output",
        out,
    )
    return out, result.output


def test_a_two_step_run_writes_every_output(two_step_run):
    out, printed = two_step_run
    assert {p.name for p in out.iterdir()} == RUN_FILES
    metrics = json.loads((out / "metrics.json").read_text())
    assert METRIC_KEYS <= set(metrics)
    assert metrics["backend"] == BACKEND and metrics["steps"] == 2 and metrics["rank"] == 2
    assert metrics["trained_tokens"] > 0 and metrics["response_tokens"] <= metrics["trained_tokens"]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["lora"]["alpha"] == 4.0 and config["train"]["batch_size"] == 2
    assert config["resolved"]["backend_tweaks"]["KERAS_BACKEND"] == BACKEND
    assert config["resolved"]["backend_tweaks"]["dtype_policy"] == "float32"  # CPU
    rows = list(csv.DictReader((out / "history.csv").open()))
    assert [r["step"] for r in rows if r["train_loss"]] == ["1", "2"]
    assert float(rows[-1]["eval_loss"]) == pytest.approx(metrics["eval_loss"])
    assert (out / "samples.md").read_text().count("**After training**") == 2
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "eval loss" in printed and "->" in printed  # the summary table


def test_backend_tweaks_are_recorded(two_step_run):
    tweaks = yaml.safe_load((two_step_run[0] / "config.yaml").read_text())["resolved"]["backend_tweaks"]
    expected = {
        "jax": "XLA_PYTHON_CLIENT_MEM_FRACTION",
        "torch": "torch.float32_matmul_precision",
        "tensorflow": "tensorflow.tensor_float_32",
    }[BACKEND]
    assert expected in tweaks


def test_eval_command_reproduces_the_run_s_eval_loss(two_step_run):
    out, _ = two_step_run
    metrics = json.loads((out / "metrics.json").read_text())
    result = invoke("eval", "--run", out)
    reported = float(result.output.split("eval_loss ")[1].split()[0])
    assert reported == pytest.approx(metrics["eval_loss"], abs=1e-3)


def test_generate_command(two_step_run):
    result = invoke("generate", "--run", two_step_run[0], "--prompt", "What is 2 plus 2?", "--max-new-tokens", "3")
    assert result.exit_code == 0


def test_overwrite_replaces_a_run(two_step_run, tmp_path):
    out = tmp_path / "again"
    args = [
        "gemma",
        "--preset",
        "tiny",
        "--backend",
        BACKEND,
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--max-steps",
        "1",
        "--set",
        "train.samples=0",
        "--output",
        out,
    ]
    invoke(*args)
    (out / "notes.txt").write_text("mine")
    invoke(*args, "--overwrite", "--seed", "3")
    assert json.loads((out / "metrics.json").read_text())["steps"] == 1
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"] == 3
    assert (out / "notes.txt").read_text() == "mine"  # the user's own files stay


def test_training_from_a_local_preset_directory(tmp_path):
    lm, preprocessor = model.build(presets.Source("tiny", "tiny", "gemma"), seq_len=64)
    lm.preprocessor = preprocessor
    lm.save_to_preset(str(tmp_path / "preset"))
    out = tmp_path / "run"
    invoke(
        "gemma",
        "--preset",
        tmp_path / "preset",
        "--backend",
        BACKEND,
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--max-steps",
        "2",
        "--set",
        "train.samples=0",
        "--output",
        out,
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["preset"] == str(tmp_path / "preset") and metrics["steps"] == 2
    assert yaml.safe_load((out / "config.yaml").read_text())["resolved"]["preset_kind"] == "local"


def test_default_tiny_run_lowers_the_held_out_loss(tmp_path):
    """The quickstart exactly as a user runs it (defaults), on this backend."""
    out = tmp_path / "quickstart"
    invoke("gemma", "--preset", "tiny", "--backend", BACKEND, "--output", out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_loss"] < metrics["eval_loss_before"] - 0.5
    assert metrics["eval_accuracy"] > metrics["eval_accuracy_before"]


@pytest.mark.skipif(not SHARED_DOLLY.exists(), reason="../shared/data is not beside the checkout")
def test_real_dolly_records_train(tmp_path):
    out = tmp_path / "dolly"
    invoke(
        "gemma",
        "--preset",
        "tiny",
        "--backend",
        BACKEND,
        "--data",
        SHARED_DOLLY,
        "--max-steps",
        "3",
        "--set",
        "train.samples=1",
        "--set",
        "train.max_new_tokens=4",
        "--output",
        out,
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_examples"] + metrics["eval_examples"] <= 151 and metrics["steps"] == 3


def test_batch_size_auto_picks_a_size_and_leaves_the_model_untouched(tmp_path):
    out = tmp_path / "auto"
    args = [
        "gemma",
        "--preset",
        "tiny",
        "--backend",
        BACKEND,
        "--seq-len",
        "32",
        "--max-records",
        "40",
        "--max-steps",
        "1",
        "--set",
        "train.samples=0",
    ]
    invoke(*args, "--batch-size", "auto", "--output", out)
    auto = json.loads((out / "metrics.json").read_text())
    # On a CPU nothing runs out of memory, so the doubling probe reaches its cap.
    cap = min(64, (auto["train_examples"] + auto["eval_examples"]) // 2)
    assert auto["batch_size"] <= cap < 2 * auto["batch_size"]
    invoke(*args, "--batch-size", auto["batch_size"], "--output", tmp_path / "fixed")
    fixed = json.loads((tmp_path / "fixed" / "metrics.json").read_text())
    # The probe's trial steps were undone: same start, same one step, same result.
    assert auto["eval_loss_before"] == pytest.approx(fixed["eval_loss_before"], rel=1e-6)
    assert auto["eval_loss"] == pytest.approx(fixed["eval_loss"], rel=1e-4)
