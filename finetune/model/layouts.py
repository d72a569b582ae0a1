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

Gemma 1-3 have one block shape, so RULES says everything. Gemma 4's blocks
differ (global layers have wider heads and fewer key/value heads, may share
K for V, the last layers may borrow keys and values, some have a wider FFW)
and Gemma 3n adds per-layer embeddings, AltUp and Laurel: their rules are
made from the config (rules_for), one per kind of block, each naming the
blocks it matches. Mixture-of-experts banks shard on the experts axis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from finetune.platform.errors import UserError

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
    shape: tuple = ()
    """A made rule's shape (rules_for); empty: from shape_of and the Dims."""
    copies: int = 0
    """How many variables it matches; 0: one per decoder block (one for the embedding)."""
    target: str = ""
    """The LoRA target (families.TARGETS, or families.EXPERTS for an expert bank) these weights belong to; empty for
    the rest."""

    @property
    def quantized(self) -> bool:
        """Whether --quantize stores these weights quantized: a LoRA target's kernels (quantized.policies), not an
        expert bank's tensors, which keras' quantizers do not know."""
        return bool(self.target) and self.pattern.endswith("/kernel")


# D hidden, H query heads, K key/value heads, h head dim, F the FFW kernels' inner width, V vocabulary.
RULES = (
    Rule("embedding", r"token_embedding/embeddings", (0, 1), "V,D"),
    Rule("query", rf"{_BLOCK}/attention/query/kernel", (0, 1), "H,D,h", target="query"),
    Rule("key", rf"{_BLOCK}/attention/key/kernel", (0, 1), "K,D,h", target="key"),
    Rule("value", rf"{_BLOCK}/attention/value/kernel", (0, 1), "K,D,h", target="value"),
    Rule(
        "attention_output", rf"{_BLOCK}/attention/attention_output/kernel", (0, 2), "H,h,D", target="attention_output"
    ),
    Rule("ffw_gating", rf"{_BLOCK}/ffw_gating/kernel", (1, 0), "D,F", target="ffw_gating"),
    Rule("ffw_gating_2", rf"{_BLOCK}/ffw_gating_2/kernel", (1, 0), "D,F", target="ffw_gating_2"),
    Rule("ffw_linear", rf"{_BLOCK}/ffw_linear/kernel", (0, 1), "F,D", target="ffw_linear"),
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
_LORA = RULES[-2:]
# Norm scales (D or h) and everything else not matched above are replicated: they are tiny.


@dataclass(frozen=True)
class Dims:
    """The sizes that decide a Gemma text backbone's variable shapes.

    For Gemma 4 and 3n, whose blocks differ, these are the first block's sizes
    (what `finetune plan` estimates activations with); `config` holds the rest.
    """

    vocabulary_size: int
    num_layers: int
    num_query_heads: int
    num_key_value_heads: int
    hidden_dim: int
    head_dim: int
    ffw_dim: int
    """The width of the ffw_gating kernels as built: GemmaBackbone halves its intermediate_dim, Gemma 3 does not."""
    family: str = "gemma"
    config: dict = field(default_factory=dict, hash=False, compare=False)
    """The backbone config it was read from (config.json's "config")."""

    @classmethod
    def from_backbone_config(cls, config: dict, family: str) -> Dims:
        """From a keras-hub backbone config (config.json's "config"); family is a key of families.FAMILIES."""
        if family == "gemma3n":
            widths = config["intermediate_size"]
            return cls(
                vocabulary_size=int(config["text_vocab_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_query_heads=int(config["num_attention_heads"]),
                num_key_value_heads=int(config["num_key_value_heads"]),
                hidden_dim=int(config["text_hidden_size"]),
                head_dim=int(config["head_dim"]),
                ffw_dim=int(widths[0] if isinstance(widths, list) else widths),
                family=family,
                config=dict(config),
            )
        intermediate = int(config["intermediate_dim"])
        return cls(
            vocabulary_size=int(config["vocabulary_size"]),
            num_layers=int(config["num_layers"]),
            num_query_heads=int(config["num_query_heads"]),
            num_key_value_heads=int(config["num_key_value_heads"]),
            hidden_dim=int(config["hidden_dim"]),
            head_dim=int(config["head_dim"]),
            ffw_dim=intermediate if family in ("gemma3", "gemma4") else intermediate // 2,
            family=family,
            config=dict(config),
        )

    def shape(self, rule: Rule) -> tuple[int, ...]:
        if rule.shape:
            return rule.shape
        sizes = {
            "V": self.vocabulary_size,
            "D": self.hidden_dim,
            "H": self.num_query_heads,
            "K": self.num_key_value_heads,
            "h": self.head_dim,
            "F": self.ffw_dim,
        }
        return tuple(sizes[s] for s in rule.shape_of.split(",")) if rule.shape_of else ()

    def copies(self, rule: Rule) -> int:
        """How many variables `rule` matches in the backbone."""
        return rule.copies or (1 if rule.group == "embedding" else self.num_layers)


def rules_for(dims: Dims) -> tuple[Rule, ...]:
    """The layout rules of this backbone: RULES for Gemma 1-3, made from the config for Gemma 4 and 3n."""
    if dims.family == "gemma4":
        return _gemma4_rules(dims.config)
    if dims.family == "gemma3n":
        return _gemma3n_rules(dims.config)
    return RULES


def gemma4_block(config: dict, index: int) -> dict:
    """What sets the shapes of Gemma 4's decoder block `index`, as Gemma4Backbone builds it."""
    layers = int(config["num_layers"])
    types = config.get("layer_types")
    pattern = int(config.get("sliding_window_pattern") or 6)
    is_global = types[index] == "full_attention" if types else index % pattern == pattern - 1
    global_kv = config.get("num_global_key_value_heads")
    shared = int(config.get("num_kv_shared_layers") or 0)
    borrows = shared > 0 and index >= layers - shared
    ffw = int(config["intermediate_dim"]) * (2 if config.get("use_double_wide_mlp") and borrows else 1)
    return {
        "global": is_global,
        "head_dim": int(config.get("global_head_dim") or config["head_dim"]) if is_global else int(config["head_dim"]),
        "kv_heads": int(global_kv) if is_global and global_kv is not None else int(config["num_key_value_heads"]),
        "owns_kv": not borrows,
        "owns_value": not borrows and not (is_global and global_kv is not None),  # else V reuses K's kernel
        "ffw": ffw,
    }


def _blocks(indices: list[int], layers: int, prefix: str = "") -> str:
    if len(indices) == layers:
        return prefix + _BLOCK
    return prefix + "decoder_block_(?:" + "|".join(str(i) for i in indices) + ")"


def _kinds(layers: int, describe) -> list[tuple[str, dict, list[int]]]:
    """(name suffix, block description, block indices) per kind of decoder block, the first kind unnamed."""
    kinds: dict = {}
    for index in range(layers):
        block = describe(index)
        kinds.setdefault(tuple(sorted(block.items())), (block, []))[1].append(index)
    out = []
    for number, (block, indices) in enumerate(kinds.values()):
        tags = [tag for key, tag in (("global", "global"),) if block.get(key)]
        tags += [] if block.get("owns_kv", True) else ["borrowed kv"]
        suffix = "" if number == 0 else " (" + (", ".join(tags) or f"kind {number + 1}") + ")"
        out.append((suffix, block, indices))
    return out


def _gemma4_rules(c: dict) -> tuple[Rule, ...]:
    L, D, H = int(c["num_layers"]), int(c["hidden_dim"]), int(c["num_query_heads"])
    P = int(c.get("hidden_size_per_layer_input") or 0)
    out = [
        Rule("embedding", r"token_embedding/embeddings", (0, 1), "V,D", shape=(int(c["vocabulary_size"]), D), copies=1)
    ]
    if P:
        vocabulary = int(c.get("vocab_size_per_layer_input") or c["vocabulary_size"])
        out += [
            Rule("per-layer embedding", r"per_layer_token_embedding/embeddings", (0, 1), "V,N",
                 shape=(vocabulary, L * P), copies=1),
            Rule("per-layer projection", r"per_layer_model_projection/kernel", (1, 0), "D,N", shape=(D, L * P), copies=1),
        ]  # fmt: skip
    for suffix, b, indices in _kinds(L, lambda i: gemma4_block(c, i)):
        blocks, n, h, K, F = _blocks(indices, L), len(indices), b["head_dim"], b["kv_heads"], b["ffw"]
        attention = f"{blocks}/attention"
        out.append(Rule("query" + suffix, f"{attention}/query/kernel", (0, 1), "H,D,h", shape=(H, D, h), copies=n,
                        target="query"))  # fmt: skip
        if b["owns_kv"]:
            out.append(Rule("key" + suffix, f"{attention}/key/kernel", (0, 1), "K,D,h", shape=(K, D, h), copies=n,
                            target="key"))  # fmt: skip
        if b["owns_value"]:
            out.append(Rule("value" + suffix, f"{attention}/value/kernel", (0, 1), "K,D,h", shape=(K, D, h),
                            copies=n, target="value"))  # fmt: skip
        out += [
            Rule("attention_output" + suffix, f"{attention}/attention_output/kernel", (0, 2), "H,h,D", shape=(H, h, D),
                 copies=n, target="attention_output"),
            Rule("ffw_gating" + suffix, f"{blocks}/ffw_gating/kernel", (1, 0), "D,F", shape=(D, F), copies=n,
                 target="ffw_gating"),
            Rule("ffw_gating_2" + suffix, f"{blocks}/ffw_gating_2/kernel", (1, 0), "D,F", shape=(D, F), copies=n,
                 target="ffw_gating_2"),
            Rule("ffw_linear" + suffix, f"{blocks}/ffw_linear/kernel", (0, 1), "F,D", shape=(F, D), copies=n,
                 target="ffw_linear"),
        ]  # fmt: skip
    if c.get("enable_moe_block"):
        E, inner = int(c["num_experts"]), int(c["expert_intermediate_dim"])
        bank = f"{_BLOCK}/moe_expert_bank"
        out += [
            Rule("router", rf"{_BLOCK}/moe_router/proj/kernel", (), "D,E", shape=(D, E), copies=L),
            Rule("experts gate", f"{bank}/gate_proj", (0, 2), "E,D,I", shape=(E, D, inner), copies=L, target="experts"),
            Rule("experts up", f"{bank}/up_proj", (0, 2), "E,D,I", shape=(E, D, inner), copies=L, target="experts"),
            Rule("experts down", f"{bank}/down_proj", (0, 1), "E,I,D", shape=(E, inner, D), copies=L, target="experts"),
            # Each expert's LoRA factors (experts.py): A (experts, in, rank), B (experts, rank, out), replicated.
            Rule("lora_experts", f"{bank}/lora_[a-z]+_proj_[ab]", (), "", ndim=3),
        ]
    if P:
        out += [
            Rule("per-layer gate", rf"{_BLOCK}/per_layer_input_gate/kernel", (), "D,P", shape=(D, P), copies=L),
            Rule("per-layer up", rf"{_BLOCK}/per_layer_up_proj/kernel", (), "P,D", shape=(P, D), copies=L),
        ]
    return tuple(out) + _LORA


def _gemma3n_rules(c: dict) -> tuple[Rule, ...]:
    L, D, H = int(c["num_hidden_layers"]), int(c["text_hidden_size"]), int(c["num_attention_heads"])
    K, h, P = int(c["num_key_value_heads"]), int(c["head_dim"]), int(c["hidden_size_per_layer_input"])
    A, r = int(c["altup_num_inputs"]), int(c["laurel_rank"])
    widths = c["intermediate_size"] if isinstance(c["intermediate_size"], list) else [c["intermediate_size"]] * L
    vocabulary = int(c.get("vocab_size_per_layer_input") or c["text_vocab_size"])
    m = "text_model"
    out = [
        Rule("embedding", rf"{m}/embed_tokens/embedding/embeddings", (0, 1), "V,D", shape=(int(c["text_vocab_size"]), D),
             copies=1),
        Rule("per-layer embedding", rf"{m}/embed_tokens_per_layer/embedding/embeddings", (0, 1), "V,N",
             shape=(vocabulary, L * P), copies=1),
        Rule("per-layer projection", rf"{m}/per_layer_model_projection/kernel", (1, 0), "D,N", shape=(D, L * P),
             copies=1),
        Rule("altup projections", rf"{m}/altup_projection_\d+/kernel", (), "D,D", shape=(D, D), copies=A - 1),
        Rule("altup unembed", rf"{m}/altup_unembed_projection_\d+/kernel", (), "D,D", shape=(D, D), copies=A - 1),
    ]  # fmt: skip
    for suffix, b, indices in _kinds(L, lambda i: {"ffw": int(widths[i])}):
        blocks, n, F = _blocks(indices, L, f"{m}/"), len(indices), b["ffw"]
        out += [
            Rule("query" + suffix, f"{blocks}/attention/q_proj/kernel", (1, 0), "D,H", shape=(D, H * h), copies=n,
                 target="query"),
            Rule("key" + suffix, f"{blocks}/attention/k_proj/kernel", (1, 0), "D,K", shape=(D, K * h), copies=n,
                 target="key"),
            Rule("value" + suffix, f"{blocks}/attention/v_proj/kernel", (1, 0), "D,K", shape=(D, K * h), copies=n,
                 target="value"),
            Rule("attention_output" + suffix, f"{blocks}/attention/o_proj/kernel", (0, 1), "H,D", shape=(H * h, D),
                 copies=n, target="attention_output"),
            Rule("ffw_gating" + suffix, f"{blocks}/mlp/gate_proj/kernel", (1, 0), "D,F", shape=(D, F), copies=n,
                 target="ffw_gating"),
            Rule("ffw_gating_2" + suffix, f"{blocks}/mlp/up_proj/kernel", (1, 0), "D,F", shape=(D, F), copies=n,
                 target="ffw_gating_2"),
            Rule("ffw_linear" + suffix, f"{blocks}/mlp/down_proj/kernel", (0, 1), "F,D", shape=(F, D), copies=n,
                 target="ffw_linear"),
        ]  # fmt: skip
    block = f"{m}/{_BLOCK}"
    out += [
        Rule("laurel left", rf"{block}/laurel/linear_left/kernel", (), "D,R", shape=(D, r), copies=L),
        Rule("laurel right", rf"{block}/laurel/linear_right/kernel", (), "R,D", shape=(r, D), copies=L),
        Rule("altup correction", rf"{block}/altup/correction_coefs/kernel", (), "A,A", shape=(A, A), copies=L),
        Rule("altup prediction", rf"{block}/altup/prediction_coefs/kernel", (), "A,B", shape=(A, A * A), copies=L),
        Rule("altup router", rf"{block}/altup/modality_router/kernel", (), "D,A", shape=(D, A), copies=L),
        Rule("per-layer gate", rf"{block}/per_layer_input_gate/kernel", (), "D,P", shape=(D, P), copies=L),
        Rule("per-layer up", rf"{block}/per_layer_projection/kernel", (), "P,D", shape=(P, D), copies=L),
        Rule("lora", rf"{block}/(?:attention|mlp)/[a-z_]+/lora_kernel_[ab]", (), "", ndim=2),
    ]  # fmt: skip
    return tuple(out)


@dataclass(frozen=True)
class Placement:
    rule: Rule
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    """The TensorLayout axes: MODEL_AXIS on the sharded dimension, None elsewhere."""
    note: str = ""
    copies: int = 1
    """How many variables of this shape the rule matches."""


def place(dims: Dims, model_size: int) -> list[Placement]:
    """Each kernel rule's layout on a model axis of `model_size` devices.

    Raises UserError, before anything is built, when no candidate dimension of a
    kernel is divisible by the model axis.
    """
    out = []
    for rule in rules_for(dims):
        shape, copies = dims.shape(rule), dims.copies(rule)
        if not rule.candidates:
            out.append(Placement(rule, shape, (None,) * (len(shape) or rule.ndim), "replicated", copies))
            continue
        if model_size == 1:
            out.append(Placement(rule, shape, (None,) * len(shape), "replicated (model axis 1)", copies))
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
        out.append(Placement(rule, shape, axes, note, copies))
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


def fit_default_batch(batch_size: int, data: int) -> tuple[int, str | None]:
    """A default batch size the user did not choose, made to split over a data axis of `data` devices: the next
    multiple of it. Returns (batch size, a note saying so, or None when it already split). The run and the plan
    both ask here, so the plan describes the batch the run will use (issue 16)."""
    if batch_size % data == 0:
        return batch_size, None
    fitted = -(-batch_size // data) * data
    return fitted, (
        f"batch size {fitted}: the default {batch_size} does not split over the data axis of {data} devices "
        "(pass --batch-size to choose another multiple)"
    )


def check_batch(batch_size: int, data: int) -> None:
    """A global batch is split evenly over the data axis, or the run stops here (and the plan with it)."""
    if batch_size % data:
        raise UserError(
            f"--batch-size {batch_size} does not split over a data axis of {data} devices; use a multiple of {data}"
        )
