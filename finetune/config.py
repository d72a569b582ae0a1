"""The run's typed configuration: defaults < recipe YAML < --set < named flags.

Pure Python and YAML, no keras: the config is read before the backend is
chosen. `load()` refuses unknown keys and wrong types with a message that
names the key, so a typo in a recipe never silently falls back to a default.

Each option is declared once, as a field made by `setting()`: its type,
default, help, flag, help panel, choices and range. The recipe key is the
field's dotted path; cli.py derives the flags and their --help from the same
declarations, `validate` runs the checks they name, and `documented` writes
each section's `Args:` docstring from them. Adding an option is one field.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from finetune.data.formats import SAMPLE
from finetune.data.templates import TEMPLATES
from finetune.model.families import IMAGE_TOKENS, expert_conflicts
from finetune.model.presets import LEARNING_RATE, TINY_NAMES
from finetune.platform.backend import DEFAULT_BATCH_SIZE
from finetune.platform.errors import UserError

BACKENDS = ("jax", "torch", "tensorflow")
PRECISIONS = ("auto", "bfloat16", "float16", "float32", "mixed_bfloat16")
PACKING = ("auto", "on", "off")
QUANTIZE = ("int4", "int8")
PARALLEL = ("none", "data", "model")
REMAT = ("auto", "on", "off")
# transformers' schedule names (model/optimizer.py implements them; a test keeps the two lists equal).
LR_SCHEDULES = ("constant", "linear", "cosine", "cosine_with_min_lr")
TRACKERS = ("tensorboard", "mlflow", "wandb", "none")
# The training methods: SFT's token loss, a preference loss over (chosen, rejected) pairs (docs/preference.md),
# online RL on prompts with reward functions (docs/rl.md), or a reward model on pairs (docs/reward.md).
# methods/registry.py's names (a test keeps the two equal).
METHODS = ("sft", "dpo", "ipo", "orpo", "simpo", "grpo", "rloo", "reward", "classify")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")  # TRL's GRPOConfig.loss_type values we train
SCALE_REWARDS = ("group", "batch", "none")  # TRL's GRPOConfig.scale_rewards values

# The panels of `finetune gemma --help`, in the order the fields below first name them.
MODEL, LORA, DATA, TRAINING, EVALUATION, OUTPUT, SCALE_OUT = (
    "Model", "LoRA", "Data", "Training", "Evaluation", "Output and checkpoints", "Scale out"
)  # fmt: skip


@dataclass(frozen=True)
class Range:
    """The numbers a setting may take: from `low` to `high` (None: unbounded), each end excluded when open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def rule(self) -> str:
        """In words, for messages: must be at least 1, must be positive, must be in (0, 1], ..."""
        if self.high is None:
            if self.low == 0:
                return "must be positive" if self.low_open else "must not be negative"
            return f"must be {'more than' if self.low_open else 'at least'} {self.low}"
        if self.low_open == self.high_open:
            return f"must be between {self.low} and {self.high}{' (exclusive)' if self.low_open else ''}"
        return f"must be in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"


@dataclass(frozen=True)
class Setting:
    """One option as its field declares it (see `setting`), found at its dotted key.

    key: str. The recipe key: `lora.rank`; `--set` takes the same.
    type: the field's annotation, which `load` checks values against.
    default: the field's default (its factory's value for lists and the backend).
    help: str. One text for the flag's --help and the section's docstring.
    flag: str or None. The command-line flag (`--rank`); None: a recipe key and --set only.
    panel: str or None. The --help panel the flag is listed under.
    metavar: str or None. What --help shows the flag takes; choices show as `a|b|c` without one.
    choices: tuple. The values allowed, checked and shown.
    range: Range or None. The numbers allowed, checked.
    check: a function (value, name) -> a message, or None when the value is fine; for rules a range cannot say.
    hint: str. Added to any refusal of this setting: how to fix it (`try --rank 4`).
    label: str or None. What messages call the setting; by default its name, in words.
    default_text: str or None. The default in words, where the value alone would mislead (None, computed).
    env: str or None. The environment variable the default comes from, which messages name.
    whole: bool. A list flag's every value is one item, never split at commas (a regex may hold them).
    """

    key: str
    type: Any
    default: Any
    help: str
    flag: Optional[str] = None
    panel: Optional[str] = None
    metavar: Optional[str] = None
    choices: tuple = ()
    range: Optional[Range] = None
    check: Optional[Callable[[Any, str], Optional[str]]] = None
    hint: str = ""
    label: Optional[str] = None
    default_text: Optional[str] = None
    env: Optional[str] = None
    whole: bool = False

    @property
    def name(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    def default_words(self) -> str | None:
        """The default as --help and the docstrings state it; None where there is nothing to say (a switch)."""
        if self.default_text is not None:
            return self.default_text
        if self.default is None or isinstance(self.default, bool):
            return None
        if isinstance(self.default, list):
            return ",".join(map(str, self.default)) or "none"
        return str(self.default)

    def problem(self, value, name: str | None = None) -> str | None:
        """What is wrong with `value` for this setting, as a message for people; None when nothing is (None, the
        value of a setting left unset, passes every check).

        name: what the message calls the setting; by default its label.
        """
        if value is None:
            return None
        name = name or self.label or self.name.replace("_", " ")
        if isinstance(value, str) and not value.strip():
            # An empty string, as from an unset shell variable, would mean the current directory for a path.
            return f"{self.flag or self.key} is empty; {self.hint or 'give it a value, or leave it out'}"
        if isinstance(value, float) and not math.isfinite(value):
            # NaN passes no range check's `not` and inf passes `> 0`: refuse both first.
            return f"config key {self.key!r} must be a finite number, got {value}"
        message = None
        if self.choices and value not in self.choices:
            source = f" (from {self.env})" if self.env and value == os.environ.get(self.env) else ""
            message = f"unknown {name} {value!r}{source}; choose one of {', '.join(self.choices)}"
        elif self.range is not None and value not in self.range:
            message = f"{name} {self.range.rule()}, got {value}"
        elif self.check is not None:
            message = self.check(value, name)
        return f"{message}; {self.hint}" if message and self.hint else message


def setting(default: Any = dataclasses.MISSING, help: str = "", **declared) -> Any:
    """A config field that declares its option once: `rank: int = setting(4, "LoRA rank.", flag="--rank")`.

    declared: the rest of `Setting` (flag, panel, metavar, choices, range, check, hint, label,
        default_text, env). A list default is copied for each instance; a callable one is a factory.
    """
    metadata = {"setting": dict(help=help, **declared)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def settings(cls, prefix: str = "") -> Iterator[Setting]:
    """Every setting of dataclass `cls` and of its sections, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from settings(hint, f"{prefix}{f.name}.")
        elif "setting" in f.metadata:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            yield Setting(key=prefix + f.name, type=hint, default=default, **f.metadata["setting"])


def documented(cls):
    """`cls` with an `Args:` section in its docstring (keras-hub's style), written from its fields' settings."""
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            summary = (hints[f.name].__doc__ or "").strip().splitlines()[0]
            entry = f"{f.name}: {hints[f.name].__name__}. {summary}"
        else:
            (item,) = (s for s in settings(cls) if s.key == f.name)
            entry = f"{f.name}: {_type_words(item.type)}. {item.help}"
            entry += "".join(
                f" {what}: {words}."
                for what, words in (("Default", item.default_words()), ("Flag", item.flag))
                if words
            )
        # A flag is never cut at its hyphens: "Flag: --normalize-advantages." stays whole
        lines += textwrap.wrap(entry, 100, initial_indent="    ", subsequent_indent="        ", break_on_hyphens=False)
    cls.__doc__ = f"{(cls.__doc__ or '').rstrip()}\n\nArgs:\n" + "\n".join(lines) + "\n"
    return cls


def _type_words(hint) -> str:
    """An annotation as an `Args:` entry starts: int, float or None, list of str."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_words(a) for a in typing.get_args(hint))
    if origin is list:
        return f"list of {_type_words(typing.get_args(hint)[0])}"
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


# Checks that a range or a list of choices cannot say; each returns what is wrong, or None.


def _not_empty(value: list, name: str) -> str | None:
    return None if value else f"{name} must not be empty"


def _not_blank(value: str, name: str) -> str | None:
    return None if str(value).strip() else f"{name} must not be empty"


def _positive_or_auto(value, name: str) -> str | None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    return f"{name} must be a positive integer or `auto`, got {value!r}"


def _norm_or_none(value, name: str) -> str | None:
    if value == "none" or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
        return None
    return f"{name} must be a number at least 0, or `none` (0 and none turn clipping off), got {value!r}"


def _new_tokens(value: list, name: str) -> str | None:
    """--add-tokens: each token a non-empty piece of text without whitespace, named once (model/tokens.py then
    refuses one its tokenizer has as a piece already)."""
    seen = set()
    for token in value:
        if not isinstance(token, str) or not token.strip():
            return f"{name} has an empty token; write them like --add-tokens '<tool>,<sym>'"
        if any(c.isspace() for c in token):
            return f"{name} {token!r} holds whitespace; a new token is one piece of text without spaces"
        if token in seen:
            return f"{name} names {token!r} twice; name each token once"
        seen.add(token)
    return None


def _image_budget(value: int, name: str) -> str | None:
    if value in IMAGE_TOKENS:
        return None
    return f"{name} must be one of {', '.join(map(str, IMAGE_TOKENS))}, Gemma 4's budgets, got {value}"


def _trackers(value: list, name: str) -> str | None:
    unknown = [v for v in value if v not in TRACKERS]
    if unknown:
        return f"unknown {name} {unknown[0]!r}; choose from {', '.join(TRACKERS)}"
    if "none" in value and len(value) > 1:
        return f"{name} `none` leaves out every tracker, so it goes alone; drop it or the others"
    return None


def _duration_or_off(value: str, name: str) -> str | None:
    if value == "off":
        return None
    try:
        if parse_duration(value) > 0:
            return None
    except ValueError:
        pass
    return f"{name} {value!r} is not a duration; write it like 11h30m, 90m or 3600s (or `off`)"


@documented
@dataclass
class ModelConfig:
    """The model: the preset, the sequence length and how the frozen base is stored."""

    preset: str = setting(
        "gemma_2b_en",
        "keras-hub preset name (gemma_2b_en, gemma2_2b_en, gemma3_1b, gemma4_instruct_4b, gemma3n_e2b), "
        "kaggle:// handle, local preset directory, transformers checkpoint (a directory with config.json and "
        f"safetensors, or hf://ORG/NAME), or {TINY_NAMES}.",
        flag="--preset", panel=MODEL, metavar="NAME|DIR", hint=f"pass a preset name such as gemma_2b_en, or {TINY_NAMES}",
    )  # fmt: skip
    seq_len: int = setting(
        256,
        "Tokens per training sequence; longer records are cut (the Keras tutorial's 256).",
        flag="--seq-len", panel=MODEL, range=Range(8), label="seq-len", hint="256 is typical",
    )  # fmt: skip
    precision: str = setting(
        "auto",
        "The frozen base's dtype; LoRA factors and their optimizer state are float32 in every case. auto is "
        "bfloat16 on a TPU, a bf16 GPU (A100, L4, H100) or a CPU with bf16 units (AVX512-BF16 or AMX), float16 on "
        "other GPUs (T4, V100) but float32 for Gemma 3, 3n and 4 (their activations pass float16's range), else "
        "float32; mixed_bfloat16 keeps the base in float32 and computes in bf16 "
        "(Keras' mixed precision: twice the memory).",
        flag="--precision", panel=MODEL, choices=PRECISIONS,
    )  # fmt: skip
    quantize: Optional[str] = setting(
        None,
        "int4 or int8: the frozen base's decoder kernels are built quantized and filled layer by layer, so the "
        "float base never exists in memory (QLoRA-like); the embedding keeps the precision's dtype and LoRA "
        "float32.",
        flag="--quantize", panel=MODEL, choices=QUANTIZE, default_text="none", label="quantize mode",
        hint="leave it out for none",
    )  # fmt: skip
    remat: str = setting(
        "auto",
        "Recompute each decoder block's activations in the backward pass instead of keeping them: on, off, or "
        "auto (on when the plan says the run would not fit the device's memory without it).",
        flag="--remat", panel=MODEL, choices=REMAT,
    )  # fmt: skip
    full: bool = setting(
        False,
        "Train every weight of the language model instead of LoRA factors (its image and audio encoders stay "
        "frozen): the run saves the whole model (model.weights.h5), not an adapter. Its weights and AdamW's state "
        "are float32 (auto precision computes in bf16 where the device has it: mixed_bfloat16). For small models "
        "(the tiny presets, gemma3-270m, gemma3-1b); not with --quantize, DoRA or other LoRA settings.",
        flag="--full", panel=MODEL, default_text="LoRA",
    )  # fmt: skip
    add_tokens: list[str] = setting(
        [],
        "New tokens, each one id from now on (a tool marker, a domain symbol): a Gemma tokenizer's <unusedN> "
        "pieces are renamed (the vocabulary keeps its size), or pieces appended where it has none left; their "
        "embedding rows train beside LoRA, starting from the mean of their text's pieces' rows, and every other "
        "row stays as it was.",
        flag="--add-tokens", panel=MODEL, metavar="TOKEN,...", check=_new_tokens, default_text="none",
        label="--add-tokens",
    )  # fmt: skip

    def conflicts(self, cfg: Config) -> Iterator[str]:
        """An int8 base in float16 (keras refuses it); what --full rules out: a quantized or 16-bit stored base,
        LoRA's settings, model parallelism."""
        if self.quantize == "int8" and self.precision == "float16":
            yield ("--quantize int8 with --precision float16 is not supported: keras' int8 layers do not compute in "
                   "float16; pass --precision bfloat16, float32 or auto (which picks float32 for an int8 base where "
                   "it would pick float16)")  # fmt: skip
        if not self.full:
            return
        if self.quantize is not None:
            yield (
                f"--full with --quantize {self.quantize} is not supported: a quantized kernel cannot take AdamW's "
                "updates; drop --quantize to train every weight, or drop --full to train LoRA on the quantized base"
            )
        if self.precision in ("bfloat16", "float16"):
            yield (
                f"--full with --precision {self.precision} is not supported: AdamW's small updates round away in "
                "16-bit weights; pass --precision mixed_bfloat16 (float32 weights, computed in bf16), float32, or "
                "auto"
            )
        default = LoraConfig()
        for item in settings(LoraConfig, "lora."):
            name = item.key.split(".")[-1]
            if getattr(cfg.lora, name) != getattr(default, name):
                flag = item.flag or f"--set {item.key}"
                yield (
                    f"--full trains every weight, so {flag} ({item.key}: {getattr(cfg.lora, name)!r}) is a LoRA "
                    f"setting it cannot take; drop {item.key} (from the recipe or the command), or drop --full"
                )
        if cfg.distribution.parallel == "model":
            yield (
                "--full with --parallel model is not supported yet: only LoRA runs are built and tested sharded over "
                "a model axis; use --parallel data, or drop --full"
            )


@documented
@dataclass
class LoraConfig:
    """LoRA: which layers adapt, and at what rank and scale."""

    rank: int = setting(
        4,
        "Rank of the LoRA factors: higher adapts more and costs more memory.",
        flag="--rank", panel=LORA, range=Range(1), label="LoRA rank", hint="try --rank 4",
    )  # fmt: skip
    alpha: Optional[float] = setting(
        None,
        "LoRA alpha: the update is scaled by alpha / rank.",
        flag="--alpha", panel=LORA, range=Range(0, low_open=True), label="LoRA alpha",
        default_text="rank: a scale of 1, keras-hub's",
    )  # fmt: skip
    targets: list[str] = setting(
        ["query", "value"],
        "Names of the layers to adapt (Gemma: query, key, value, attention_output, ffw_*), PEFT's names for them "
        "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or all-linear for every one; experts "
        "for each expert's gate, up and down projections in a mixture-of-experts Gemma 4 (PEFT's "
        "target_parameters experts.gate_up_proj and experts.down_proj).",
        flag="--target", panel=LORA, metavar="LAYER", check=_not_empty, label="LoRA targets",
        hint="name a layer to adapt, e.g. --target query --target value",
    )  # fmt: skip
    dropout: float = setting(
        0.0,
        "Dropout on the LoRA branch's input while training (PEFT's lora_dropout); none at eval or generation.",
        flag="--lora-dropout", panel=LORA, metavar="P", range=Range(0, 1, high_open=True), label="LoRA dropout",
        hint="try --lora-dropout 0.05",
    )  # fmt: skip
    rslora: bool = setting(
        False,
        "Rank-stabilised LoRA: scale the update by alpha / sqrt(rank) instead of alpha / rank (PEFT's use_rslora).",
        flag="--rslora", panel=LORA, default_text="alpha / rank",
    )  # fmt: skip
    dora: bool = setting(
        False,
        "DoRA: a trainable magnitude per output times the direction of W + the LoRA update (PEFT's use_dora); not "
        "on a --quantize base.",
        flag="--dora", panel=LORA, default_text="plain LoRA",
    )  # fmt: skip
    plus_ratio: Optional[float] = setting(
        None,
        "LoRA+: the B factors (and DoRA's magnitudes, as PEFT) learn at this many times the A factors' learning rate "
        "(the paper suggests 16).",
        flag="--lora-plus-ratio", panel=LORA, metavar="R", range=Range(0, low_open=True), label="LoRA+ ratio",
        default_text="off: one learning rate", hint="try --lora-plus-ratio 16",
    )  # fmt: skip

    def resolved_alpha(self) -> float:
        """alpha, or the rank where it is unset (a scale of 1 without rslora, keras-hub's)."""
        return float(self.alpha if self.alpha is not None else self.rank)

    def scale(self) -> float:
        """What the LoRA update is multiplied by: alpha / rank, or alpha / sqrt(rank) with rslora (PEFT's)."""
        return self.resolved_alpha() / (math.sqrt(self.rank) if self.rslora else self.rank)

    def conflicts(self, cfg: Config) -> Iterator[str]:
        """What these settings rule out with the model's, and with LoRA on the experts."""
        yield from expert_conflicts(self.targets, self.dora, self.dropout)
        if self.dora and cfg.model.quantize is not None:
            yield (
                f"--dora with --quantize {cfg.model.quantize} is not supported: DoRA normalises the whole kernel "
                "every step, and a quantized base would be dequantized each time; drop one of them"
            )


@documented
@dataclass
class DataConfig:
    """The data: where the records are, how they become prompts, and what is held out."""

    path: str = setting(
        SAMPLE,
        "Records: JSONL, a JSON array, CSV or Parquet (a path or gs://), hf:NAME[:CONFIG] for a Hugging Face "
        "dataset (its --data-split), or "
        "`sample` (400 Dolly records shipped with finetune); Dolly, Alpaca, chat, ShareGPT, "
        "prompt/completion or text records, detected. Check a file with `finetune data FILE`.",
        flag="--data", panel=DATA, metavar="FILE|sample|hf:NAME", hint="pass a data file, hf:NAME or sample",
    )  # fmt: skip
    split: str = setting(
        "train",
        "With --data hf:NAME[:CONFIG]: the Hugging Face dataset's split to read (train, test, train[:1000], ...); "
        "finetune holds out its own evaluation share from it.",
        flag="--data-split", panel=DATA, metavar="SPLIT", check=_not_blank, hint="e.g. --data-split train",
    )  # fmt: skip
    template: str = setting(
        "auto",
        "Prompt template: auto follows the data (dolly for Dolly records, alpaca for Alpaca ones, the family's "
        "chat turns for chat and ShareGPT records, none for prompt/completion and text); or dolly (the Keras "
        "tutorial's), alpaca, gemma-chat, gemma4-chat, none.",
        flag="--template", panel=DATA, choices=("auto", *TEMPLATES),
    )  # fmt: skip
    drop_context: bool = setting(
        False,
        "Drop records that carry a context, as the Keras tutorial does to keep sequences short.",
        flag="--drop-context", panel=DATA,
    )  # fmt: skip
    categories: list[str] = setting(
        [], "Keep only these Dolly categories.", flag="--category", panel=DATA, metavar="NAME", default_text="all"
    )
    max_records: Optional[int] = setting(
        None,
        "Use at most this many records (after filters).",
        flag="--max-records", panel=DATA, range=Range(2), default_text="all", hint="one to train, one to evaluate",
    )  # fmt: skip
    eval_fraction: float = setting(
        0.05,
        "Share of records held out for evaluation (at least one record); 0 holds none out: with --eval-data that "
        "file is evaluated instead, without it evaluation is skipped.",
        flag="--eval-fraction", panel=DATA, range=Range(0, 1, high_open=True), hint="try 0.05",
    )  # fmt: skip
    train_on_prompt: bool = setting(
        False,
        "Also train on prompt tokens.",
        flag="--train-on-prompt", panel=DATA, default_text="response tokens only",
    )  # fmt: skip
    images: Optional[int] = setting(
        None,
        "Pictures per example that `finetune plan` (and --plan-only) counts: their soft tokens in each sequence, "
        "the vision encoder's pass over them. A run counts the most a record of --data holds, which wins.",
        flag="--images", panel=DATA, metavar="N", range=Range(0), default_text="the data's; 0 without it",
        label="images per example", hint="e.g. --images 1",
    )  # fmt: skip
    audio_seconds: Optional[float] = setting(
        None,
        "Seconds of audio per example (one clip) that `finetune plan` counts: its soft tokens in each sequence "
        "(Gemma 4: 25 a second) and its log-mel frames. A run counts the clips of --data.",
        flag="--audio-seconds", panel=DATA, metavar="S", range=Range(0, low_open=True), default_text="none",
        label="audio seconds per example", hint="e.g. --audio-seconds 10",
    )  # fmt: skip
    image_tokens: Optional[int] = setting(
        None,
        "Gemma 4: the soft tokens each picture takes in the sequence (70, 140, 280, 560 or 1120). Its image "
        "converter resizes a picture to at most that many tokens' patches: more tokens see finer detail, and take "
        "more of --seq-len and more memory and time in the vision encoder.",
        flag="--image-tokens", panel=DATA, metavar="N", check=_image_budget, default_text="the preset's",
        label="--image-tokens",
    )  # fmt: skip
    packing: str = setting(
        "auto",
        "Several examples per training row, each attending only to itself (exact): auto (on: every Gemma family "
        "finetune builds takes it, Gemma 4 and 3n included), on, or off (one example per row, padded, as the Keras "
        "tutorial does).",
        flag="--packing", panel=DATA, choices=PACKING,
    )  # fmt: skip


@documented
@dataclass
class TrainConfig:
    """Training: how long, how large a step, the optimizer, and the checkpoints."""

    epochs: int = setting(1, "Passes over the training split.", flag="--epochs", panel=TRAINING, range=Range(1))
    max_steps: Optional[int] = setting(
        None,
        "Train exactly this many optimizer steps, cycling the data as often as needed; overrides --epochs "
        "(as Hugging Face's max_steps does).",
        flag="--max-steps", panel=TRAINING, range=Range(1), default_text="--epochs passes",
    )  # fmt: skip
    batch_size: Union[int, str, None] = setting(
        None,
        "Sequences per micro-batch (per optimizer step without --grad-accum), or `auto` to probe the largest "
        "that fits.",
        flag="--batch-size", panel=TRAINING, metavar="N|auto", check=_positive_or_auto,
        default_text=", ".join(f"{backend} {size}" for backend, size in DEFAULT_BATCH_SIZE.items()),
    )  # fmt: skip
    learning_rate: Optional[float] = setting(
        None,
        "AdamW learning rate: the peak of --lr-schedule. The default is the low end of LoRA practice (1e-4 to "
        "2e-4), twice the Keras tutorial's 5e-5 (measured: model/presets.py).",
        flag="--lr", panel=TRAINING, range=Range(0, low_open=True),
        default_text=f"{LEARNING_RATE['pretrained']:g}; {LEARNING_RATE['tiny']:g} for tiny",
    )  # fmt: skip
    weight_decay: float = setting(
        0.01, "AdamW decay, not applied to biases and norm scales (the tutorial's recipe).", range=Range(0)
    )
    lr_schedule: str = setting(
        "constant",
        "Learning rate over the steps, as transformers' schedules: constant, linear (to 0), cosine (to 0) or "
        "cosine_with_min_lr (to min_lr_ratio of the peak), each after the warmup.",
        flag="--lr-schedule", panel=TRAINING, choices=LR_SCHEDULES, label="learning-rate schedule", metavar="NAME",
    )  # fmt: skip
    warmup_steps: Optional[int] = setting(
        None,
        "Optimizer steps of linear warmup from 0 (the first step trains at 0, as in transformers).",
        flag="--warmup-steps", panel=TRAINING, range=Range(0), default_text="0",
    )  # fmt: skip
    warmup_ratio: Optional[float] = setting(
        None,
        "Warmup as a share of the run's steps, rounded up; instead of --warmup-steps.",
        flag="--warmup-ratio", panel=TRAINING, range=Range(0, 1, high_open=True),
    )  # fmt: skip
    min_lr_ratio: float = setting(
        0.1, "cosine_with_min_lr's floor, as a share of the peak learning rate.", range=Range(0, 1)
    )
    grad_accum: int = setting(
        1,
        "Micro-batches per optimizer step: the step is the one --batch-size x K would make, the loss averaged "
        "over all their response tokens.",
        flag="--grad-accum", panel=TRAINING, metavar="K", range=Range(1), label="gradient accumulation",
    )  # fmt: skip
    group_by_length: bool = setting(
        False,
        "Batch examples of like length together (as transformers' group_by_length): each step's rows are drawn "
        "from a stretch of the epoch's shuffled order, longest first, so a batch cut to its longest row carries "
        "less padding. For --packing off, where each example is a row; packed rows are near full already.",
        flag="--group-by-length", panel=TRAINING, default_text="shuffled rows",
    )  # fmt: skip
    method: str = setting(
        "sft",
        "The objective: sft (the response tokens' cross-entropy), a preference loss on (prompt, chosen, "
        "rejected) pairs: dpo or ipo (against the base, scored once before training), orpo or simpo (no reference), "
        "grpo or rloo: online RL on prompts, scored by --reward functions, or reward: a reward model trained on the "
        "pairs.",
        flag="--method", panel=TRAINING, choices=METHODS, metavar="NAME",
    )  # fmt: skip
    beta: Optional[float] = setting(
        None,
        "The preference loss's beta: DPO's and SimPO's inverse temperature, IPO's regularisation tau, ORPO's "
        "lambda (the weight of its odds-ratio term); GRPO's KL weight, RLOO's KL penalty on the reward (0: no "
        "reference).",
        flag="--beta", panel=TRAINING, range=Range(0), metavar="B",
        default_text="dpo 0.1, ipo 0.1, orpo 0.1, simpo 2.0, grpo 0, rloo 0.05 (docs/preference.md, docs/rl.md)",
    )  # fmt: skip
    label_smoothing: Optional[float] = setting(
        None,
        "DPO only: the assumed share of pairs whose labels are flipped (cDPO's epsilon).",
        flag="--label-smoothing", panel=TRAINING, range=Range(0, 0.5, high_open=True), metavar="E",
        default_text="0",
    )  # fmt: skip
    simpo_gamma: Optional[float] = setting(
        None,
        "SimPO only: the target reward margin gamma.",
        flag="--simpo-gamma", panel=TRAINING, range=Range(0), metavar="G", default_text="0.5",
    )  # fmt: skip
    center_rewards: Optional[float] = setting(
        None,
        "Reward model only: TRL's center_rewards_coefficient, the weight of the squared sum of a pair's rewards "
        "in its loss, which keeps the rewards centred on 0.",
        flag="--center-rewards", panel=TRAINING, range=Range(0), metavar="C", default_text="0",
    )  # fmt: skip
    labels: list[str] = setting(
        [],
        "Classifier only: the classes, in order, one output of its head each; the run decides them from the "
        "training data's `label` values, sorted, and config.yaml records them.",
        flag="--labels", panel=TRAINING, metavar="LABEL", default_text="the data's", whole=True,
    )  # fmt: skip
    reward: list[str] = setting(
        [],
        "GRPO and RLOO: a reward function, FILE.py:FUNCTION or module:function, f(prompts, completions, **columns) -> "
        "list of float or None, as TRL's; or a built-in: format:REGEX, length[:TOKENS], exact, math (docs/rl.md).",
        flag="--reward", panel=TRAINING, metavar="SPEC", default_text="none", whole=True,
    )  # fmt: skip
    reward_weights: list[float] = setting(
        [],
        "GRPO and RLOO: each --reward's weight in the total reward, in order.",
        flag="--reward-weights", panel=TRAINING, metavar="W", default_text="1 each",
    )  # fmt: skip
    num_generations: Optional[int] = setting(
        None,
        "GRPO and RLOO: completions sampled for each prompt, the group its advantages are made in.",
        flag="--num-generations", panel=TRAINING, metavar="G", range=Range(2), default_text="grpo 8, rloo 2, as TRL",
    )  # fmt: skip
    max_completion_length: Optional[int] = setting(
        None,
        "GRPO and RLOO: the most tokens sampled for a completion.",
        flag="--max-completion-length", panel=TRAINING, metavar="N", range=Range(1), default_text="256",
    )  # fmt: skip
    temperature: Optional[float] = setting(
        None,
        "GRPO and RLOO: the sampling temperature of the rollouts (the log-probabilities are taken at it too, as TRL's).",
        flag="--temperature", panel=TRAINING, metavar="T", range=Range(0, low_open=True), default_text="1.0",
    )  # fmt: skip
    top_p: Optional[float] = setting(
        None,
        "GRPO and RLOO: nucleus sampling of the rollouts.",
        flag="--top-p", panel=TRAINING, metavar="P", range=Range(0, 1, low_open=True), default_text="1.0",
    )  # fmt: skip
    epsilon: Optional[float] = setting(
        None,
        "GRPO and RLOO: the clip range's lower side: the ratio is kept above 1 - epsilon.",
        flag="--epsilon", panel=TRAINING, metavar="E", range=Range(0, 1, low_open=True), default_text="0.2",
    )  # fmt: skip
    epsilon_high: Optional[float] = setting(
        None,
        "GRPO and RLOO: the clip range's upper side, 1 + epsilon_high (DAPO's paper: 0.28).",
        flag="--epsilon-high", panel=TRAINING, metavar="E", range=Range(0, low_open=True), default_text="--epsilon",
    )  # fmt: skip
    num_iterations: Optional[int] = setting(
        None,
        "GRPO and RLOO: optimizer steps on each batch of rollouts (mu).",
        flag="--num-iterations", panel=TRAINING, metavar="MU", range=Range(1), default_text="1",
    )  # fmt: skip
    loss_type: Optional[str] = setting(
        None,
        "GRPO: how the per-token losses are averaged: grpo (per sequence), dapo (per token of the step), "
        "dr_grpo (over rows x --max-completion-length), bnpo (per token of the micro-batch).",
        flag="--loss-type", panel=TRAINING, choices=LOSS_TYPES, metavar="NAME", default_text="dapo, as TRL",
    )  # fmt: skip
    scale_rewards: Optional[str] = setting(
        None,
        "GRPO: divide the advantages by the rewards' std in each group, the batch's, or not at all.",
        flag="--scale-rewards", panel=TRAINING, choices=SCALE_REWARDS, metavar="HOW", default_text="group",
    )  # fmt: skip
    normalize_advantages: Optional[bool] = setting(
        None,
        "RLOO: normalise the leave-one-out advantages over the batch to mean 0 and std 1 (TRL's "
        "normalize_advantages).",
        flag="--normalize-advantages", panel=TRAINING, default_text="off, as TRL",
    )  # fmt: skip
    max_grad_norm: Union[float, str] = setting(
        1.0,
        "Clip the gradients' global norm to this before each update (as torch's clip_grad_norm_); 0 or `none` "
        "turns it off. 1.0 as transformers' Trainer: it caps the rare spike, a LoRA step is rarely above it.",
        flag="--max-grad-norm", panel=TRAINING, metavar="X|none", check=_norm_or_none,
    )  # fmt: skip
    # The seeds of numpy and keras.utils.set_random_seed are 32-bit unsigned.
    seed: int = setting(
        0,
        "Seeds the split, the shuffling and the LoRA initialisation.",
        flag="--seed", panel=TRAINING, range=Range(0, 2**32 - 1), hint="try --seed 0",
    )  # fmt: skip
    neftune_alpha: Optional[float] = setting(
        None,
        "NEFTune: uniform noise on the token embeddings entering the first block while training, of size "
        "alpha / sqrt(tokens * width) for each row's non-padding tokens, as transformers' (the paper uses 5).",
        flag="--neftune-alpha", panel=TRAINING, metavar="A", range=Range(0), label="NEFTune alpha",
        default_text="off", hint="try --neftune-alpha 5",
    )  # fmt: skip
    embedding_lr: Optional[float] = setting(
        None,
        "With --add-tokens: the learning rate of the new tokens' embedding rows (Unsloth's "
        "embedding_learning_rate), on the same schedule as --lr.",
        flag="--embedding-lr", panel=TRAINING, range=Range(0, low_open=True), label="embedding learning rate",
        default_text="--lr",
    )  # fmt: skip
    xla_mem_fraction: float = setting(
        1.00,
        "JAX only: share of GPU memory XLA may take (XLA_PYTHON_CLIENT_MEM_FRACTION).",
        flag="--xla-mem-fraction", panel=TRAINING, range=Range(0, 1, low_open=True), label="XLA memory fraction",
    )  # fmt: skip
    compile: bool = setting(
        False,
        "Compile the train step further. PyTorch: each decoder block's pass with torch.compile, one graph a block "
        "forward and backward (Gemma 1 to 4; a block with LoRA dropout or remat, and Gemma 3n's, stay eager); "
        "TensorFlow: XLA (jit_compile). The first steps of each row length compile. JAX compiles every step "
        "already.",
        flag="--compile", panel=TRAINING,
    )  # fmt: skip
    threads: Optional[int] = setting(
        None,
        "PyTorch on a CPU: intra-op threads.",
        flag="--threads", panel=TRAINING, range=Range(1), default_text="the physical cores idle when the run starts",
        hint="leave it out to use the idle cores",
    )  # fmt: skip
    samples: int = setting(
        3, "Held-out prompts to generate from before and after training, into samples.md.", range=Range(0)
    )
    max_new_tokens: int = setting(48, "Tokens generated for each sample.", range=Range(1), hint="try 48")
    checkpoint_every: int = setting(
        100,
        "Save a resumable checkpoint every this many steps, at each epoch's end and after each evaluation.",
        flag="--checkpoint-every", panel=OUTPUT, range=Range(1), hint="try --checkpoint-every 100",
    )  # fmt: skip
    keep_checkpoints: int = setting(
        2,
        "How many of the newest checkpoints to keep; older ones are deleted.",
        flag="--keep-checkpoints", panel=OUTPUT, range=Range(1), hint="try --keep-checkpoints 2",
    )  # fmt: skip
    time_limit: Optional[str] = setting(
        None,
        "Stop with a checkpoint before this much time has passed: 11h30m, 90m, 3600s, or `off`. The run then exits "
        "75, and --resume continues it.",
        flag="--time-limit", panel=OUTPUT, metavar="DURATION", check=_duration_or_off, label="time limit",
        default_text="11h30m in a Kaggle notebook, whose sessions end at 12 hours; else off",
    )  # fmt: skip

    def conflicts(self) -> Iterator[str]:
        """What these settings rule out together."""
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            yield "--warmup-steps and --warmup-ratio both set the warmup; pass one of them"
        # A method's own constants (--beta, --label-smoothing, ...) are checked by the method (Method.decide).

    def clip_norm(self) -> float | None:
        """max_grad_norm as the optimizer takes it: None when clipping is off (0 or `none`)."""
        return None if self.max_grad_norm in ("none", 0) else float(self.max_grad_norm)


@documented
@dataclass
class EvalConfig:
    """Evaluation: how often the held-out records are scored, on what, and what the scores decide."""

    every: Optional[int] = setting(
        None,
        "Also evaluate the held-out records every this many steps (each epoch's end and the last step always are).",
        flag="--eval-every", panel=EVALUATION, metavar="N", range=Range(1), label="eval-every",
        default_text="each epoch's end",
        hint="try --eval-every 50",
    )  # fmt: skip
    keep_best: bool = setting(
        False,
        "Publish the adapter of the evaluation with the lowest held-out loss, not the last; metrics.json names "
        "its step (best_step).",
        flag="--keep-best", panel=EVALUATION,
    )  # fmt: skip
    early_stop: Optional[int] = setting(
        None,
        "Stop after this many evaluations in a row without a lower held-out loss, and publish the run.",
        flag="--early-stop", panel=EVALUATION, metavar="P", range=Range(1), default_text="off",
        label="early-stop patience", hint="try --early-stop 3 with --eval-every",
    )  # fmt: skip
    data: Optional[str] = setting(
        None,
        "Evaluate on this file's records (any format --data takes) instead of a share of --data; pass "
        "--eval-fraction 0 with it, so that every record of --data trains.",
        flag="--eval-data", panel=EVALUATION, metavar="FILE|hf:NAME", default_text="a share of --data",
        hint="pass a data file, or leave it out to hold out a share of --data",
    )  # fmt: skip

    def conflicts(self, cfg: Config) -> Iterator[str]:
        """What these settings rule out with the held-out share of --data."""
        held_out = self.data is not None or cfg.data.eval_fraction > 0
        if self.data is not None and cfg.data.eval_fraction > 0:
            yield (
                f"--eval-data {self.data} is the held-out set: pass --eval-fraction 0 with it, so that every record "
                "of --data trains"
            )
        for flag, value in (("--eval-every", self.every), ("--keep-best", self.keep_best),
                            ("--early-stop", self.early_stop)):  # fmt: skip
            if value and not held_out:
                yield f"{flag} needs held-out records; --eval-fraction 0 holds none out: pass --eval-data FILE too"


@documented
@dataclass
class DistributionConfig:
    """Scale out: the devices one run spans, and the processes of a multi-host job."""

    parallel: str = setting(
        "none",
        "none: one device; data: keras DataParallel, the model replicated and each batch split over the devices; "
        "model: keras ModelParallel, the kernels sharded over the mesh's model axis. JAX only.",
        flag="--parallel", panel=SCALE_OUT, choices=PARALLEL, label="parallel mode",
    )  # fmt: skip
    mesh: Optional[str] = setting(
        None,
        "DATAxMODEL device mesh axis sizes, e.g. 2x4.",
        flag="--mesh", panel=SCALE_OUT, metavar="DxM",
        default_text="every device on the data axis for data, on the model axis for model",
    )  # fmt: skip
    coordinator: Optional[str] = setting(
        None,
        "Multi-host: host:port of process 0.",
        flag="--coordinator", panel=SCALE_OUT, metavar="HOST:PORT",
        default_text="from CLUSTER_SPEC on Vertex AI, or KERAS_DISTRIBUTION_*",
    )  # fmt: skip
    num_processes: Optional[int] = setting(
        None, "Multi-host: how many processes join the job.", flag="--num-processes", panel=SCALE_OUT, range=Range(1)
    )
    process_id: Optional[int] = setting(
        None,
        "Multi-host: this process's index, 0 to num_processes - 1; process 0 writes the outputs.",
        flag="--process-id", panel=SCALE_OUT, range=Range(0),
    )  # fmt: skip

    def conflicts(self, cfg: Config) -> Iterator[str]:
        """What these settings rule out together, and with the backend, quantization and batch size."""
        if self.parallel != "none" and cfg.backend != "jax":
            yield (
                f"--parallel {self.parallel} needs the jax backend: the installed Keras's distribution API is "
                "JAX-only; pass --backend jax, or --parallel none"
            )
        if self.mesh is not None and self.parallel == "none":
            yield f"--mesh {self.mesh} needs --parallel data or --parallel model"
        if self.parallel == "model" and cfg.model.quantize is not None:
            yield (
                f"--quantize {cfg.model.quantize} with --parallel model is not supported: quantized kernels are not "
                "laid out over a mesh; drop one of them"
            )
        if self.parallel != "none" and cfg.train.batch_size == "auto":
            yield (
                f"--batch-size auto does not combine with --parallel {self.parallel}; pass a batch size that the "
                "data axis divides, e.g. --batch-size 8"
            )
        if self.parallel == "none" and (self.num_processes or 1) != 1:
            yield (
                f"a job of {self.num_processes} processes needs --parallel data or --parallel model; with none each "
                "process would train the whole model alone"
            )
        if None not in (self.process_id, self.num_processes) and self.process_id >= self.num_processes:
            yield (
                f"process id {self.process_id} is out of range for {self.num_processes} processes "
                f"(0 to {self.num_processes - 1})"
            )


@documented
@dataclass
class OutputConfig:
    """The output: where the run's files go."""

    dir: Optional[str] = setting(
        None,
        "Where the run's files go.",
        flag="--output", panel=OUTPUT, metavar="DIR",
        default_text="runs/<timestamp>; /kaggle/working/runs/<timestamp> in a Kaggle notebook",
        hint="pass a run directory, or leave it out for runs/<timestamp>",
    )  # fmt: skip
    overwrite: bool = setting(
        False,
        "Replace a run already in --output (the old one stays until the new one finishes).",
        flag="--overwrite", panel=OUTPUT,
    )  # fmt: skip
    report_to: list[str] = setting(
        ["tensorboard"],
        "Where the run's metrics go as it trains: tensorboard (in the run directory), mlflow (./mlruns in the run "
        "directory, or MLFLOW_TRACKING_URI), wandb (offline unless you are logged in), or none; the mlflow and "
        "wandb extras install the last two.",
        flag="--report-to", panel=OUTPUT, metavar="NAME", check=_trackers, label="tracker",
        hint="e.g. --report-to tensorboard,mlflow",
    )  # fmt: skip


@documented
@dataclass
class Sampling:
    """How `finetune generate` picks each next token: greedy (the most likely) unless a temperature, top-p or
    top-k asks to sample. Not a run setting: `finetune generate` flags and finetune.generate() arguments."""

    temperature: Optional[float] = setting(
        None,
        "Sample at this temperature: under 1 sharper, over 1 more varied.",
        flag="--temperature", metavar="T", range=Range(0, low_open=True), default_text="greedy; 1 with --top-p or --top-k",
        hint="leave --temperature out to decode greedily (the limit of a temperature near 0)",
    )  # fmt: skip
    top_p: Optional[float] = setting(
        None,
        "Sample from the smallest set of tokens whose probabilities add up to P (nucleus sampling).",
        flag="--top-p", metavar="P", range=Range(0, 1, low_open=True), default_text="off",
    )  # fmt: skip
    top_k: Optional[int] = setting(
        None,
        "Sample from the K most likely tokens (a K past the vocabulary keeps every token).",
        flag="--top-k", metavar="K", range=Range(1), default_text="off",
    )  # fmt: skip
    seed: Optional[int] = setting(
        None,
        "Seeds the sampling, so that the same command gives the same answers.",
        flag="--seed", metavar="N", range=Range(0, 2**32 - 1), default_text="a new seed each time",
    )  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature is None and self.top_p is None and self.top_k is None

    @classmethod
    def checked(cls, values: dict) -> Sampling:
        """A Sampling of `values` (name to value, None where not given), each checked as its setting says."""
        unknown = sorted(set(values) - {item.key for item in settings(cls)})
        if unknown:
            raise UserError(f"unknown sampling setting {unknown[0]!r}; choose from temperature, top_p, top_k, seed")
        typed = {}
        for item in settings(cls):
            value = _coerce(item.key, item.type, values.get(item.key))
            message = item.problem(value, name=item.flag)
            if message:
                raise UserError(message)
            typed[item.key] = value
        return cls(**typed)


def _default_backend() -> str:
    """KERAS_BACKEND when it is set, as Keras users expect; else jax."""
    return os.environ.get("KERAS_BACKEND") or "jax"


@documented
@dataclass
class Config:
    """A run's settings: the backend, then one section each for the model, LoRA, data, training, evaluation, devices
    and output."""

    backend: str = setting(
        _default_backend,
        "Keras backend: jax, torch or tensorflow.",
        flag="--backend", panel=MODEL, choices=BACKENDS, env="KERAS_BACKEND",
        default_text="$KERAS_BACKEND if set, else jax",
    )  # fmt: skip
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distribution: DistributionConfig = field(default_factory=DistributionConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict:
        """The settings, nested as a recipe's. An attribute set by hand that is no setting (`cfg.lora.rnak = 8`)
        is kept, so that from_dict refuses it by name where dataclasses.asdict dropped it silently."""
        return _as_dict(self)


def _as_dict(section) -> dict:
    return {name: _as_dict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type)
            else copy.deepcopy(value) for name, value in vars(section).items()}  # fmt: skip


def load(
    recipe: Optional[str | Path] = None, overrides: Optional[dict[str, Any]] = None, base: Optional[dict] = None
) -> Config:
    """Build a Config from defaults, an optional recipe file and dotted-key overrides.

    overrides: dict. Dotted keys (`train.epochs`) to values, applied in order
        after the recipe; the CLI passes `--set` pairs first, then named flags.
    base: dict. Settings that stand in for the defaults: a checkpoint's config
        when resuming, so `--resume` alone continues the run as it was.
    """
    if recipe is not None and not isinstance(recipe, (str, os.PathLike)):
        raise UserError(f"recipe must be a shipped recipe's name or a YAML file's path, got {type(recipe).__name__} "
                        f"{recipe!r}")  # fmt: skip
    if overrides is not None and not isinstance(overrides, dict):
        raise UserError(f"overrides must be a dict of dotted keys to values, such as {{'lora.rank': 8}}, got "
                        f"{type(overrides).__name__}")  # fmt: skip
    data: dict = copy.deepcopy(base) if base else {}
    settings = {}
    if recipe is not None:
        settings = read_recipe(recipe)
        _anchor_paths(settings, find_recipe(recipe).parent)
        _merge(data, settings)
    train = settings.get("train")
    asked = {*(overrides or {}), *(f"train.{key}" for key in (train if isinstance(train, dict) else {}))}
    if base and "train.epochs" in asked and "train.max_steps" not in asked:
        # A resume of a --max-steps run that asks for more epochs: the checkpoint's max_steps would win over them.
        data.setdefault("train", {})["max_steps"] = None
    if base and "distribution.parallel" in asked and "distribution.mesh" not in asked:
        # A resume on other devices (--parallel none, or data on more of them): the checkpoint's mesh was its
        # devices' layout, not a setting the new command makes; it would be refused against the new --parallel.
        data.setdefault("distribution", {})["mesh"] = None
    if (overrides or {}).get("model.full") is True and (data.get("model") or {}).get("full") is not True:
        # --full on the command line over a LoRA recipe (gemma3-270m's rank 8): the recipe's LoRA section is
        # left behind, as the run trains no LoRA; LoRA settings given beside --full are still refused.
        data.pop("lora", None)
    data_section = data.get("data")
    if not base and "data.path" in (overrides or {}) and "data.split" not in overrides and isinstance(data_section,
                                                                                                     dict):  # fmt: skip
        # Another --data than the recipe's: the recipe's split was its dataset's (train_prefs), not the new one's.
        data_section.pop("split", None)
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    return absolute_paths(from_dict(data))


def _is_local_path(value) -> bool:
    """Whether a data path or preset names a local file or folder (not `sample`, hf:, gs://, kaggle://)."""
    if not isinstance(value, str) or not value.strip() or value in (SAMPLE, "tiny"):  # tiny is built in
        return False
    return ":" not in value.split("/")[0]


def _anchor_paths(settings: dict, folder: Path) -> None:
    """A recipe's relative data path, and a relative preset folder beside it, are relative to the recipe's folder."""
    data_section, model_section = settings.get("data"), settings.get("model")
    for section, key in ((data_section, "path"), (settings.get("eval"), "data")):
        if isinstance(section, dict) and _is_local_path(section.get(key)):
            path = Path(section[key]).expanduser()
            if not path.is_absolute():
                section[key] = str(folder / path)
    if isinstance(model_section, dict) and _is_local_path(model_section.get("preset")):
        path = Path(model_section["preset"]).expanduser()
        if not path.is_absolute() and (folder / path).is_dir():
            model_section["preset"] = str(folder / path)
    train_section = settings.get("train")
    rewards = train_section.get("reward") if isinstance(train_section, dict) else None
    if isinstance(rewards, list):  # reward files, as the data, beside the recipe
        found = [_reward_file(spec) for spec in rewards]
        train_section["reward"] = [
            spec
            if part is None or Path(part[1]).expanduser().is_absolute()
            else part[0] + str(folder / part[1]) + part[2]
            for spec, part in zip(rewards, found)
        ]


def _reward_file(spec) -> tuple[str, str, str] | None:
    """(before, path, after) of a --reward naming a local file or folder: FILE.py:FUNCTION or run:DIR; None for a
    built-in (format:REGEX holds a colon too) or a module."""
    if not isinstance(spec, str) or spec.startswith(("format:", "length")) or spec in ("exact", "math"):
        return None
    if spec.startswith("run:"):
        return ("run:", spec[4:], "") if _is_local_path(spec[4:]) else None
    where, _, name = spec.rpartition(":")
    return ("", where, ":" + name) if where.endswith(".py") and _is_local_path(where) else None


def absolute_reward(spec):
    """A --reward with its local file or folder made absolute (from the working directory); others as they are."""
    found = _reward_file(spec)
    return spec if found is None else found[0] + os.path.abspath(os.path.expanduser(found[1])) + found[2]


def absolute_paths(cfg: Config) -> Config:
    """`cfg` with its local data path, preset folder and reward files made absolute, so a run's config.yaml works
    from anywhere (a resume from another directory found the data but not `--reward rewards.py:f`)."""
    cfg.train.reward = [absolute_reward(spec) for spec in cfg.train.reward]
    if _is_local_path(cfg.data.path):
        cfg.data.path = os.path.abspath(os.path.expanduser(cfg.data.path))
    if _is_local_path(cfg.eval.data):
        cfg.eval.data = os.path.abspath(os.path.expanduser(cfg.eval.data))
    if _is_local_path(cfg.model.preset) and Path(cfg.model.preset).expanduser().is_dir():
        cfg.model.preset = os.path.abspath(os.path.expanduser(cfg.model.preset))
    return cfg


def _merge(into: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def parse_duration(text: str) -> float:
    """Seconds in `11h30m`, `90m`, `45s`, `1h` or a bare number of seconds; raises ValueError."""
    match = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not text.strip() or not match or not any(match.groups()):
        raise ValueError(text)
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def from_dict(data: dict) -> Config:
    """A checked Config from a nested mapping (a recipe, or a run's config.yaml), whose keys may also be dotted
    at the top, as load_config's overrides are: {"lora.rank": 8} is {"lora": {"rank": 8}}."""
    # A run's config.yaml adds a `resolved:` record of what the run found; it is
    # not a setting, so a finished run's config can be used as a recipe.
    data = _undotted({k: v for k, v in data.items() if k != "resolved"})
    cfg = _build(Config, data, prefix="")
    validate(cfg)
    return cfg


# Shipped recipes live inside the package, so `--recipe tiny` works from any
# directory and from a non-editable install, not only from a checkout.
RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


def read_recipe(recipe: str | Path) -> dict:
    """The settings in a recipe: a YAML file, or a shipped recipe by name (see `find_recipe`)."""
    path = find_recipe(recipe)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_OnceLoader)  # noqa: S506 (a SafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as e:  # ValueError: an int past 4300 digits
        raise UserError(_yaml_error(e, path)) from None
    except RecursionError:
        raise UserError(f"recipe {path} is nested too deeply to read; a recipe is a few levels of keys") from None
    except OSError as e:
        raise UserError(f"cannot read recipe {path} ({e.strerror or e})") from None
    if data is None:  # an empty file, or comments alone: a recipe cut short or not written yet
        raise UserError(f"recipe {path} holds no settings (it is empty, or comments alone); write keys such as "
                        "`train:` and `lora:` in it, or leave --recipe out for the defaults")  # fmt: skip
    if not isinstance(data, dict):
        raise UserError(f"recipe {path} must be a mapping of keys such as `train:` and `lora:`")
    return data


class _OnceLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, which refuses a key given twice in one mapping: YAML keeps the last silently, so a
    recipe's second `rank:` would overrule the first unseen."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # a list or mapping as a key: construct_mapping's own error names it
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice in one mapping",
                                                        key_node.start_mark)  # fmt: skip
            seen.add(key)
        return super().construct_mapping(node, deep)


_OnceLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _OnceLoader.construct_mapping)


def _yaml_error(error: Exception, path: Path) -> str:
    """'recipe FILE:LINE is not valid YAML: what', for what yaml.safe_load or the UTF-8 decoder raised."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    what = getattr(error, "problem", None) or getattr(error, "context", None) or str(error).splitlines()[0]
    if what.startswith("but ") and getattr(error, "context", None):  # "expected a single document ..., but found"
        what = f"{error.context}, {what}"
    line = mark.line + 1 if mark is not None else None
    if isinstance(getattr(error, "position", None), int):  # a character YAML does not allow, such as NUL
        line = path.read_text(encoding="utf-8")[: error.position].count("\n") + 1
    if isinstance(error, UnicodeDecodeError):
        line, what = error.object[: error.start].count(b"\n") + 1, "not UTF-8 text; re-save it as UTF-8"
    elif "4300" in what:  # int() refused the digits; the line is the one holding them
        text = path.read_text(encoding="utf-8")
        found = re.search(r"\d{4301}", text)
        line, what = text.count("\n", 0, found.start()) + 1 if found else None, "an integer of over 4300 digits"
    return f"recipe {path}{f':{line}' if line else ''} is not valid YAML: {what[:160]}"


def find_recipe(recipe: str | Path) -> Path:
    """The file `--recipe` names: a path that exists, else a shipped recipe.

    A shipped recipe is named `tiny`, `tiny.yaml` or `recipes/tiny.yaml`; the
    last is its path in a checkout before recipes moved into the package, so
    commands written then keep working anywhere. Other missing paths are errors
    rather than silently read as the shipped recipe of the same name.
    """
    path = Path(recipe)
    if path.is_file():
        return path
    if path.parent in (Path("."), Path("recipes")):
        return shipped_recipe(path.name)
    names = ", ".join(shipped_recipes())
    raise UserError(f"recipe {path} does not exist; pass a YAML file or a shipped recipe ({names})")


def shipped_recipe(name: str) -> Path:
    """A shipped recipe's file by name (`tiny` or `tiny.yaml`); raises UserError listing the names."""
    shipped = shipped_recipes()
    stem = name.removesuffix(".yaml")
    if stem not in shipped:
        raise UserError(
            f"no recipe {name!r}: not a file here, and the shipped recipes are {', '.join(shipped)} "
            "(`finetune recipes` describes them)"
        )
    return shipped[stem]


def shipped_recipes() -> dict[str, Path]:
    """Name to file of each recipe in finetune/recipes/, sorted by name."""
    return {path.stem: path for path in sorted(RECIPES_DIR.glob("*.yaml"))}


def recipe_summary(path: Path) -> str:
    """A recipe's one-line description: its second line, the comment under its command."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return lines[1].lstrip("#").strip() if len(lines) > 1 else ""


def parse_set(pair: str) -> tuple[str, Any]:
    """`key=value` from --set; the value is read as YAML, so 2, 1e-4, [a, b] and null work."""
    key, sep, raw = pair.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {pair!r} must look like key=value, e.g. --set train.epochs=2")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError):  # not YAML, an int past 4300 digits, too deep: as typed
        value = raw
    return key.strip(), value


def _undotted(data: dict) -> dict:
    """`data` with its dotted top-level keys made sections; a setting given both ways is refused."""
    if not any(isinstance(k, str) and "." in k for k in data):
        return data
    nested = {
        k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if not (isinstance(k, str) and "." in k)
    }
    for key, value in data.items():
        if isinstance(key, str) and "." in key:
            parts = key.split(".")
            node = nested
            for part in parts[:-1]:
                node = node.get(part) if isinstance(node.get(part), dict) else None
                if node is None:
                    break
            if node is not None and parts[-1] in node:
                raise UserError(f"config key {key!r} is given twice: dotted, and inside section {parts[0]!r}")
            set_dotted(nested, key, value)
    return nested


def set_dotted(data: dict, key: str, value: Any) -> None:
    """`data[key] = value` for a dotted key; a section given as a mapping (`--set 'train={epochs: 2}'`) is merged
    into the one there, as a recipe is merged into the defaults, not put in its place (which dropped the
    recipe's other settings of that section, silently)."""
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"config key {key!r}: {part!r} is not a section")
        node = child
    if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
        _merge(node[parts[-1]], value)
    else:
        node[parts[-1]] = value


# A flag in a message, and the word after it: `--overwrite to`, `--parallel data`, `--output gs://BUCKET/PATH.`
_FLAG_AND_WORD = re.compile(r"--([a-z][a-z0-9-]*)(?: (\S+))?")


def in_python_words(message: str, arguments: tuple[Setting, ...] = (), with_settings: bool = True) -> str:
    """`message`, a refusal worded for the command line, as a Python caller needs it: each flag becomes the config
    key or argument it sets, and a value given with it stays: `pass --overwrite` -> `pass output.overwrite=True`,
    `--parallel data` -> `distribution.parallel="data"`, `--epochs` -> `train.epochs`.

    arguments: the calling function's own arguments, as settings whose key is the argument's name and whose flag
        is the command line's (`resume`, `--resume`); they come before the config's.
    with_settings: also the config's settings (finetune.run); off for a function that takes no config.
    """
    every = (*(settings(Config) if with_settings else ()), *arguments)  # an argument wins a flag both name
    by_flag = {item.flag: item for item in every if item.flag}

    def reworded(found: re.Match) -> str:
        item = by_flag.get(f"--{found.group(1)}")
        if item is None:
            return found.group(0)  # a flag of the command line alone (--set, --recipe): as it is
        word = found.group(2) or ""
        value, tail = re.fullmatch(r"(.*?)([.,;:)]*)", word).groups()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":  # a value the message quoted
            value = value[1:-1]
        if item.type is bool:
            return f"{item.key}=True" + (f" {word}" if word else "")
        if not word or not _is_value(item, value):
            return item.key + (f" {word}" if word else "")
        placeholder = re.fullmatch(r"[A-Z][A-Za-z0-9_]*(\.\w+)?|-?\d+(\.\d+)?", value) is not None
        return f"{item.key}={value if placeholder else repr(value).replace(chr(39), chr(34))}{tail}"

    # A command quoted in backticks (`finetune export --format hf`) is the command line's, and stays so.
    parts = message.split("`")
    return "`".join(part if i % 2 else _FLAG_AND_WORD.sub(reworded, part) for i, part in enumerate(parts))


def _is_value(item: Setting, word: str) -> bool:
    """Whether `word`, after the flag of `item` in a message, is a value given to it rather than the sentence's."""
    if not word:
        return False
    if word in item.choices or word == item.metavar or re.fullmatch(r"[A-Z][A-Za-z0-9_]*(\.\w+)?", word):
        return True
    if re.search(r"\d", word) or "/" in word:
        return True
    try:
        return item.check is not None and item.problem(word) is None
    except (TypeError, ValueError):  # a check for numbers, given a word
        return False


def keys() -> list[str]:
    """Every dotted config key, for messages and help."""
    return [item.key for item in settings(Config)]


def check(key: str, value, name: str | None = None) -> None:
    """Refuse `value` for the setting at dotted `key` as `validate` would; `name` is what the message calls it."""
    (item,) = (s for s in settings(Config) if s.key == key)
    message = item.problem(value, name)
    if message:
        raise UserError(message)


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise UserError(f"config section {prefix.rstrip('.') or 'top level'} must be a mapping")
    # YAML reads `1:` and `~:` as an int and a null key; sorting them with the names below would raise TypeError.
    odd = [k for k in data if not isinstance(k, str)]
    if odd:
        where = f"in section {prefix.rstrip('.')}" if prefix else "at the top level"
        raise UserError(f"config key {odd[0]!r} {where} is not a name; keys are words such as train: or epochs:")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        key = prefix + unknown[0]
        close = difflib.get_close_matches(key, keys(), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(keys())}"
        raise UserError(f"unknown config key {key!r}; {hint}")
    whole = {f.name for f in dataclasses.fields(cls) if f.metadata.get("setting", {}).get("whole")}
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, prefix + name + ".")
        else:
            kwargs[name] = _coerce(prefix + name, hint, value, whole=name in whole)
    return cls(**kwargs)


def _coerce(key: str, hint, value, whole: bool = False):
    """Check `value` against the annotation; ints pass where floats are wanted, and a string where a list of them
    is wanted is read as its flag reads it: split at commas, or one item where the flag takes each value `whole`."""
    union = typing.get_origin(hint) in (Union, types.UnionType)
    allowed = typing.get_args(hint) if union else (hint,)
    if str in allowed and bool not in allowed and isinstance(value, bool):
        # YAML 1.1 reads a bare on/off (also yes/no, true/false) as a boolean; our word settings
        # (packing, time limit) take the words on and off.
        value = "on" if value else "off"
    if float in allowed and isinstance(value, str):
        # YAML 1.1 reads 5e-5 (no dot) as a string, and people write rates that way.
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, str) and any(
        typing.get_origin(arg) is list and typing.get_args(arg) == (str,) for arg in allowed
    ):
        # A list of words as its flag takes it: `--set lora.targets=query,value`, `targets: query, value`.
        value = [value] if whole else [word.strip() for word in value.split(",") if word.strip()]
    if _matches(hint, value):
        if float in allowed and int not in allowed and type(value) is int:
            return float(value)
        return value
    if isinstance(value, bool):  # YAML 1.1's reading of a bare on/off/yes/no/true/false
        raise UserError(
            f"config key {key!r} must be {_describe(hint)}, got {value!r} (YAML reads a bare on, off, yes or no "
            "as true or false)"
        )
    raise UserError(f"config key {key!r} must be {_describe(hint)}, got {value!r}")


def _matches(hint, value) -> bool:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_matches(arg, value) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(item, v) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def validate(cfg: Config) -> None:
    """Each setting's own checks, declared with its field, then what the distribution settings rule out together.

    Needs no keras and no files: it runs on every load, before the backend is chosen.
    """
    for item in settings(type(cfg)):
        value = cfg
        for part in item.key.split("."):
            value = getattr(value, part)
        message = item.problem(value)
        if message:
            raise UserError(message)
    for message in [*cfg.model.conflicts(cfg), *cfg.lora.conflicts(cfg), *cfg.train.conflicts(),
                    *cfg.distribution.conflicts(cfg),
                    *cfg.eval.conflicts(cfg), *_token_conflicts(cfg)]:  # fmt: skip
        raise UserError(message)


def _token_conflicts(cfg: Config) -> Iterator[str]:
    if cfg.train.embedding_lr is not None and not cfg.model.add_tokens:
        yield "--embedding-lr is the learning rate of the rows of --add-tokens; pass --add-tokens, or drop it"
