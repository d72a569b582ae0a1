"""How each Gemma backbone variable is laid out over a (batch, model) device mesh.

Pure Python: `finetune plan` uses these rules offline, and distribution.py turns
them into a keras LayoutMap before the model is built, so weights are created
sharded and never whole on one device.

Why not keras-hub's own `get_layout_map`: it shards the key/value kernels on
their head axis, which a model with one key/value head (gemma_2b_en, gemma3_1b)
cannot split over a model axis larger than 1, and Gemma 3 has none. Here each
kernel has a list of candidate dimensions, best first; the first one the model
axis divides is sharded. The head axis comes first (no communication inside
attention), then the hidden axis. A kernel no candidate fits stops the run
with a message naming it: the kernels are the model's weight, and replicating
them would silently defeat the point of `--parallel model`.

Variables are matched by their full path (keras' LayoutMap uses re.fullmatch),
and the LoRA factors have rules of their own: they are small, and replicated,
so a base-kernel rule can never catch them with a layout of the wrong rank
(the trap of keras #19496).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from finetune.errors import UserError

DATA_AXIS = "batch"
MODEL_AXIS = "model"

_BLOCK = r"decoder_block_\d+"


@dataclass(frozen=True)
class Rule:
    group: str
    """A short name for `finetune plan`: embedding, query, key, ..."""
    pattern: str
    """A regex fullmatched against variable paths."""
    candidates: tuple[int, ...]
    """Dimensions that may be sharded over the model axis, best first; empty means replicated."""
    shape_of: str
    """The variable's shape in terms of the backbone's dimensions, e.g. `H,D,h`; empty for LoRA factors."""
    ndim: int = 0
    """For a rule with no shape_of: the variables' number of dimensions."""


# D hidden, H query heads, K key/value heads, h head dim, F the FFW kernels' inner width, V vocabulary.
RULES = (
    Rule("embedding", r"token_embedding/embeddings", (0, 1), "V,D"),
    Rule("query", rf"{_BLOCK}/attention/query/kernel", (0, 1), "H,D,h"),
    Rule("key", rf"{_BLOCK}/attention/key/kernel", (0, 1), "K,D,h"),
    Rule("value", rf"{_BLOCK}/attention/value/kernel", (0, 1), "K,D,h"),
    Rule("attention_output", rf"{_BLOCK}/attention/attention_output/kernel", (0, 2), "H,h,D"),
    Rule("ffw_gating", rf"{_BLOCK}/ffw_gating/kernel", (1, 0), "D,F"),
    Rule("ffw_gating_2", rf"{_BLOCK}/ffw_gating_2/kernel", (1, 0), "D,F"),
    Rule("ffw_linear", rf"{_BLOCK}/ffw_linear/kernel", (0, 1), "F,D"),
    # LoRA factors: A of a per-head kernel is 3-D (heads, in, rank), every other factor 2-D.
    Rule("lora_a_attention", rf"{_BLOCK}/attention/[a-z_]+/lora_kernel_a", (), "", ndim=3),
    Rule(
        "lora_other",
        rf"{_BLOCK}/attention/[a-z_]+/lora_kernel_b|{_BLOCK}/ffw_[a-z_0-9]+/lora_kernel_[ab]",
        (),
        "",
        ndim=2,
    ),
)
# Norm scales (D or h) and everything else not matched above are replicated: they are tiny.


@dataclass(frozen=True)
class Dims:
    """The sizes that decide a Gemma text backbone's variable shapes."""

    vocabulary_size: int
    num_layers: int
    num_query_heads: int
    num_key_value_heads: int
    hidden_dim: int
    head_dim: int
    ffw_dim: int
    """The width of the ffw_gating kernels as built: GemmaBackbone halves its intermediate_dim, Gemma 3 does not."""

    @classmethod
    def from_backbone_config(cls, config: dict, family: str) -> Dims:
        """From a keras-hub backbone config (config.json's "config"); family is gemma or gemma3."""
        intermediate = int(config["intermediate_dim"])
        return cls(
            vocabulary_size=int(config["vocabulary_size"]),
            num_layers=int(config["num_layers"]),
            num_query_heads=int(config["num_query_heads"]),
            num_key_value_heads=int(config["num_key_value_heads"]),
            hidden_dim=int(config["hidden_dim"]),
            head_dim=int(config["head_dim"]),
            ffw_dim=intermediate if family == "gemma3" else intermediate // 2,
        )

    def shape(self, rule: Rule) -> tuple[int, ...]:
        sizes = {
            "V": self.vocabulary_size,
            "D": self.hidden_dim,
            "H": self.num_query_heads,
            "K": self.num_key_value_heads,
            "h": self.head_dim,
            "F": self.ffw_dim,
        }
        return tuple(sizes[s] for s in rule.shape_of.split(",")) if rule.shape_of else ()


@dataclass(frozen=True)
class Placement:
    rule: Rule
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    """The TensorLayout axes: MODEL_AXIS on the sharded dimension, None elsewhere."""
    note: str = ""


def place(dims: Dims, model_size: int) -> list[Placement]:
    """Each kernel rule's layout on a model axis of `model_size` devices.

    Raises UserError, before anything is built, when no candidate dimension of a
    kernel is divisible by the model axis.
    """
    out = []
    for rule in RULES:
        shape = dims.shape(rule)
        if not rule.candidates:
            out.append(Placement(rule, shape, (None,) * rule.ndim, "replicated"))
            continue
        if model_size == 1:
            out.append(Placement(rule, shape, (None,) * len(shape), "replicated (model axis 1)"))
            continue
        chosen = next((d for d in rule.candidates if shape[d] % model_size == 0), None)
        if chosen is None:
            sizes = " nor ".join(f"dimension {d} ({shape[d]})" for d in rule.candidates)
            raise UserError(
                f"cannot shard {rule.group} ({rule.pattern.split('|')[0]}, shape {shape}) over a model axis of "
                f"{model_size}: neither {sizes} is divisible by {model_size}; use a --mesh whose model axis divides it"
            )
        axes = tuple(MODEL_AXIS if d == chosen else None for d in range(len(shape)))
        first = rule.candidates[0]
        note = (
            ""
            if chosen == first
            else f"dimension {first} ({shape[first]}) is not divisible by {model_size}: sharded on dimension {chosen}"
        )
        out.append(Placement(rule, shape, axes, note))
    return out


def layout_of(path: str, placements: list[Placement]) -> tuple[str | None, ...] | None:
    """The axes for the variable at `path`, or None when no rule matches (replicated)."""
    found = [p for p in placements if re.fullmatch(p.rule.pattern, path)]
    if len(found) > 1:  # the rules are written to be disjoint; a test holds them to it
        raise ValueError(f"{path} matches several layout rules: {[p.rule.group for p in found]}")
    return found[0].axes if found else None


def parse_mesh(text: str | None, parallel: str, devices: int | None) -> tuple[int, int]:
    """(data, model) axis sizes from --mesh DxM, or the default for `parallel` over `devices` devices.

    devices: int or None. The devices the job sees; None (a plan) takes the mesh's own product.
    """
    if text is None:
        return (devices, 1) if parallel == "data" else (1, devices)
    match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise UserError(f"--mesh {text!r} is not DATAxMODEL, e.g. --mesh 2x4 (2 data replicas of 4 model shards)")
    data, model = int(match.group(1)), int(match.group(2))
    if devices is not None and data * model != devices:
        raise UserError(
            f"--mesh {data}x{model} needs {data * model} devices, and this job sees {devices}; "
            f"use a mesh whose sizes multiply to {devices}"
        )
    if parallel == "data" and model != 1:
        raise UserError(
            f"--parallel data replicates the model: its mesh is {data * model}x1; use --parallel model for {text}"
        )
    return data, model


def check_batch(batch_size: int, data: int) -> None:
    """A global batch is split evenly over the data axis, or the run stops here (and the plan with it)."""
    if batch_size % data:
        raise UserError(
            f"--batch-size {batch_size} does not split over a data axis of {data} devices; use a multiple of {data}"
        )
