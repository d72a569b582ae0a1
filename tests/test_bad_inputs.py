"""The bad-input corpus: every mistake a user can make, refused the same way.

Each case runs the CLI in-process and must exit 2 with one or two lines on
stderr that start with `error: ` and name the file, line, flag or key at
fault, with no traceback and no run directory (nor `.run*` staging sibling)
left behind. A second table holds odd but valid data, which must load.

End to end: a refusal may come from any module, so the corpus mirrors none and runs the whole CLI.
"""

import json
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import h5py
import numpy as np
import pytest
import typer
from conftest import BACKEND, chat, make_records, write_jsonl
from typer.testing import CliRunner

import finetune
from finetune.cli import app

runner = CliRunner()
# Each command's options, as its --help lists them: the only ones its messages may advise.
OPTIONS = {
    name: {opt for parameter in command.params for opt in getattr(parameter, "opts", [])} | {"--help"}
    for name, command in typer.main.get_command(app).commands.items()
}


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@dataclass
class Where:
    """What a case may refer to: its temporary directory, good data, the trained runs."""

    tmp: Path
    good: Path
    out: Path
    runs: dict
    monkeypatch: pytest.MonkeyPatch

    def file(self, name: str, content: bytes | str) -> Path:
        path = self.tmp / name
        path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        return path

    def run_copy(self, name: str = "rank4") -> Path:
        copy = self.tmp / f"copy-of-{name}"
        shutil.copytree(self.runs[name], copy)
        return copy


@dataclass
class Case:
    name: str
    args: Callable[[Where], list]
    """The command line: `gemma` cases get the tiny flags, good data and --output before these."""
    expected: str
    """A substring of the message, naming what is at fault."""
    command: str = "gemma"
    setup: Optional[Callable[[Where], None]] = None
    prefix: bool = True
    """Whether a `gemma` case gets the tiny flags, good data and --output first."""


def gemma(name, args, expected):
    return Case(name, lambda w: list(args), expected)


def data(name, content, expected):
    return Case(name, lambda w: ["--data", w.file(f"{name}.jsonl", content)], expected)


def recipe(name, content, expected):
    return Case(name, lambda w: ["--recipe", w.file(f"{name}.yaml", content)], expected)


def preset_dir(name, config_json, expected):
    def args(w):
        directory = w.tmp / name
        directory.mkdir()
        if config_json is not None:
            (directory / "config.json").write_bytes(config_json.encode())
        return ["--preset", directory]

    return Case(name, args, expected)


def bench(name, args, expected):
    """`finetune bench` with bad flags: refused before any worker starts."""
    return Case(name, lambda w: list(args), expected, command="bench")


def run_case(name, command, change, expected):
    """`finetune eval|generate --run COPY` on a copy of a trained run, changed by `change(copy, where)`."""

    def args(w):
        copy = w.run_copy()
        change(copy, w)
        return ["--run", copy, *(["--prompt", "hi"] if command == "generate" else [])]

    return Case(name, args, expected, command=command)


def generate(name, extra, expected):
    """`finetune generate` on an intact run, with bad flags."""
    return Case(name, lambda w: ["--run", w.run_copy(), "--prompt", "hi", *extra], expected, command="generate")


def _truncate(path: Path):
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def _poison(path: Path):
    with h5py.File(path, "r+") as f:
        names = []
        f.visititems(lambda name, obj: names.append(name) if name.endswith("lora_kernel_b") else None)
        dataset = f[names[0]]
        values = dataset[()]
        values.flat[0] = np.nan
        dataset[...] = values


def _unreadable(w: Where):
    path = w.file("unreadable.jsonl", '{"instruction": "a", "response": "b"}\n')
    original = Path.read_bytes

    def refuse(self):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return original(self)

    w.monkeypatch.setattr(Path, "read_bytes", refuse)


ADAPTER = "adapter.lora.h5"
ADAPTER_JSON = "adapter.json"


def _describe(run: Path, **changes):
    """Rewrite keys of the run's adapter.json, as if it came from another run."""
    description = json.loads((run / ADAPTER_JSON).read_text())
    description.update(changes)
    (run / ADAPTER_JSON).write_text(json.dumps(description))


def _nudge(path: Path):
    """A finite change to one LoRA weight: an adapter of the same layout from another run."""
    with h5py.File(path, "r+") as f:
        names = []
        f.visititems(lambda name, obj: names.append(name) if name.endswith("lora_kernel_a") else None)
        dataset = f[names[0]]
        values = dataset[()]
        values.flat[0] += 1.0
        dataset[...] = values


def _h5_rank(path: Path, value):
    """Replace the rank keras-hub records in the adapter file, as a hand edit would."""
    with h5py.File(path, "r+") as f:
        del f["lora/vars/rank"]
        f["lora/vars/rank"] = value


def _unfinished(w: Where) -> Path:
    """A copy of a trained run as a kill would leave it: checkpoints, no results."""
    copy = w.run_copy()
    for name in (ADAPTER, ADAPTER_JSON, "metrics.json", "config.yaml", "history.csv", "samples.md", "loss.png"):
        (copy / name).unlink(missing_ok=True)
    return copy


def _break_checkpoints(how: str):
    def change(w: Where) -> list:
        copy = _unfinished(w)
        for directory in (copy / "checkpoints").iterdir():
            if how == "torn":
                (directory / "manifest.json").unlink()
            else:
                raw = bytearray((directory / "weights.npz").read_bytes())
                raw[-20] ^= 0xFF
                (directory / "weights.npz").write_bytes(bytes(raw))
        return ["--resume", "--output", copy]

    return change


def resume(name, change, expected):
    """`finetune gemma --resume` on a copy of a trained run; every setting not given comes from its checkpoint."""
    return Case(name, change, expected, prefix=False)


CASES = [
    # Numbers: out of range, not finite, or not numbers at all.
    gemma(
        "category-mistyped",
        ["--data", "sample", "--category", "Open_QA"],
        "its categories are brainstorming, classification, closed_qa",
    ),
    gemma("lr-nan", ["--lr", "nan"], "'train.learning_rate' must be a finite number"),
    gemma("lr-inf", ["--lr", "inf"], "'train.learning_rate' must be a finite number"),
    gemma("lr-negative", ["--lr", "-1"], "learning rate must be positive"),
    gemma("lr-zero", ["--lr", "0"], "learning rate must be positive"),
    gemma("alpha-inf", ["--alpha", "inf"], "'lora.alpha' must be a finite number"),
    gemma("alpha-nan", ["--alpha", "nan"], "'lora.alpha' must be a finite number"),
    gemma("alpha-zero", ["--alpha", "0"], "alpha must be positive"),
    gemma("alpha-negative", ["--alpha", "-2"], "alpha must be positive"),
    gemma("rank-zero", ["--rank", "0"], "rank must be at least 1"),
    gemma("rank-negative", ["--rank", "-1"], "rank must be at least 1"),
    gemma("rank-nan", ["--rank", "nan"], "invalid value for '--rank': 'nan' is not a valid integer"),
    gemma("epochs-zero", ["--epochs", "0"], "epochs must be at least 1"),
    gemma("epochs-negative", ["--epochs", "-1"], "epochs must be at least 1"),
    gemma("max-steps-zero", ["--max-steps", "0"], "max steps must be at least 1"),
    gemma("max-steps-negative", ["--max-steps", "-3"], "max steps must be at least 1"),
    gemma("batch-size-zero", ["--batch-size", "0"], "batch size must be a positive integer"),
    gemma("batch-size-negative", ["--batch-size", "-4"], "batch size must be a positive integer"),
    gemma("batch-size-nan", ["--batch-size", "nan"], "--batch-size must be a positive integer"),
    gemma("bad-batch-size", ["--batch-size", "lots"], "--batch-size must be a positive integer"),
    gemma("weight-decay-inf", ["--set", "train.weight_decay=.inf"], "'train.weight_decay' must be a finite number"),
    gemma("weight-decay-nan", ["--set", "train.weight_decay=.nan"], "'train.weight_decay' must be a finite number"),
    gemma("seed-negative", ["--seed", "-1"], "seed must be between 0 and 4294967295"),
    gemma("seed-too-large", ["--seed", str(2**32)], "seed must be between 0 and 4294967295"),
    gemma("eval-fraction-nan", ["--eval-fraction", "nan"], "'data.eval_fraction' must be a finite number"),
    gemma("eval-fraction-negative", ["--eval-fraction", "-0.1"], "eval fraction must be in [0, 1)"),
    gemma("eval-fraction-one", ["--eval-fraction", "1.5"], "eval fraction must be in [0, 1)"),
    gemma("xla-mem-fraction-nan", ["--xla-mem-fraction", "nan"], "'train.xla_mem_fraction' must be a finite number"),
    gemma("seq-len-too-small", ["--seq-len", "12"], "too small for the dolly template"),
    gemma("unknown-option", ["--epoch", "2"], "no such option: --epoch"),
    # Empty strings, as from an unset shell variable.
    gemma("empty-output", ["--output", ""], "--output is empty"),
    gemma("empty-data", ["--data", ""], "--data is empty"),
    gemma("empty-preset", ["--preset", ""], "--preset is empty"),
    gemma("empty-recipe", ["--recipe", ""], "--recipe is empty"),
    # Names that do not exist.
    gemma("unknown-backend", ["--backend", "numpy"], "unknown backend 'numpy'"),
    gemma("unknown-template", ["--template", "chatml"], "unknown template 'chatml'"),
    gemma("unknown-set-key", ["--set", "train.epoch=2"], "did you mean 'train.epochs'"),
    # Recipes.
    recipe("recipe-list", "- 1\n- 2\n", "must be a mapping"),
    recipe("recipe-scalar", "just a string\n", "must be a mapping"),
    recipe("recipe-integer-key", "1: 2\n", "config key 1 at the top level is not a name"),
    recipe("recipe-null-key", "~: 3\n", "config key None at the top level is not a name"),
    recipe("recipe-nested-integer-key", "train:\n  7: 1\n", "config key 7 in section train is not a name"),
    recipe("recipe-section-list", "train: [1, 2]\n", "'train' is not a section"),
    recipe("recipe-invalid-yaml", "train: {epochs: [1\n", "is not valid YAML"),
    recipe("recipe-key-twice", "lora:\n  rank: 4\n  rank: 8\n", "key 'rank' is given twice"),
    recipe("recipe-not-utf8", "train:\n  epochs: 1 # \u00e9t\u00e9\n".encode("cp1252"), "recipe-not-utf8.yaml"),
    recipe("recipe-unknown-key", "train:\n  epoch: 2\n", "unknown config key 'train.epoch'"),
    Case("recipe-missing", lambda w: ["--recipe", w.tmp / "missing.yaml"], "missing.yaml"),
    # Data files.
    data("data-empty", b"", "is empty"),
    data("data-not-json", '{"instruction": "a", "response": "b"}\nnot json at all\n', ":2: not valid JSON"),
    data("data-json-array", '["instruction", "response"]\n', "item 1: expected a JSON object"),
    data(  # json.loads keeps the last of a key given twice, silently: which answer trained was a guess
        "data-key-twice",
        '{"instruction": "a", "response": "b"}\n{"instruction": "c", "response": "d", "response": "e"}\n',
        ":2: key 'response' is given twice in one object",
    ),
    data(  # a file of one line is JSON Lines: its line's error, not "one JSON object over many lines"
        "data-key-twice-one-line",
        '{"instruction": "c", "response": "d", "response": "e"}\n',
        ":1: key 'response' is given twice in one object",
    ),
    data(  # the role named is the first message's, not None
        "data-pair-answer-messages",
        '{"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "assistant", "content": "a"}, {"role": '
        '"user", "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]}\n',
        "it is 2 message(s), the first with role 'assistant'",
    ),
    data("data-no-response", '{"instruction": "a"}\n', ":1: record has no 'response' field"),
    data("data-non-string", '{"instruction": "a", "response": 42}\n', ":1: field 'response' must be a string"),
    data("data-empty-instruction", '{"instruction": "  ", "response": "b"}\n', ":1: field 'instruction' is empty"),
    data("data-not-utf8", '{"instruction": "\u00e9t\u00e9", "response": "b"}\n'.encode("cp1252"), "is not UTF-8"),
    data("data-lone-surrogate", '{"instruction": "\\ud800", "response": "x"}\n', ":1: field 'instruction'"),
    Case("data-missing", lambda w: ["--data", w.tmp / "missing.jsonl"], "missing.jsonl does not exist"),
    Case("data-directory", lambda w: ["--data", w.tmp], "is a folder; give the path of one data file"),
    Case(
        "data-unreadable",
        lambda w: ["--data", w.tmp / "unreadable.jsonl"],
        "cannot read data file",
        setup=_unreadable,
    ),
    Case("data-no-records-after-filters", lambda w: ["--category", "poetry"], "no usable records"),
    # Presets.
    gemma("preset-unknown-name", ["--preset", "gemma_9z_en"], "unknown preset 'gemma_9z_en'"),
    Case("preset-missing-directory", lambda w: ["--preset", w.tmp / "no-such-preset"], "no-such-preset does not exist"),
    preset_dir("preset-no-config", None, "no config.json"),
    preset_dir("preset-config-list", "[1, 2]", "config.json must hold a JSON object"),
    preset_dir("preset-config-not-json", "{not json", "config.json is not valid JSON"),
    preset_dir("preset-not-gemma", '{"class_name": "LlamaBackbone"}', "holds a LlamaBackbone model"),
    # LoRA targets.
    gemma("target-embedding", ["--target", "token_embedding"], "layer 'token_embedding' cannot be adapted"),
    gemma("target-unknown", ["--target", "qkv"], "no layer named 'qkv'"),
    # Runs for eval and generate.
    run_case("run-no-config", "eval", lambda r, w: (r / "config.yaml").unlink(), "has no config.yaml"),
    Case(
        "export-into-the-run",
        lambda w: ["--run", (r := w.run_copy()), "--format", "lora", "--output", r / "exp"],
        "is inside the run's directory",
        command="export",
    ),
    generate("generate-placeholder-without-picture", ["--prompt", "<image>What is it?"], "no --image gives it"),
    Case(
        "run-is-a-file",
        lambda w: ["--run", w.file("notes.jsonl", "{}\n")],
        "is a file, not a run directory",
        command="eval",
    ),
    run_case("run-no-metrics", "generate", lambda r, w: (r / "metrics.json").unlink(), "has no metrics.json, so it"),
    Case(
        "eval-on-pairs",
        lambda w: [
            "--run",
            w.run_copy(),
            "--data",
            w.file("pairs.jsonl", '{"prompt": "a", "chosen": "b", "rejected": "c"}\n'),
        ],
        "holds preference pairs (preference); the run is sft, which takes records with answers",
        command="eval",
    ),
    Case(
        "eval-on-prompts",
        lambda w: ["--run", w.run_copy(), "--data", w.file("prompts.jsonl", '{"prompt": "a"}\n')],
        "holds prompts alone (prompts); the run is sft, which takes records with answers",
        command="eval",
    ),
    run_case("run-no-adapter", "generate", lambda r, w: (r / ADAPTER).unlink(), f"has no {ADAPTER}"),
    run_case("run-truncated-adapter", "eval", lambda r, w: _truncate(r / ADAPTER), "not a readable adapter"),
    run_case(
        "run-random-adapter",
        "generate",
        lambda r, w: (r / ADAPTER).write_bytes(np.random.default_rng(0).bytes(4096)),
        "not a readable adapter",
    ),
    run_case(
        "run-adapter-of-other-rank",
        "eval",
        lambda r, w: shutil.copy(w.runs["rank2"] / ADAPTER, r / ADAPTER),
        "has LoRA rank 2, but the run's config.yaml says 4",
    ),
    run_case("run-adapter-not-finite", "generate", lambda r, w: _poison(r / ADAPTER), "weights that are not finite"),
    run_case("run-no-adapter-json", "eval", lambda r, w: (r / ADAPTER_JSON).unlink(), f"has no {ADAPTER_JSON}"),
    run_case(
        "run-adapter-json-corrupt",
        "generate",
        lambda r, w: _truncate(r / ADAPTER_JSON),
        "adapter.json is not valid JSON",
    ),
    run_case(
        "run-adapter-json-wrong-type",
        "eval",
        lambda r, w: _describe(r, alpha="lots"),
        "adapter.json: alpha must be a number, got text",
    ),
    run_case("run-adapter-json-rank-list", "eval", lambda r, w: _describe(r, rank=[4]), "rank must be an integer"),
    run_case("run-adapter-json-rank-zero", "eval", lambda r, w: _describe(r, rank=0), "rank must be at least 1"),
    run_case(
        "run-adapter-json-targets-numbers", "eval", lambda r, w: _describe(r, targets=[1, 2]), "targets[0] must be text"
    ),
    run_case(
        "run-adapter-json-adapted-list", "generate", lambda r, w: _describe(r, adapted=[[0]]), "adapted[0] must be an"
    ),
    run_case("run-adapter-json-null", "eval", lambda r, w: (r / ADAPTER_JSON).write_text("null"), "not an object"),
    run_case(
        "run-adapter-rank-array", "eval", lambda r, w: _h5_rank(r / ADAPTER, np.array([4, 4])), "not a whole number"
    ),
    run_case("run-adapter-rank-text", "generate", lambda r, w: _h5_rank(r / ADAPTER, "four"), "not a whole number"),
    run_case(
        "run-adapter-and-json-of-other-rank",
        "eval",
        lambda r, w: [shutil.copy(w.runs["rank2"] / name, r / name) for name in (ADAPTER, ADAPTER_JSON)],
        "says rank 2, but the run's config.yaml says 4",
    ),
    run_case(
        "run-adapter-of-other-targets",
        "generate",
        lambda r, w: _describe(r, targets=["query"]),
        "says targets query, but the run's config.yaml says query,value",
    ),
    run_case(
        "run-adapter-of-other-preset",
        "eval",
        lambda r, w: _describe(r, preset={"name": "gemma_2b_en", "family": "gemma", "fingerprint": "0" * 64}),
        "says preset gemma_2b_en, but the run's config.yaml says tiny",
    ),
    run_case(
        "run-adapter-of-other-run",
        "eval",
        lambda r, w: _nudge(r / ADAPTER),
        "does not hold the weights its adapter.json describes",
    ),
    run_case(
        "run-config-not-yaml", "eval", lambda r, w: (r / "config.yaml").write_text("lora: [unclosed\n"), "config.yaml"
    ),
    run_case(  # YAML reads the damage as a key: said so, without the list of every key
        "run-config-damaged",
        "eval",
        lambda r, w: (r / "config.yaml").write_text("::: not yaml [\n"),
        "config.yaml does not hold a run's settings (unknown config key '::'): it was edited or damaged",
    ),
    Case("run-missing", lambda w: ["--run", w.tmp / "no-such-run"], "no-such-run does not exist", command="eval"),
    Case(
        "eval-data-of-another-format",  # the run's template is dolly: eval cannot take another, so none is advised
        lambda w: ["--run", w.run_copy(), "--data", w.file("t.jsonl", '{"text": "a b c"}\n')],
        "holds text records, which this run's template, dolly, cannot render",
        command="eval",
    ),
    Case(  # the run's seq-len is fixed: a longer one is a retraining, named by its key
        "eval-data-whose-prompts-fill-the-run-s-seq-len",
        lambda w: [
            "--run",
            w.run_copy(),
            "--data",
            w.file("long.jsonl", json.dumps({"instruction": "word " * 200, "response": "ok"}) + "\n"),
        ],  # fmt: skip
        "fill the whole sequence of 64 tokens; use shorter records, or train with a longer model.seq_len",
        command="eval",
    ),
    Case(
        "eval-data-of-chat-records",
        lambda w: ["--run", w.run_copy(), "--data", w.file("c.jsonl", json.dumps(chat(0)) + "\n")],
        "holds chat records, which this run's template, dolly, cannot render",
        command="eval",
    ),
    generate("generate-zero-tokens", ["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    generate("generate-temperature-zero", ["--temperature", "0"], "leave --temperature out to decode greedily"),
    generate("generate-negative-tokens", ["--max-new-tokens", "-5"], "--max-new-tokens must be at least 1"),
    Case("generate-empty-prompt", lambda w: ["--run", w.run_copy(), "--prompt", ""], "--prompt is empty", "generate"),
    generate("generate-tokens-not-int", ["--max-new-tokens", "x"], "invalid value for '--max-new-tokens'"),
    generate(
        "generate-system-without-chat",
        ["--system", "Be brief."],
        "--system needs a chat template, and the run's is dolly",
    ),
    generate(
        "generate-raw-with-system",
        ["--raw", "--system", "Be brief."],
        "--raw sends the prompt as is; put the system prompt",
    ),
    Case(
        "generate-tools-not-json",
        lambda w: ["--run", w.run_copy(), "--prompt", "hi", "--tools", w.file("t.json", "{no")],
        "t.json is not JSON; give a list of tool schemas",
        "generate",
    ),
    Case(
        "generate-tools-not-schemas",
        lambda w: ["--run", w.run_copy(), "--prompt", "hi", "--tools", w.file("t.json", '[{"x": 1}]')],
        "tools[0] is not a tool schema",
        "generate",
    ),
    Case(
        "generate-tools-missing",
        lambda w: ["--run", w.run_copy(), "--prompt", "hi", "--tools", w.tmp / "none.json"],
        "none.json: cannot read it",
        "generate",
    ),
    Case(
        "generate-tools-without-tool-template",
        lambda w: [
            "--run",
            w.run_copy(),
            "--prompt",
            "hi",
            "--tools",
            w.file("t.json", '[{"name": "weather", "parameters": {"type": "object"}}]'),
        ],
        "--tools needs a template that declares tools (gemma4-chat), and the run's is dolly",
        "generate",
    ),
    # Checkpoints and resume.
    gemma("checkpoint-every-zero", ["--checkpoint-every", "0"], "checkpoint every must be at least 1"),
    gemma("keep-checkpoints-zero", ["--keep-checkpoints", "0"], "keep checkpoints must be at least 1"),
    gemma("time-limit-garbage", ["--time-limit", "soon"], "time limit 'soon' is not a duration"),
    gemma("time-limit-zero", ["--time-limit", "0m"], "time limit '0m' is not a duration"),
    Case("output-name-too-long", lambda w: ["--output", w.tmp / ("r" * 256)], "too long"),
    resume("resume-torn-checkpoint", _break_checkpoints("torn"), "no checkpoint there can be loaded"),
    resume("resume-corrupt-checkpoint", _break_checkpoints("corrupt"), "does not match its checksum"),
    resume("resume-other-rank", lambda w: ["--resume", "--rank", "8", "--output", _unfinished(w)], "lora.rank=4"),
    resume(
        "resume-other-template",
        lambda w: ["--resume", "--template", "alpaca", "--output", _unfinished(w)],
        "data.template='dolly'",
    ),
    resume(
        "resume-changed-data",
        lambda w: ["--resume", "--data", w.good, "--output", _unfinished(w)],
        "differ from those the checkpoint was trained on",
    ),
    resume(
        "resume-other-packing",
        lambda w: ["--resume", "--packing", "off", "--output", _unfinished(w)],
        "data.packing='on', this run asks for 'off'",
    ),
    resume(  # the method first: the checkpoint's settings are its method's, which another's checks would name
        "resume-other-method",
        lambda w: ["--resume", "--method", "orpo", "--output", _unfinished(w)],
        "trained with train.method='sft', this run asks for 'orpo'",
    ),
    gemma("unknown-packing", ["--packing", "sometimes"], "unknown packing 'sometimes'"),
    Case(
        "output-holds-unfinished-run",
        lambda w: ["--output", _unfinished(w)],
        "holds an unfinished run, checkpointed at step 1",
        setup=None,
    ),
    gemma("threads-zero", ["--threads", "0"], "threads must be at least 1"),
    Case(
        "chat-with-dolly-template",  # a template the user gave that cannot render the data (auto would pick chat)
        lambda w: [
            "--template",
            "dolly",
            "--data",
            w.file(
                "chat.jsonl",
                '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n',
            ),
        ],
        "holds chat records (turns); train them with --template gemma-chat",
    ),  # fmt: skip
    data("json-array-empty", "[]", "the JSON array is empty"),
    data(
        "json-array-broken", '[{"instruction": "a", "response": "b"},', "a file starting with [ must be one JSON array"
    ),
    data(
        "alpaca-no-output", '{"instruction": "a", "input": "", "output": "b"}\n{"instruction": "c"}\n', "Alpaca format"
    ),
    gemma("remat-unknown", ["--remat", "sometimes"], "unknown remat 'sometimes'"),
    gemma("quantize-unknown", ["--quantize", "fp3"], "unknown quantize mode 'fp3'"),
    Case(
        "data-missing-file", lambda w: [w.tmp / "none.jsonl", "--preset", "tiny"], "none.jsonl does not exist", "data"
    ),
    Case("data-unknown-template", lambda w: [w.good, "--template", "chatml"], "unknown template 'chatml'", "data"),
    Case(
        "data-example-out-of-range", lambda w: [w.good, "--preset", "tiny", "--example", "13"], "--example 13", "data"
    ),
    Case("data-seq-len-tiny", lambda w: [w.good, "--seq-len", "2"], "--seq-len must be at least 8", "data"),
    Case(
        "data-text-with-dolly",
        lambda w: [w.file("t.jsonl", '{"text": "a"}\n'), "--template", "dolly"],
        "use --template none",
        "data",
    ),
    Case(
        "csv-open-quote",
        lambda w: ["--data", w.file("open.csv", 'instruction,response\na,b\n"c,d\n')],
        "open.csv:3: not valid CSV",
    ),
    Case("parquet-damaged", lambda w: ["--data", w.file("bad.parquet", "PAR1xx")], "cannot read this Parquet file"),
    data("no-known-format", '{"question": "a", "answer": "b"}\n', "is in no format finetune reads"),
    bench("bench-unknown-arch", ["--arch", "gemma-70b"], "unknown arch 'gemma-70b'"),
    bench("bench-unknown-backend", ["--backends", "mxnet"], "unknown backend 'mxnet'"),
    bench("bench-unknown-lever", ["--levers", "turbo"], "unknown lever 'turbo'"),
    bench("bench-unknown-recipe", ["--recipes", "trl"], "unknown recipe 'trl'"),
    bench("bench-no-recipe", ["--recipes", ""], "nothing to run"),
    bench("bench-no-backend", ["--backends", ""], "nothing to run"),
    Case(
        "bench-bad-tokenizer",
        lambda w: ["--tokenizer", w.file("bad.spm", "not a model")],
        "bad.spm is not a SentencePiece model",
        "bench",
    ),
    bench("bench-zero-steps", ["--steps", "0"], "--steps must be at least 1"),
    Case("bench-missing-tokenizer", lambda w: ["--tokenizer", w.tmp / "no.spm"], "no.spm does not exist", "bench"),
    Case("bench-missing-data", lambda w: ["--data", w.tmp / "none.jsonl"], "none.jsonl", "bench"),
    Case("bench-json-folder-missing", lambda w: ["--json", w.out / "rows.json"], "its folder does not exist", "bench"),
]


def advised(message: str, command: str) -> dict[str, set]:
    """The flags a message names, by the command they are for: the one that printed it, or one the message spells
    out (`retrain it with: finetune gemma --recipe R`) for the flags after it."""
    found = {}
    for i, part in enumerate(re.split(rf"\bfinetune ({'|'.join(OPTIONS)})\b", message)):
        if i % 2 == 1:
            command = part
        else:
            found.setdefault(command, set()).update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", part))
    return found


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory):
    """Two real tiny runs (LoRA rank 4 and 2), one step each, that the run cases copy and break."""
    root = tmp_path_factory.mktemp("runs")
    records = write_jsonl(root / "records.jsonl", make_records(24))
    runs = {}
    for name, rank in (("rank4", 4), ("rank2", 2)):
        runs[name] = root / name
        args = ["--preset", "tiny", "--backend", BACKEND, "--seq-len", 64, "--batch-size", 2, "--max-steps", 1]
        args += ["--set", "train.samples=0", "--rank", rank, "--data", records, "--output", runs[name]]
        result = invoke("gemma", *args)
        assert result.exit_code == 0, result.output
    return runs


def test_the_corpus_is_large_and_its_names_unique():
    names = [case.name for case in CASES]
    assert len(names) == len(set(names)) and len(names) >= 40


@pytest.mark.backend_neutral  # the refusals are Python, before or after a model is built
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_exits_2_with_a_message_and_writes_nothing(case, tmp_path, tiny_args, monkeypatch, request):
    uses_runs = case.command != "gemma" or not case.prefix or case.name.startswith("output-holds")
    runs = request.getfixturevalue("trained_runs") if uses_runs else {}
    cwd = tmp_path / "cwd"  # an empty --output must not write the run into the current directory
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    where = Where(tmp_path, write_jsonl(tmp_path / "good.jsonl", make_records(12)), tmp_path / "run", runs, monkeypatch)
    if case.setup:
        case.setup(where)
    args = [case.command, *case.args(where)]
    if case.command == "gemma" and case.prefix:
        args[1:1] = [*tiny_args, "--data", where.good, "--output", where.out]
    copies = sorted(p for p in tmp_path.iterdir() if p.name.startswith("copy-of-"))
    before = {p: sorted(q.relative_to(p) for q in p.rglob("*")) for p in copies}
    result = invoke(*args)
    message = result.stderr.strip()
    assert result.exit_code == 2, result.output
    assert message.startswith("error: ") and case.expected in message, message
    assert len(message.splitlines()) <= 2, message
    assert "Traceback" not in result.output
    for command, flags in advised(message, case.command).items():
        unknown = flags - OPTIONS[command] - {str(a) for a in args}  # a flag typed may be named, as click does
        assert not unknown, f"{command} takes no {unknown}: {message}"
    assert not where.out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run")]
    assert not list(cwd.iterdir())
    for copy, listing in before.items():  # a refused resume or eval writes nothing into the run either
        assert sorted(q.relative_to(copy) for q in copy.rglob("*")) == listing, copy


# Odd but valid: these must load, not be refused.
def _valid(line_ending="\n", bom=b""):
    records = make_records(3)
    records[1]["response"] = "one\u2028two\u2029three"  # raw separators: valid JSON, but str.splitlines splits there
    text = line_ending.join(json.dumps(r, ensure_ascii=False) for r in records) + line_ending
    return records, bom + text.encode("utf-8")


@pytest.mark.parametrize(
    "line_ending, bom", [("\n", b""), ("\r\n", b""), ("\n", b"\xef\xbb\xbf"), ("\r\n", b"\xef\xbb\xbf")]
)
def test_odd_but_valid_data_loads(tmp_path, line_ending, bom):
    from finetune.data import formats

    records, raw = _valid(line_ending, bom)
    path = tmp_path / "odd.jsonl"
    path.write_bytes(raw)
    loaded = formats.load_records(str(path))
    assert [r.response for r in loaded] == [r["response"] for r in records]
    assert [r.instruction for r in loaded] == [r["instruction"] for r in records]


def test_a_10_mb_record_loads_and_is_cut_before_tokenizing(tmp_path):
    """Tokenizing the whole 10 MB took 6.8 s for 65 kept ids; only a short head need be tokenized."""
    from finetune.data import batching, formats
    from finetune.model import presets

    text = "x" * 10_000_000  # one long word: the slowest case for SentencePiece
    path = write_jsonl(tmp_path / "long.jsonl", [{"instruction": "Repeat x.", "response": text}])
    (record,) = formats.load_records(str(path))
    assert len(record.response) == 10_000_000
    tokenizer = presets.tiny_tokenizer()
    seen = []

    class Recording:
        def token_to_id(self, token):
            return tokenizer.token_to_id(token)

        def tokenize(self, texts):
            seen.extend([texts] if isinstance(texts, str) else texts)
            return tokenizer.tokenize(texts)

    (example,), dropped = batching.tokenize([("Instruction: Repeat x.\n", record.response)], Recording(), 64)
    assert not dropped and len(example.token_ids) == 65
    assert max(len(t) for t in seen) <= 32 * 65  # never the whole record


def test_cutting_long_texts_keeps_the_same_tokens():
    from finetune.data import batching
    from finetune.model import presets

    tokenizer = presets.tiny_tokenizer()
    rng = np.random.default_rng(0)
    words = ["the", "Hanoi", "capital", "of", "é", "日本", "  ", "\n", "x" * 40, "12345", "<eos>"]
    for seq_len in (16, 64):
        for _ in range(3):
            text = " ".join(rng.choice(words, size=4000))
            cut, _ = batching.tokenize([("Q: ", text)], tokenizer, seq_len)
            whole = batching._ids(tokenizer, ["Q: ", text])
            assert cut[0].token_ids == [batching.BOS, *whole[0], *whole[1], batching.EOS][: seq_len + 1]


@pytest.mark.parametrize(
    "text",
    [
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 bytes.",
        "Out of memory while trying to allocate 4294967296 bytes.",
        "CUDA out of memory. Tried to allocate 2.00 GiB",
        "ResourceExhaustedError: OOM when allocating tensor with shape[4,256,256000]",
    ],
)
def test_out_of_memory_is_recognised_on_every_backend(text):
    from finetune.platform import backend

    assert backend.is_out_of_memory(RuntimeError(text))
    assert not backend.is_out_of_memory(ValueError("shapes (2, 3) and (4, 5) do not match"))


def test_backend_flag_beats_keras_backend_with_a_note(monkeypatch):
    seen = {}
    monkeypatch.setattr(finetune, "run_as_command", lambda cfg, **kwargs: seen.setdefault("cfg", cfg))
    other = next(b for b in ("jax", "torch", "tensorflow") if b != BACKEND)
    monkeypatch.setenv("KERAS_BACKEND", other)
    result = invoke("gemma", "--preset", "tiny", "--backend", BACKEND)
    assert result.exit_code == 0, result.output
    assert seen["cfg"].backend == BACKEND
    notes = [line for line in result.output.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and f"KERAS_BACKEND={other}" in notes[0] and f"--backend {BACKEND}" in notes[0]


def test_usage_errors_are_one_line_and_help_still_works():
    result = invoke("gemma", "--rank", "nan")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "error: invalid value for '--rank': 'nan' is not a valid integer"
    assert len(lines) == 2 and lines[1].startswith("see ") and lines[1].endswith("gemma --help")
    assert invoke("--help").exit_code == 0
    assert "Usage" in invoke("gemma", "--help").output
    bare = invoke()  # no arguments: the help, as before
    assert "gemma" in bare.output and "Commands" in bare.output
    assert invoke("gemmma").stderr.startswith("error: no such command 'gemmma'")
    missing = invoke("generate", "--prompt", "hi")
    assert missing.exit_code == 2 and missing.stderr.startswith("error: missing option '--run'")


def test_finite_checks_cover_every_float_key():
    from finetune import config

    for key in ("train.learning_rate", "lora.alpha", "data.eval_fraction", "train.xla_mem_fraction"):
        for value in (math.inf, -math.inf, math.nan):
            with pytest.raises(finetune.UserError, match="finite"):
                config.load(None, {key: value})


def test_no_keras_backend_note_without_a_conflict(monkeypatch):
    monkeypatch.setattr(finetune, "run_as_command", lambda cfg, **kwargs: None)
    monkeypatch.setenv("KERAS_BACKEND", BACKEND)
    result = invoke("gemma", "--preset", "tiny", "--backend", BACKEND)
    assert result.exit_code == 0 and "note:" not in result.output
    monkeypatch.delenv("KERAS_BACKEND")
    assert "note:" not in invoke("gemma", "--preset", "tiny", "--backend", BACKEND).output
