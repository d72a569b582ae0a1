"""The run's typed configuration: defaults < recipe YAML < --set < named flags.

Pure Python and YAML, no keras: the config is read before the backend is
chosen. `load()` refuses unknown keys and wrong types with a message that
names the key, so a typo in a recipe never silently falls back to a default.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from finetune.data import SAMPLE
from finetune.errors import UserError
from finetune.templates import TEMPLATES

BACKENDS = ("jax", "torch", "tensorflow")
PRECISIONS = ("auto", "bfloat16", "float16", "float32", "mixed_bfloat16")
PACKING = ("auto", "on", "off")
QUANTIZE = ("int4", "int8")
PARALLEL = ("none", "data", "model")
REMAT = ("auto", "on", "off")


@dataclass
class ModelConfig:
    preset: str = "gemma_2b_en"
    """keras-hub preset name, `kaggle://` handle, local preset directory, or `tiny`."""
    seq_len: int = 256
    """Tokens per training sequence; longer records are cut (the Keras tutorial's 256)."""
    precision: str = "auto"
    """The frozen base's dtype; LoRA factors and their optimizer state are float32 in every case.
    auto: bfloat16 on a TPU, a GPU with bf16 (A100, L4, H100) and a CPU with bf16 units (AVX512-BF16 or
    AMX), float16 on other GPUs (T4, V100), else float32. mixed_bfloat16 keeps the base in float32 and
    computes in bf16 (Keras' mixed precision: twice the memory)."""
    quantize: Optional[str] = None
    """int4 or int8: the frozen base's decoder kernels are built quantized and filled layer by layer, so the
    float base never exists in memory (QLoRA-like); the embedding stays in the precision's dtype and the LoRA
    factors in float32. None keeps every weight in the precision's dtype."""
    remat: str = "auto"
    """Recompute each decoder block's activations in the backward pass instead of keeping them: on, off, or
    auto (on when the plan says the run would not fit the device's memory without it)."""


@dataclass
class LoraConfig:
    rank: int = 4
    """Rank of the LoRA factors: higher adapts more and costs more memory."""
    alpha: Optional[float] = None
    """LoRA scale is alpha / rank; None means alpha = rank (scale 1, keras-hub's default)."""
    targets: list[str] = field(default_factory=lambda: ["query", "value"])
    """Names of the layers to adapt (Gemma: query, key, value, attention_output, ffw_*)."""


@dataclass
class DataConfig:
    path: str = SAMPLE
    """Records as JSONL, a JSON array, CSV or Parquet (local or gs://), hf:NAME for a Hugging Face dataset, or
    `sample`; Dolly, Alpaca, chat, ShareGPT, prompt/completion or text records (data.FORMATS)."""
    template: str = "auto"
    """Prompt template: auto (the data's own: dolly for Dolly records, alpaca for Alpaca ones, the family's chat
    turns for chat and ShareGPT records, none for prompt/completion and text), dolly (the Keras tutorial's),
    alpaca, gemma-chat, gemma4-chat or none."""
    drop_context: bool = False
    """Drop records that carry a context (the Keras tutorial does, to keep sequences short)."""
    categories: list[str] = field(default_factory=list)
    """Keep only these Dolly categories; empty keeps all."""
    max_records: Optional[int] = None
    """Use at most this many records (after filters); None uses all."""
    eval_fraction: float = 0.05
    """Share of records held out for evaluation (at least one batch)."""
    train_on_prompt: bool = False
    """Also compute the loss on prompt tokens; by default only response tokens count."""
    packing: str = "auto"
    """Several examples per training row, each attending only to itself (exact): auto (on for Gemma 1, 2
    and 3), on, or off (one example per row, padded, as in the Keras tutorial)."""


@dataclass
class TrainConfig:
    epochs: int = 1
    """Passes over the training split."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps, whatever `epochs` says."""
    batch_size: Union[int, str, None] = None
    """Sequences per step; None picks the backend's default, `auto` probes the largest that fits."""
    learning_rate: Optional[float] = None
    """AdamW rate; None takes the preset's (5e-5 for Gemma checkpoints, as the tutorial)."""
    weight_decay: float = 0.01
    """AdamW decay, not applied to biases and norm scales (the tutorial's recipe)."""
    seed: int = 0
    """Seeds the split, the shuffling and the LoRA initialisation."""
    xla_mem_fraction: float = 1.00
    """JAX only: share of GPU memory XLA may take (XLA_PYTHON_CLIENT_MEM_FRACTION)."""
    threads: Optional[int] = None
    """PyTorch on a CPU: intra-op threads; None takes the physical cores idle when the run starts."""
    samples: int = 3
    """Held-out prompts to generate from before and after training, into samples.md."""
    max_new_tokens: int = 48
    """Tokens generated for each sample."""
    checkpoint_every: int = 100
    """Save a resumable checkpoint every this many steps (and always at the end of an epoch)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep; older ones are deleted."""
    time_limit: Optional[str] = None
    """Stop with a checkpoint before this much time has passed (`11h30m`, `90m`, `3600s`); None is
    11h30m in a Kaggle notebook (its sessions end at 12 hours) and no limit elsewhere; `off` disables."""


@dataclass
class DistributionConfig:
    parallel: str = "none"
    """none: one device; data: keras DataParallel, the model replicated and each batch split over the devices;
    model: keras ModelParallel, the kernels sharded over the mesh's model axis (JAX only)."""
    mesh: Optional[str] = None
    """DATAxMODEL axis sizes, e.g. 2x4; None puts every device on the data axis (data) or the model axis (model)."""
    coordinator: Optional[str] = None
    """Multi-host: host:port of process 0; None reads CLUSTER_SPEC (Vertex AI) or KERAS_DISTRIBUTION_* when set."""
    num_processes: Optional[int] = None
    """Multi-host: how many processes join the job."""
    process_id: Optional[int] = None
    """Multi-host: this process's index, 0 to num_processes - 1; process 0 writes the outputs."""


@dataclass
class OutputConfig:
    dir: Optional[str] = None
    """Where the run's files go; None means runs/<timestamp>/ (under /kaggle/working in a Kaggle notebook)."""
    overwrite: bool = False
    """Replace a run already in `dir`."""


def _default_backend() -> str:
    """KERAS_BACKEND when it is set, as Keras users expect; else jax."""
    return os.environ.get("KERAS_BACKEND") or "jax"


@dataclass
class Config:
    backend: str = field(default_factory=_default_backend)
    """Keras backend: jax, torch or tensorflow; by default KERAS_BACKEND, else jax."""
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distribution: DistributionConfig = field(default_factory=DistributionConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load(
    recipe: Optional[str | Path] = None, overrides: Optional[dict[str, Any]] = None, base: Optional[dict] = None
) -> Config:
    """Build a Config from defaults, an optional recipe file and dotted-key overrides.

    overrides: dict. Dotted keys (`train.epochs`) to values, applied in order
        after the recipe; the CLI passes `--set` pairs first, then named flags.
    base: dict. Settings that stand in for the defaults: a checkpoint's config
        when resuming, so `--resume` alone continues the run as it was.
    """
    data: dict = copy.deepcopy(base) if base else {}
    if recipe is not None:
        settings = read_recipe(recipe)
        _anchor_paths(settings, find_recipe(recipe).parent)
        _merge(data, settings)
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
    if isinstance(data_section, dict) and _is_local_path(data_section.get("path")):
        path = Path(data_section["path"]).expanduser()
        if not path.is_absolute():
            data_section["path"] = str(folder / path)
    if isinstance(model_section, dict) and _is_local_path(model_section.get("preset")):
        path = Path(model_section["preset"]).expanduser()
        if not path.is_absolute() and (folder / path).is_dir():
            model_section["preset"] = str(folder / path)


def absolute_paths(cfg: Config) -> Config:
    """`cfg` with its local data path and preset folder made absolute, so a run's config.yaml works from anywhere."""
    if _is_local_path(cfg.data.path):
        cfg.data.path = os.path.abspath(os.path.expanduser(cfg.data.path))
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
    """A checked Config from a nested mapping (a recipe, or a run's config.yaml)."""
    # A run's config.yaml adds a `resolved:` record of what the run found; it is
    # not a setting, so a finished run's config can be used as a recipe.
    data = {k: v for k, v in data.items() if k != "resolved"}
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
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as e:  # ValueError: an int past 4300 digits
        raise UserError(_yaml_error(e, path)) from None
    except RecursionError:
        raise UserError(f"recipe {path} is nested too deeply to read; a recipe is a few levels of keys") from None
    except OSError as e:
        raise UserError(f"cannot read recipe {path} ({e.strerror or e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"recipe {path} must be a mapping of keys such as `train:` and `lora:`")
    return data


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


def set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"config key {key!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def keys() -> list[str]:
    """Every dotted config key, for messages and help."""
    out = []
    for name, hint in typing.get_type_hints(Config).items():
        if dataclasses.is_dataclass(hint):
            out += [f"{name}.{f.name}" for f in dataclasses.fields(hint)]
        else:
            out.append(name)
    return out


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
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, prefix + name + ".")
        else:
            kwargs[name] = _coerce(prefix + name, hint, value)
    return cls(**kwargs)


def _coerce(key: str, hint, value):
    """Check `value` against the annotation; ints pass where floats are wanted."""
    allowed = typing.get_args(hint) or (hint,)
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
    if _matches(hint, value):
        if float in allowed and int not in allowed and type(value) is int:
            return float(value)
        return value
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


def _settings(cfg: Config):
    """(dotted key, value) for every setting."""
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                yield f"{section.name}.{f.name}", getattr(value, f.name)
        else:
            yield section.name, value


def validate(cfg: Config) -> None:
    """Range checks that need no keras and no files."""

    def check(ok: bool, message: str):
        if not ok:
            raise UserError(message)

    # NaN passes no range check's `not` and inf passes `> 0`: refuse both in every float setting first.
    for key, value in _settings(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"config key {key!r} must be a finite number, got {value}")
    source = " (from KERAS_BACKEND)" if cfg.backend == os.environ.get("KERAS_BACKEND") else ""
    check(cfg.backend in BACKENDS, f"unknown backend {cfg.backend!r}{source}; choose one of {', '.join(BACKENDS)}")
    # An empty string, as from an unset shell variable, would mean the current directory.
    check(bool(cfg.model.preset.strip()), "--preset is empty; pass a preset name such as gemma_2b_en, or tiny")
    check(bool(cfg.data.path.strip()), "--data is empty; pass a data file, hf:NAME or sample")
    check(
        cfg.output.dir is None or bool(cfg.output.dir.strip()),
        "--output is empty; pass a run directory, or leave it out for runs/<timestamp>",
    )
    check(
        cfg.model.precision in PRECISIONS,
        f"unknown precision {cfg.model.precision!r}; choose one of {', '.join(PRECISIONS)}",
    )
    check(
        cfg.data.template == "auto" or cfg.data.template in TEMPLATES,
        f"unknown template {cfg.data.template!r}; choose auto or one of {', '.join(TEMPLATES)}",
    )
    check(
        cfg.model.quantize is None or cfg.model.quantize in QUANTIZE,
        f"unknown quantize mode {cfg.model.quantize!r}; choose one of {', '.join(QUANTIZE)}, or leave it out",
    )
    check(cfg.data.packing in PACKING, f"unknown packing {cfg.data.packing!r}; choose one of {', '.join(PACKING)}")
    check(cfg.model.remat in REMAT, f"unknown remat {cfg.model.remat!r}; choose one of {', '.join(REMAT)}")
    check(cfg.lora.rank >= 1, f"LoRA rank must be at least 1, got {cfg.lora.rank}; try --rank 4")
    check(cfg.lora.alpha is None or cfg.lora.alpha > 0, f"LoRA alpha must be positive, got {cfg.lora.alpha}")
    check(bool(cfg.lora.targets), "LoRA needs at least one target layer, e.g. --target query --target value")
    check(cfg.model.seq_len >= 8, f"seq-len {cfg.model.seq_len} is too small; use at least 64 (256 is typical)")
    check(
        0 < cfg.data.eval_fraction < 1,
        f"eval fraction must be between 0 and 1 (exclusive), got {cfg.data.eval_fraction}; try 0.05",
    )
    check(
        cfg.data.max_records is None or cfg.data.max_records >= 2,
        f"max records must be at least 2 (one to train, one to evaluate), got {cfg.data.max_records}",
    )
    bs = cfg.train.batch_size
    check(
        bs is None or bs == "auto" or (isinstance(bs, int) and bs >= 1),
        f"batch size must be a positive integer or `auto`, got {bs!r}",
    )
    check(cfg.train.epochs >= 1, f"epochs must be at least 1, got {cfg.train.epochs}")
    check(
        cfg.train.max_steps is None or cfg.train.max_steps >= 1,
        f"max steps must be at least 1, got {cfg.train.max_steps}",
    )
    lr = cfg.train.learning_rate
    check(lr is None or lr > 0, f"learning rate must be positive, got {lr}")
    # The seeds of numpy and keras.utils.set_random_seed are 32-bit unsigned.
    check(0 <= cfg.train.seed < 2**32, f"seed must be between 0 and {2**32 - 1}, got {cfg.train.seed}; try --seed 0")
    check(cfg.train.weight_decay >= 0, f"weight decay must not be negative, got {cfg.train.weight_decay}")
    check(
        0 < cfg.train.xla_mem_fraction <= 1, f"XLA memory fraction must be in (0, 1], got {cfg.train.xla_mem_fraction}"
    )
    check(
        cfg.train.threads is None or cfg.train.threads >= 1,
        f"threads must be at least 1, got {cfg.train.threads}; leave it out to use the idle cores",
    )
    check(cfg.train.samples >= 0, f"samples must not be negative, got {cfg.train.samples}")
    check(cfg.train.max_new_tokens >= 1, f"max new tokens must be at least 1, got {cfg.train.max_new_tokens}")
    check(
        cfg.train.checkpoint_every >= 1,
        f"checkpoint every must be at least 1 step, got {cfg.train.checkpoint_every}; try --checkpoint-every 100",
    )
    check(
        cfg.train.keep_checkpoints >= 1,
        f"keep checkpoints must be at least 1, got {cfg.train.keep_checkpoints}; try --keep-checkpoints 2",
    )
    dist = cfg.distribution
    check(
        dist.parallel in PARALLEL,
        f"unknown parallel mode {dist.parallel!r}; choose one of {', '.join(PARALLEL)}",
    )
    check(
        dist.parallel == "none" or cfg.backend == "jax",
        f"--parallel {dist.parallel} needs the jax backend: the installed Keras's distribution API is JAX-only; "
        "pass --backend jax, or --parallel none",
    )
    check(
        dist.mesh is None or dist.parallel != "none",
        f"--mesh {dist.mesh} needs --parallel data or --parallel model",
    )
    check(
        dist.parallel != "model" or cfg.model.quantize is None,
        f"--quantize {cfg.model.quantize} with --parallel model is not supported: quantized kernels are not laid out over a mesh; "
        "drop one of them",
    )
    check(
        dist.parallel == "none" or bs != "auto",
        f"--batch-size auto does not combine with --parallel {dist.parallel}; pass a batch size that the data axis "
        "divides, e.g. --batch-size 8",
    )
    check(
        dist.parallel != "none" or (dist.num_processes or 1) == 1,
        f"a job of {dist.num_processes} processes needs --parallel data or --parallel model; with none each "
        "process would train the whole model alone",
    )
    check(
        dist.num_processes is None or dist.num_processes >= 1,
        f"num processes must be at least 1, got {dist.num_processes}",
    )
    check(
        dist.process_id is None or dist.process_id >= 0,
        f"process id must not be negative, got {dist.process_id}",
    )
    check(
        dist.process_id is None or dist.num_processes is None or dist.process_id < dist.num_processes,
        f"process id {dist.process_id} is out of range for {dist.num_processes} processes (0 to "
        f"{(dist.num_processes or 1) - 1})",
    )
    limit = cfg.train.time_limit
    if limit is not None and limit != "off":
        try:
            seconds = parse_duration(limit)
        except ValueError:
            seconds = -1.0
        check(
            seconds > 0,
            f"time limit {limit!r} is not a duration; write it like 11h30m, 90m or 3600s (or `off`)",
        )
