"""End to end on this process' backend: train (from every data format and container), write every output, reopen the
adapter."""

import csv
import json

import numpy as np
import pytest
import yaml
from conftest import (
    BACKEND,
    BUILDERS,
    CHAT,
    CONTAINERS,
    FLAT,
    SHARED_DOLLY,
    alpaca,
    chat,
    make_records,
    write,
    write_jsonl,
)
from typer.testing import CliRunner

from finetune.cli import app
from finetune.data import batching
from finetune.model import builder, presets
from finetune.platform import backend
from finetune.training import runs

runner = CliRunner()
RUN_FILES = {"config.yaml", "adapter.lora.h5", "adapter.json", "metrics.json", "history.csv", "samples.md", "loss.png"}
RUN_FILES |= {"checkpoints", "status.json", ".lock"}  # resume state, `finetune runs` state, the writer's lock
RUN_FILES |= {"tensorboard", "finetune-run.json"}  # TensorBoard logs; the marker of a run directory
METRIC_KEYS = set(
    "backend preset rank train_loss eval_loss_before eval_loss eval_perplexity eval_accuracy "
    "trained_tokens tokens_per_second seconds peak_memory_mb".split()
)
# A short run: later flags override these (click keeps an option's last value).
SHORT = "--backend {b} --seq-len 64 --batch-size 2 --max-steps 2 --set train.samples=1 --set train.max_new_tokens=4"


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + (result.stderr or "")
    return result


def train(out, *flags, preset="tiny"):
    return invoke("gemma", "--preset", preset, *SHORT.format(b=BACKEND).split(), *flags, "--output", out)


def read(out):
    metrics = json.loads((out / "metrics.json").read_text())
    return metrics, yaml.safe_load((out / "config.yaml").read_text())


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "two-steps"
    result = train(out, "--rank", "2", "--alpha", "4", "--set", "train.samples=2")
    return out, result.output


def test_a_two_step_run_writes_every_output(two_step_run):
    out, printed = two_step_run
    assert {p.name for p in out.iterdir()} == RUN_FILES
    metrics, config = read(out)
    assert METRIC_KEYS <= set(metrics)
    assert metrics["backend"] == BACKEND and metrics["steps"] == 2 and metrics["rank"] == 2
    assert metrics["trained_tokens"] > 0 and metrics["response_tokens"] <= metrics["trained_tokens"]
    assert config["lora"]["alpha"] == 4.0 and config["train"]["batch_size"] == 2
    described = json.loads((out / "adapter.json").read_text())
    assert described["preset"]["name"] == "tiny" and len(described["preset"]["fingerprint"]) == 64
    assert (described["rank"], described["alpha"], described["targets"]) == (2, 4.0, ["query", "value"])
    assert described["template"] == "dolly" and described["seq_len"] == 64
    assert described["dtype"] == config["resolved"]["backend_tweaks"]["dtype_policy"]
    assert len(described["adapted"]) == metrics["adapted_layers"]
    assert described["adapted"][0]["lora_kernel_b"][0] == 2
    assert config["resolved"]["backend_tweaks"]["KERAS_BACKEND"] == BACKEND
    expected = backend.cpu_precision(BACKEND)  # auto, on a CPU
    assert config["resolved"]["backend_tweaks"]["dtype_policy"] == expected
    rows = list(csv.DictReader((out / "history.csv").open()))
    assert [r["step"] for r in rows if r["train_loss"]] == ["1", "2"]
    assert float(rows[-1]["eval_loss"]) == pytest.approx(metrics["eval_loss"])
    assert (out / "samples.md").read_text().count("**After training**") == 2
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "eval loss" in printed and "->" in printed  # the summary table
    phases = [line.split("] ", 1)[1] for line in printed.splitlines() if line.startswith("[0:")]
    assert [p.split(" ")[0] for p in phases] == [
        "loading",
        "evaluating",
        "generating",
        "training",
        "generating",
        "saving",
    ]


@pytest.mark.backend_neutral  # packing is data; packed rows' losses: test_attention
def test_rows_are_packed_by_default_and_padded_with_packing_off(tmp_path):
    # At seq-len 256 several sample records share a row (at 64 none fit together).
    train(tmp_path / "packed", "--seq-len", "256")
    packed = read(tmp_path / "packed")[0]
    assert packed["packing"] and packed["padding_fraction"] < packed["padding_fraction_unpacked"] / 2
    train(tmp_path / "padded", "--seq-len", "256", "--packing", "off")
    padded = read(tmp_path / "padded")[0]
    assert not padded["packing"] and padded["padding_fraction"] == padded["padding_fraction_unpacked"]
    assert packed["trained_tokens"] > 2 * padded["trained_tokens"]  # the same two steps carry more tokens
    # Of the positions the steps computed: rows cut to each batch's longest row compute no more padding than full
    # rows hold, and batches of like length (--group-by-length) less again.
    train(tmp_path / "grouped", "--seq-len", "256", "--packing", "off", "--group-by-length")
    grouped = read(tmp_path / "grouped")[0]
    assert 0 <= packed["padding_computed"] < packed["padding_fraction_unpacked"] / 2
    assert grouped["padding_computed"] < padded["padding_computed"] <= padded["padding_fraction"]


def test_backend_tweaks_are_recorded(two_step_run):
    tweaks = read(two_step_run[0])[1]["resolved"]["backend_tweaks"]
    expected = {
        "jax": "XLA_PYTHON_CLIENT_MEM_FRACTION",
        "torch": "torch.intra_op_threads",
        "tensorflow": "tensorflow.tensor_float_32",
    }[BACKEND]
    assert expected in tweaks


def test_eval_command_reproduces_the_run_s_eval_loss(two_step_run):
    out, _ = two_step_run
    result = invoke("eval", "--run", out)
    reported = float(result.output.split("eval_loss ")[1].split()[0])
    assert reported == pytest.approx(read(out)[0]["eval_loss"], abs=1e-3)


def test_generate_command(two_step_run):
    result = invoke("generate", "--run", two_step_run[0], "--prompt", "What is 2 plus 2?", "--max-new-tokens", "3")
    assert result.exit_code == 0


@pytest.mark.backend_neutral
def test_overwrite_replaces_a_run(tmp_path):
    out = tmp_path / "again"
    train(out, "--max-steps", "1")
    (out / "notes.txt").write_text("mine")
    train(out, "--max-steps", "1", "--overwrite", "--seed", "3")
    metrics, config = read(out)
    assert metrics["steps"] == 1 and config["train"]["seed"] == 3
    assert (out / "notes.txt").read_text() == "mine"  # the user's own files stay


@pytest.mark.backend_neutral  # a local preset loads on every backend: test_builder
def test_training_from_a_local_preset_directory(tmp_path):
    lm, preprocessor = builder.build(presets.Source("tiny", "tiny", "gemma"), seq_len=64)
    lm.preprocessor = preprocessor
    lm.save_to_preset(str(tmp_path / "preset"))
    train(tmp_path / "run", preset=tmp_path / "preset")
    metrics, config = read(tmp_path / "run")
    assert metrics["preset"] == str(tmp_path / "preset") and metrics["steps"] == 2
    assert config["resolved"]["preset_kind"] == "local"


@pytest.mark.backend_neutral  # Gemma 3 is built on every backend in test_families; the template is Python
def test_gemma3_preset_directory_with_the_chat_template(tmp_path):
    """The Gemma3CausalLM path, offline: a tiny text-only Gemma 3 saved as a preset."""
    import keras_hub

    tokenizer = keras_hub.models.Gemma3Tokenizer(proto=str(presets.TINY_TOKENIZER), has_vision_tokens=False)
    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), image_size=896, num_layers=2, num_query_heads=4,
        num_key_value_heads=1, hidden_dim=64, intermediate_dim=128, head_dim=16, vision_encoder=None,
    )  # fmt: skip
    preprocessor = keras_hub.models.Gemma3CausalLMPreprocessor(tokenizer=tokenizer, image_converter=None)
    lm = keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=preprocessor)
    lm.save_to_preset(str(tmp_path / "gemma3"))
    train(tmp_path / "run", "--template", "gemma-chat", preset=tmp_path / "gemma3")
    metrics, config = read(tmp_path / "run")
    assert config["resolved"]["preset_family"] == "gemma3" and metrics["steps"] == 2
    assert "<start_of_turn>user" in (tmp_path / "run" / "samples.md").read_text()


def test_default_tiny_run_lowers_the_held_out_loss(tmp_path):
    """The quickstart exactly as a user runs it (defaults), on this backend."""
    out = tmp_path / "quickstart"
    invoke("gemma", "--preset", "tiny", "--backend", BACKEND, "--output", out)
    metrics = read(out)[0]
    assert metrics["eval_loss"] < metrics["eval_loss_before"] - 0.5
    assert metrics["eval_accuracy"] > metrics["eval_accuracy_before"]


@pytest.mark.backend_neutral
@pytest.mark.skipif(not SHARED_DOLLY.exists(), reason="../shared/data is not beside the checkout")
def test_real_dolly_records_train(tmp_path):
    train(tmp_path / "dolly", "--data", SHARED_DOLLY, "--seq-len", "256", "--max-steps", "3")
    metrics = read(tmp_path / "dolly")[0]
    assert metrics["train_examples"] + metrics["eval_examples"] <= 151 and metrics["steps"] == 3


def test_batch_size_auto_picks_a_size_and_leaves_the_model_untouched(tmp_path):
    flags = ["--seq-len", "32", "--max-records", "40", "--max-steps", "1", "--set", "train.samples=0"]
    printed = train(tmp_path / "auto", *flags, "--batch-size", "auto").output
    auto = read(tmp_path / "auto")[0]
    # 40 records: an epoch must keep 8 steps, so the batch is at most 5; the CPU probe times each size.
    assert 1 <= auto["batch_size"] <= 40 // 8
    assert "tokens/s by batch 1: " in printed
    train(tmp_path / "fixed", *flags, "--batch-size", auto["batch_size"])
    fixed = read(tmp_path / "fixed")[0]
    # The probe's trial steps were undone: same start, same one step, same result.
    assert auto["eval_loss_before"] == pytest.approx(fixed["eval_loss_before"], rel=1e-6)
    assert auto["eval_loss"] == pytest.approx(fixed["eval_loss"], rel=1e-4)


def test_the_batch_size_probe_leaves_lora_dropout_s_count_of_training_passes_as_it_was():
    """The probe's trial steps count as training passes: left counted, the run's masks would hang on how many
    sizes the CPU's timings tried."""
    from conftest import float32_policy, lora_model, packed_rows
    from test_lora_dropout import counted

    from finetune.training import train as training

    with float32_policy():
        lm, _ = lora_model(dropout=0.1)
        trainer = builder.compile(lm, 1e-3, 0.0)
        rows = packed_rows(presets.tiny_tokenizer(), n=24)

        def batch_of(size, names):
            return batching.inputs(rows, np.arange(size), 1, batching.target_width(rows, size), names=names)

        size, _ = training.auto_batch_size(trainer, batch_of, 8, device="cpu")  # 8 rows: batch 1 only, timed twice
    assert size == 1 and counted(lm) == 0


@pytest.mark.backend_neutral
def test_every_epoch_is_evaluated(tmp_path):
    # Without SHORT's --max-steps, which since it follows Hugging Face's would override --epochs.
    flags = SHORT.format(b=BACKEND).replace("--max-steps 2 ", "").split()
    invoke("gemma", "--preset", "tiny", *flags, "--max-records", "24", "--epochs", "2", "--output", tmp_path / "epochs")
    rows = list(csv.DictReader((tmp_path / "epochs" / "history.csv").open()))
    evals = [r for r in rows if r["eval_loss"]]
    assert [r["epoch"] for r in evals] == ["1", "2"]
    assert float(evals[-1]["eval_loss"]) == pytest.approx(read(tmp_path / "epochs")[0]["eval_loss"])


@pytest.mark.backend_neutral
def test_eval_on_another_file_names_that_file_in_errors(two_step_run, tmp_path):
    long_prompts = tmp_path / "long.jsonl"
    long_prompts.write_text(json.dumps({"instruction": "word " * 200, "response": "ok"}) + "\n")
    result = runner.invoke(app, ["eval", "--run", str(two_step_run[0]), "--data", str(long_prompts)])
    assert result.exit_code == 2
    assert f"no usable records in {long_prompts}" in result.stderr


def test_an_int4_base_trains_saves_and_reloads_its_adapter(tmp_path):
    """--quantize int4 quantizes the frozen base before LoRA; eval rebuilds it quantized and loads the adapter."""
    out = tmp_path / "int4"
    train(out, "--quantize", "int4", "--set", "train.samples=1")
    metrics, config = read(out)
    assert config["model"]["quantize"] == "int4" and metrics["eval_loss"] < metrics["eval_loss_before"]
    lm, _ = runs.load_model(runs.open_run(out))
    assert any(v.path.endswith("kernel_scale") for v in lm.backbone.weights)  # the rebuilt base is quantized
    reported = float(invoke("eval", "--run", out).output.split("eval_loss ")[1].split()[0])
    assert reported == pytest.approx(metrics["eval_loss"], abs=1e-3)
    # Exported as trained (the factors, onto the int4 base), never merged into the float base it did not train on.
    invoke("export", "--run", out, "--format", "lora", "--output", tmp_path / "lora")
    refused = runner.invoke(app, ["export", "--run", str(out), "--format", "merged", "--output", str(tmp_path / "m")])
    assert refused.exit_code == 2 and "trained on an int4 base" in refused.stderr and not (tmp_path / "m").exists()


@pytest.mark.backend_neutral
def test_a_run_trained_on_a_relative_path_evaluates_from_anywhere(tmp_path, monkeypatch):
    from conftest import make_records, write_jsonl

    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir(), elsewhere.mkdir()
    write_jsonl(here / "mydata.jsonl", make_records(24))
    monkeypatch.chdir(here)
    train(tmp_path / "run", "--data", "mydata.jsonl", "--set", "train.samples=0")
    assert read(tmp_path / "run")[1]["data"]["path"] == str(here / "mydata.jsonl")
    monkeypatch.chdir(elsewhere)
    invoke("eval", "--run", tmp_path / "run")


@pytest.mark.backend_neutral
def test_a_users_folder_is_refused_and_left_as_it_was(tmp_path):
    """--output . in a notes folder: its samples.md and history.csv are the user's, with or without --overwrite."""
    folder = tmp_path / "notes"
    folder.mkdir()
    mine = {"samples.md": b"# my samples\n", "history.csv": b"when,what\n", "todo.txt": b"x"}
    for name, body in mine.items():
        (folder / name).write_bytes(body)
    for flags in ([], ["--overwrite"]):
        result = runner.invoke(app, ["gemma", "--preset", "tiny", *SHORT.format(b=BACKEND).split(), *flags,
                                     "--output", str(folder)])  # fmt: skip
        assert result.exit_code == 2, result.output
        assert "not a finetune run" in result.stderr and "Traceback" not in result.output
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == mine


@pytest.mark.backend_neutral
def test_chat_records_train_with_no_template_given(tmp_path):
    from conftest import write_jsonl

    records = [{"messages": [{"role": "user", "content": f"Count to {i}."},
                             {"role": "assistant", "content": " ".join(str(n) for n in range(1, i + 2))}]}
               for i in range(24)]  # fmt: skip
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    result = train(tmp_path / "run", "--data", path)
    chosen = [line for line in result.output.splitlines() if line.split()[:2] == ["template", "gemma-chat"]]
    assert "chat format" in result.output and "auto: for chat records" in chosen[0]  # the decisions' table
    assert read(tmp_path / "run")[1]["data"]["template"] == "gemma-chat"  # recorded as it was chosen


@pytest.mark.parametrize(
    "name, rows, template",
    [
        ("alpaca.jsonl", [alpaca(i) for i in range(24)], "alpaca"),
        ("dolly.json", make_records(24), "dolly"),
        ("chat.json", [chat(i) for i in range(23)] + [CHAT], "gemma-chat"),
    ],
)
@pytest.mark.backend_neutral
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


TRAIN_RUNS = [(fmt, c) for fmt in sorted(BUILDERS) for c in CONTAINERS if c != "csv" or fmt in FLAT]


# The whole matrix, once, in the PyTorch suite: which template a format gets is decided in Python, and the run it
# trains is the same on every backend (test_data.py's read test shows every container gives the same records).
@pytest.mark.backend_neutral
@pytest.mark.parametrize("fmt, container", TRAIN_RUNS)
def test_every_format_trains_with_no_template(tmp_path, fmt, container):
    rows = [BUILDERS[fmt](i) for i in range(24)]
    path = write(tmp_path / f"{fmt}.{container}", rows)
    args = f"gemma --preset tiny --backend {BACKEND} --seq-len 128 --batch-size 2 --max-steps 1"
    samples = "1" if fmt == "text" else "0"  # a text record's sample starts from its opening words
    result = CliRunner().invoke(
        app, [*args.split(), "--data", str(path), "--set", f"train.samples={samples}", "--output", str(tmp_path / "r")]
    )
    assert result.exit_code == 0, result.output + (result.stderr or "")
    assert f"read 24 records, {fmt} format" in result.output
    chat = ("chat", "sharegpt", "completion-chat")
    chosen = "gemma-chat" if fmt in chat else {"completion": "none", "text": "none"}.get(fmt, fmt)
    decided = [line.split()[:2] for line in result.output.splitlines() if f"auto: for {fmt} records" in line]
    assert decided == [["template", chosen]], result.output  # the decisions' table
    assert (tmp_path / "r" / "adapter.lora.h5").is_file()
    if fmt == "text":
        assert "The number after" in (tmp_path / "r" / "samples.md").read_text()


@pytest.mark.backend_neutral
def test_a_gzipped_jsonl_trains_and_evaluates(tmp_path):
    import gzip

    path = tmp_path / "records.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in make_records(24)).encode()))
    result = train(tmp_path / "run", "--data", path)
    assert "read 24 records, dolly format" in result.output
    assert (tmp_path / "run" / "adapter.lora.h5").is_file()
    assert "eval_loss" in invoke("eval", "--run", tmp_path / "run", "--data", path).output


def test_run_reads_top_to_bottom_on_few_names_and_never_rebinds_its_config():
    """train.run is the spine (train._run, inside the run's signal handler): resolve, build, prepare, train,
    publish. The settings are decided once (resolve.py), so the user's config is never rebound, and each stage hands
    the next one value, not a dozen."""
    import ast
    import inspect

    from finetune.training import train as train_module

    tree = ast.parse(inspect.getsource(train_module._run))
    names = set(train_module._run.__code__.co_varnames)
    assert len(names) <= 15, sorted(names)
    rebound = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "cfg" and isinstance(n.ctx, ast.Store)]
    assert not rebound


def test_one_trainer_steps_batches_of_two_sizes_as_the_batch_size_probe_does():
    """The probe steps one trainer at several sizes. TensorFlow's step was traced for the first size alone, so the
    second was refused and `--batch-size auto` failed whenever the CPU's timings tried more than one size."""
    from conftest import float32_policy, lora_model, packed_rows

    with float32_policy():
        lm, _ = lora_model()
        trainer = builder.compile(lm, 1e-3, 0.0)
        rows = packed_rows(presets.tiny_tokenizer(), n=8)
        for size in (1, 2, 1):
            x, y, w = batching.inputs(rows, np.arange(size), 1, batching.target_width(rows, size),
                                      names=builder.input_names(lm))  # fmt: skip
            loss = trainer.train_on_batch(x, y, sample_weight=w, return_dict=True)["loss"]
            assert np.isfinite(float(loss))


@pytest.mark.backend_neutral  # the note is the loop's arithmetic
def test_accumulating_past_an_epoch_says_each_step_is_a_pass(tmp_path):
    """--grad-accum far past the data: each optimizer step takes every row (one pass), as HF's Trainer steps; said,
    where the run had trained its 2 steps over the data twice with no word of it."""
    result = train(tmp_path / "long", "--max-records", "16", "--grad-accum", "1000", "--max-steps", "1")
    said = "note: one optimizer step of --batch-size 2 x --grad-accum 1000 takes every training row or more"
    assert said in result.output, result.output
    assert (
        "one pass over"
        not in train(tmp_path / "short", "--max-records", "40", "--grad-accum", "2", "--max-steps", "1").output
    )
