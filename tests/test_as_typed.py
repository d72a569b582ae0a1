"""Every tiny family, through the installed `finetune` command, each command in a fresh process, as users type it.

The Python API and CliRunner run inside pytest's process, which never sets what the command's own `main()` sets
(backend.LEAVE_OUT_OTHER_FRAMEWORKS): a Gemma 3 run once failed from the command line on JAX and PyTorch while
every test that reached it through the API passed. Here each family trains 2 steps on this process's backend,
in a process of its own, from a shell-like environment with no KERAS_BACKEND: every family starts on every
backend. Reading the run back is shared out: each suite runs one of `eval`, `generate` and `export --format
merged` per family, in turn, so that the three suites together run each once per family and each stays lean
(the API tests run eval and generate on every backend).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import BACKEND

from finetune.training.resolve import shown

FAMILIES = ("tiny", "tiny-gemma3", "tiny-gemma3n", "tiny-gemma4", "tiny-gemma4-moe")
BACKENDS = ("jax", "torch", "tensorflow")
# Lean, beside `--max-steps 2`: 24 records, short rows, no samples (`generate` below is the same code).
LEAN = ["--max-records", "24", "--seq-len", "64", "--set", "train.samples=0"]
DECIDED = ("precision", "batch_size", "learning_rate", "template", "packing", "remat")  # at least these


def finetune(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The `finetune` console script installed beside this Python, run as a shell would: no KERAS_BACKEND."""
    return finetune_exits(0, *args, cwd=cwd)


def finetune_exits(code: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The `finetune` console script run as finetune() runs it, expected to exit `code` (a refusal: 2) without a
    traceback."""
    command = Path(sys.executable).with_name("finetune")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run([str(command), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == code, f"finetune {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def reads_back(preset: str) -> str:
    """Which command this backend's suite runs on `preset`'s run: each of the three on one backend a family."""
    turn = (FAMILIES.index(preset) + BACKENDS.index(BACKEND)) % len(BACKENDS)
    return ("export", "eval", "generate")[turn]


@pytest.mark.parametrize(
    "preset",
    # CI time: the MoE trains from the command line on every backend in test_experts; here, in the PyTorch suite.
    [pytest.param(p, marks=pytest.mark.backend_neutral) if p == "tiny-gemma4-moe" else p for p in FAMILIES],
)
def test_each_family_trains_evaluates_and_generates_from_the_command_line(preset, tmp_path):
    run = "runs/typed"
    trained = finetune("gemma", "--preset", preset, "--backend", BACKEND, "--max-steps", "2", *LEAN,
                       "--output", run, cwd=tmp_path)  # fmt: skip
    metrics = json.loads((tmp_path / run / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["backend"] == BACKEND
    # The console names where it trained, at the start and in the summary table.
    where = f"{metrics['device_name']}, {metrics['dtype_policy']}"
    assert f"loading {preset} on {BACKEND}: {where}" in trained.stdout + trained.stderr
    assert any(line.startswith("device") and where in line for line in trained.stdout.splitlines()), trained.stdout
    # Every decision is printed once, in one table, as config.yaml's `resolved` records it: {value, why}.
    resolved = yaml.safe_load((tmp_path / run / "config.yaml").read_text(encoding="utf-8"))["resolved"]
    lines = trained.stdout.splitlines()
    assert sum(line.split()[:3] == ["setting", "value", "why"] for line in lines) == 1, trained.stdout
    for name in DECIDED:
        value, why = resolved[name]["value"], resolved[name]["why"]
        assert why and [line for line in lines if line.split()[:2] == [name, shown(value)]], (name, trained.stdout)
    assert resolved["precision"]["value"] == metrics["dtype_policy"]
    assert (
        resolved["batch_size"]["value"] == metrics["batch_size"] and resolved["packing"]["value"] == metrics["packing"]
    )

    if reads_back(preset) == "eval":
        evaluated = finetune("eval", "--run", run, cwd=tmp_path)
        assert "eval_loss " in evaluated.stdout, evaluated.stdout
        assert f"evaluated on {BACKEND}: {where}" in evaluated.stderr

    if reads_back(preset) == "generate":
        generated = finetune("generate", "--run", run, "--prompt", "Name a colour.", "--max-new-tokens", "3",
                             cwd=tmp_path)  # fmt: skip
        assert generated.stdout.strip(), "generate printed nothing"
        assert f"generated on {BACKEND}: {where}" in generated.stderr
        # beside a long prompt, the short one's answer is its own: keras-hub's batch had run it past its budget
        long = "Name a city in France, and say what its rivers and its food are like. " * 3
        both = finetune("generate", "--run", run, "--prompt", "Name a colour.", "--prompt", long,
                        "--max-new-tokens", "3", cwd=tmp_path)  # fmt: skip
        assert both.stdout.startswith(f"[1] Name a colour.\n{generated.stdout}[2] "), both.stdout

    if reads_back(preset) == "export":
        exported = finetune("export", "--run", run, "--format", "merged", "--output", "merged", cwd=tmp_path)
        assert "exported" in exported.stdout
        config = json.loads((tmp_path / "merged" / "config.json").read_text())
        assert config["class_name"].endswith(("GemmaBackbone", "Gemma3Backbone", "Gemma3nBackbone", "Gemma4Backbone"))


@pytest.mark.backend_neutral  # the records' reading and the template's spans: Python's, whatever the backend
def test_a_conversational_prompt_completion_trains_its_completion_alone_from_the_command_line(tmp_path):
    """TRL's conversational prompt-completion on Gemma 4's turns: `finetune data` shows the loss on the completion
    alone, the prompt's earlier answer as context; `finetune gemma` trains it, the template chosen for it."""
    rows = [{"prompt": [{"role": "user", "content": f"Add {i} and 1."}, {"role": "assistant", "content": f"{i + 1}."},
                        {"role": "user", "content": "And 2?"}],
             "completion": [{"role": "assistant", "content": f"{i + 2}."}]} for i in range(24)]  # fmt: skip
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    shown_ = finetune("data", "c.jsonl", "--preset", "tiny-gemma4", cwd=tmp_path).stdout
    assert "format: completion-chat (prompt, completion, as messages), 24 records" in shown_, shown_
    assert "  <|turn>model\n  1.<turn|>\n" in shown_ and "  «2.<turn|><eos>»" in shown_, shown_
    finetune("gemma", "--preset", "tiny-gemma4", "--backend", BACKEND, "--data", "c.jsonl", "--max-steps", "1", *LEAN,
             "--output", "run", cwd=tmp_path)  # fmt: skip
    resolved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text(encoding="utf-8"))["resolved"]
    assert resolved["template"]["value"] == "gemma4-chat"


@pytest.mark.backend_neutral  # the pairs' layout is numpy's; test_pictured_pairs checks the numbers on each backend
def test_preference_pairs_with_pictures_train_from_the_command_line(tmp_path):
    """`finetune gemma --method dpo` on pairs whose prompt holds a picture, in a fresh process: both answers' rows
    carry it, and the run writes its adapter."""
    from PIL import Image

    Image.new("RGB", (8, 8), "red").save(tmp_path / "red.png")
    rows = [{"prompt": "<image>What colour is it?", "chosen": "Red.", "rejected": "Blue.", "images": ["red.png"]}] * 8
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    trained = finetune("gemma", "--preset", "tiny-gemma3-vision", "--backend", BACKEND, "--method", "dpo", "--data",
                       "pairs.jsonl", "--batch-size", "2", "--max-steps", "1", "--set", "train.samples=0", "--output",
                       "run", cwd=tmp_path)  # fmt: skip
    assert "packing off: the data has images" in trained.stdout + trained.stderr
    assert (tmp_path / "run" / "adapter.lora.h5").is_file()
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 1


@pytest.mark.backend_neutral
def test_a_run_in_a_bucket_is_listed_and_evaluated_where_it_lies_from_the_command_line(tmp_path):
    """`finetune runs URL` and `finetune eval --run URL` in fresh processes. A file:// URL stands for the bucket
    (fsspec's local file system, which every process has; gs:// reads through the same code with gcsfs)."""
    import shutil

    finetune("gemma", "--preset", "tiny", "--backend", BACKEND, "--max-steps", "2", *LEAN, "--output", "runs/a",
             cwd=tmp_path)  # fmt: skip
    shutil.copytree(tmp_path / "runs" / "a", tmp_path / "bucket" / "runs" / "a")
    url = f"file://{tmp_path / 'bucket' / 'runs'}"
    listed = finetune("runs", url, cwd=tmp_path)
    (row,) = [line for line in listed.stdout.splitlines() if line.startswith(f"{url}/a")]
    assert row.split()[1:3] == ["finished", "2"], listed.stdout
    evaluated = finetune("eval", "--run", f"{url}/a", cwd=tmp_path)
    metrics = json.loads((tmp_path / "runs" / "a" / "metrics.json").read_text())
    loss = float(evaluated.stdout.split("eval_loss ")[1].split()[0])
    assert abs(loss - metrics["eval_loss"]) < 1e-4 and f"read {url}/a" in evaluated.stderr


@pytest.mark.backend_neutral  # the order is numpy's (batching.EpochRows); the method matrix trains each method
def test_group_by_length_trains_from_the_command_line_and_grpo_refuses_it(tmp_path):
    """`finetune gemma --packing off --group-by-length` in a fresh process trains and records the setting; GRPO,
    whose prompts share one width, refuses it with exit 2 and writes nothing."""
    finetune("gemma", "--preset", "tiny", "--backend", BACKEND, "--packing", "off", "--group-by-length",
             "--max-steps", "2", *LEAN, "--output", "run", cwd=tmp_path)  # fmt: skip
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text(encoding="utf-8"))
    assert config["train"]["group_by_length"] is True
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 2
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Tell {i}."}) + "\n" for i in range(8)))
    command = Path(sys.executable).with_name("finetune")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    refused = subprocess.run([str(command), "gemma", "--preset", "tiny", "--method", "grpo", "--reward", "format:The",
                              "--data", "p.jsonl", "--group-by-length", "--output", "grpo"], capture_output=True,
                             text=True, cwd=tmp_path, env=env, timeout=300)  # fmt: skip
    assert refused.returncode == 2 and "--group-by-length: GRPO pads every prompt" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "grpo").exists()
    planned = subprocess.run([str(command), "gemma", "--preset", "tiny", "--method", "grpo", "--reward", "format:The",
                              "--group-by-length", "--plan-only"], capture_output=True, text=True, cwd=tmp_path,
                             env=env, timeout=300)  # fmt: skip
    assert planned.returncode == 2 and "--group-by-length: GRPO pads every prompt" in planned.stderr, planned.stderr


def refused(*args: str, cwd: Path) -> str:
    """The installed `finetune`, in a fresh process, refusing a user's mistake: exit 2, one message, no traceback."""
    command = Path(sys.executable).with_name("finetune")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run([str(command), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done.returncode, done.stderr[-2000:])
    return done.stderr


@pytest.mark.backend_neutral  # the refusals are Python before or beside the backend's work
def test_a_finished_run_s_mistakes_are_refused_as_typed(tmp_path):
    """What this round refused, as users type it: a recipe giving a key twice; a resume with another LoRA dropout;
    eval on data of another kind than the run's method; export into the run's directory; a prompt's <image> with
    no --image. Each exits 2 naming the fault, and the run's files stay as they were."""
    run = "runs/typed"
    finetune("gemma", "--preset", "tiny", "--backend", BACKEND, "--max-steps", "2", *LEAN, "--output", run,
             cwd=tmp_path)  # fmt: skip
    files = {p: p.read_bytes() for p in (tmp_path / run).rglob("*") if p.is_file()}
    (tmp_path / "twice.yaml").write_text("lora:\n  rank: 4\n  rank: 8\n")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    for args, said in (
        (
            ["gemma", "--recipe", "twice.yaml", "--plan-only"],
            "twice.yaml:3 is not valid YAML: key 'rank' is given twice",
        ),
        (["gemma", "--resume", "--output", run, "--max-steps", "3", "--lora-dropout", "0.1"], "lora.dropout=0.0"),
        (["eval", "--run", run, "--data", "pairs.jsonl"], "the run is sft, which takes records with answers"),
        (["export", "--run", run, "--format", "lora", "--output", f"{run}/exported"], "inside the run's directory"),
        (["generate", "--run", run, "--prompt", "<image>What is it?"], "no --image gives it"),
    ):
        assert said in " ".join(refused(*args, cwd=tmp_path).split()), args
    assert {p: p.read_bytes() for p in (tmp_path / run).rglob("*") if p.is_file()} == files


@pytest.mark.backend_neutral  # the refusals and the listing are Python's
def test_this_rounds_refusals_keep_every_file_as_typed(tmp_path):
    """Two --recipe (the last had replaced the first whole), and --overwrite of an export holding a file of the
    user's in its folders (it was deleted): each exits 2, and every file stays."""
    run = "runs/typed"
    finetune("gemma", "--preset", "tiny", "--backend", BACKEND, "--max-steps", "2", *LEAN, "--output", run,
             cwd=tmp_path)  # fmt: skip
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text("model:\n  preset: tiny\n")
    said = refused("gemma", "--recipe", "a.yaml", "--recipe", "b.yaml", "--output", "other", cwd=tmp_path)
    assert "--recipe is given 2 times (a.yaml, b.yaml)" in said and not (tmp_path / "other").exists()
    finetune("export", "--run", run, "--format", "merged", "--output", "merged", cwd=tmp_path)
    mine = tmp_path / "merged" / "assets" / "tokenizer" / "notes.txt"
    mine.write_text("mine")
    said = refused("export", "--run", run, "--format", "lora", "--output", "merged", "--overwrite", cwd=tmp_path)
    assert "assets/tokenizer/notes.txt in it is not the export's own" in said and mine.read_text() == "mine"


@pytest.mark.backend_neutral  # the resume's decisions are Python's; resuming itself is tested on every backend
def test_a_finished_run_trains_further_as_typed(tmp_path):
    """This round's resume, as users type it: `--epochs` on a `--max-steps` run trains to the epochs, the decayed
    schedule is said to stretch, the table says what the checkpoint decided, and `generate` takes a system prompt
    only where the template has a place for it."""
    run = "runs/typed"
    finetune("gemma", "--preset", "tiny", "--backend", BACKEND, "--max-steps", "2", "--lr-schedule", "cosine",
             "--checkpoint-every", "1", *LEAN, "--output", run, cwd=tmp_path)  # fmt: skip
    further = finetune("gemma", "--resume", "--output", run, "--epochs", "1", cwd=tmp_path)
    steps = json.loads((tmp_path / run / "metrics.json").read_text())["steps"]
    assert steps > 2 and f"1 epochs of {steps} steps" in further.stdout, further.stdout
    assert f"planned again over {steps} steps, not the 2 its checkpoint planned" in further.stdout, further.stdout
    assert [line for line in further.stdout.splitlines() if line.startswith("precision") and "resumed" in line]
    said = refused("generate", "--run", run, "--prompt", "Hi.", "--system", "Be brief.", cwd=tmp_path)
    assert "--system needs a chat template, and the run's is dolly" in said, said


@pytest.mark.backend_neutral  # the plan is Python arithmetic, no keras
def test_a_plan_that_does_not_fit_exits_3_after_printing_it(tmp_path):
    """`finetune plan` and `--plan-only` print the whole plan either way; one that does not fit the device's memory
    exits 3 after it (a job script's `plan && gemma` stops), one that fits exits 0, and no verdict (no device) is 0."""
    command = Path(sys.executable).with_name("finetune")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}

    def plan(*args):
        return subprocess.run([str(command), *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                              timeout=600)  # fmt: skip

    big = plan("plan", "--preset", "gemma_7b_en", "--seq-len", "4096", "--device-memory", "16GB")
    assert big.returncode == 3 and "Traceback" not in big.stderr, big.stderr
    assert "total" in big.stdout and "does not fit: " in big.stdout + big.stderr
    as_json = plan("plan", "--preset", "gemma_7b_en", "--seq-len", "4096", "--device-memory", "16GB", "--json")
    assert as_json.returncode == 3 and json.loads(as_json.stdout)["fits"] is False
    assert plan("plan", "--preset", "gemma_2b_en", "--device-memory", "h100").returncode == 0
    assert plan("plan", "--preset", "gemma_7b_en", "--seq-len", "4096").returncode == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.backend_neutral  # the check is Python's, before the model loads
def test_eval_of_a_run_whose_data_file_changed_is_refused_as_typed(tmp_path):
    """`finetune eval --run` scores the records the run held out of its --data file, split again: a file changed
    since (reordered, here) would give another split, with records the run trained on. It is refused, as a resume
    is; `--data FILE` still evaluates on a file of one's own, and a file since deleted says to pass it."""
    records = [{"instruction": f"What is {i} plus 1?", "response": f"{i + 1}."} for i in range(24)]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = "runs/held"
    finetune("gemma", "--preset", "tiny", "--backend", BACKEND, "--data", "mine.jsonl", "--max-steps", "1", *LEAN,
             "--output", run, cwd=tmp_path)  # fmt: skip
    assert json.loads((tmp_path / run / "metrics.json").read_text())["data_fingerprint"]
    first = finetune("eval", "--run", run, cwd=tmp_path).stdout
    data.write_text("".join(json.dumps(r) + "\n" for r in reversed(records)))
    said = " ".join(refused("eval", "--run", run, cwd=tmp_path).split())
    assert "differ from those" in said and "may hold some it trained on; pass --data FILE" in said, said
    assert "examples" in finetune("eval", "--run", run, "--data", "mine.jsonl", cwd=tmp_path).stdout
    data.write_text("".join(json.dumps(r) + "\n" for r in records))  # as it was: the same split, the same scores
    assert finetune("eval", "--run", run, cwd=tmp_path).stdout == first
    data.unlink()
    assert "pass --data FILE to evaluate on a file of your own" in " ".join(refused("eval", "--run", run,
                                                                                    cwd=tmp_path).split())  # fmt: skip


@pytest.mark.backend_neutral  # the refusal comes before training
def test_a_vision_preset_at_the_shortest_seq_len_is_refused_as_typed(tmp_path):
    """tiny-gemma3-vision at --seq-len 8, the least the flag takes: keras-hub's preprocessor refused a length that
    holds no room for its pictures while it was built (exit 1); the run now says what the length cannot hold."""
    said = refused("gemma", "--preset", "tiny-gemma3-vision", "--backend", BACKEND, "--seq-len", "8", "--max-steps",
                   "1", "--output", "runs/short", cwd=tmp_path)  # fmt: skip
    assert "seq-len 8 is too small" in said and not (tmp_path / "runs").exists()
