"""LoRA on Gemma 4's mixture-of-experts bank, and the bank's routed dispatch on JAX.

keras-hub's Gemma4MoEBlock keeps its experts as raw tensors, gate_proj and
up_proj (experts, hidden, expert ffw) and down_proj (experts, expert ffw,
hidden), not as layers keras' enable_lora knows; and it computes every expert
on every token, then weights the k its router picked (gemma4_moe.py): E / k
times the expert FLOPs and activations a token needs, 16x on the 26b_a4b.

Here the bank's `call` is our own (installed by builder.build on every Gemma 4
MoE build):

- LoRA (--target experts): each expert e has its own factors beside each of
  its three projections, A_e (in, r) and B_e (r, out), kept as (experts, in,
  r) and (experts, r, out); the update is s (x A_e) B_e, s alpha / rank (or
  alpha / sqrt(rank) with rslora) as every other target, B starting at zero.
  The factors are float32 whatever the base's dtype, as keras' LoRA keeps
  them, and are computed beside the projection, not merged into it: a merged
  bank would be a bank-sized sum each step.
- Routed dispatch (backend.routed_experts_rule says where: JAX on one TPU,
  whose XLA has a ragged dot of its own; not yet measured): the token-expert pairs the
  router chose are sorted by expert and each projection is one grouped matmul
  (jax.lax.ragged_dot, with the group sizes per expert), so each token passes
  through its k experts only. Elsewhere keras-hub's dense dispatch runs, with
  the LoRA update added to each expert's projection.

The bank's stored weights stay in the base's float dtype under --quantize:
quantized.policies quantizes the layers LoRA targets by kernel, and the bank
has none (layouts.Rule.quantized).
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops

from finetune.model import families
from finetune.platform import keras_compat

PROJECTIONS, FACTORS = families.EXPERT_PROJECTIONS, families.EXPERT_FACTORS


def is_bank(layer) -> bool:
    """Whether `layer` is a mixture-of-experts bank this module adapts (keras-hub's Gemma4MoEBlock)."""
    return all(hasattr(layer, name) for name in PROJECTIONS) and hasattr(layer, "num_experts")


def banks(backbone) -> list:
    """The backbone's expert banks, one per decoder block of a Gemma 4 MoE; empty for a dense model."""
    return [layer for layer in backbone._flatten_layers(include_self=False) if is_bank(layer)]


def factor_shapes(bank, rank: int) -> dict:
    """{name: shape} of rank-`rank` LoRA on the bank: A (experts, in, rank), B (experts, rank, out) per projection."""
    shapes = {}
    for projection in PROJECTIONS:
        experts, inputs, outputs = (int(d) for d in getattr(bank, projection).shape)
        shapes[f"lora_{projection}_a"] = [experts, inputs, rank]
        shapes[f"lora_{projection}_b"] = [experts, rank, outputs]
    return shapes


def enable_lora(bank, rank: int) -> None:
    """Give the bank LoRA factors of rank `rank` (zeros until initialise draws A), trainable, its own weights
    frozen; lora_enabled, lora_rank and lora_alpha as keras' layers keep them (builder.enable_lora sets alpha)."""
    with keras_compat.adding_variables(bank):
        for name, shape in factor_shapes(bank, rank).items():
            setattr(bank, name, bank.add_weight(name=name, shape=tuple(shape), initializer="zeros", dtype="float32"))
    bank.trainable = True  # makes every variable of the bank trainable: its own go back to frozen
    for variable in bank.weights:
        if variable.path.split("/")[-1] not in FACTORS:
            variable.trainable = False
    bank.lora_rank, bank.lora_alpha, bank.lora_enabled = rank, float(rank), True


def initialise(bank, rng: np.random.Generator) -> None:
    """Each expert's A drawn He uniform over its own fan-in (the projection's input width), as keras draws a
    dense layer's; B zeros, so the adapted bank starts as the base."""
    for projection in PROJECTIONS:
        a, b = getattr(bank, f"lora_{projection}_a"), getattr(bank, f"lora_{projection}_b")
        limit = math.sqrt(6.0 / int(a.shape[1]))
        a.assign(rng.uniform(-limit, limit, tuple(a.shape)).astype("float32"))
        b.assign(np.zeros(tuple(b.shape), "float32"))


def install(backbone, routed: bool) -> int:
    """Give every expert bank of `backbone` our call: the routed dispatch where `routed`, keras-hub's dense one
    otherwise, each with the bank's LoRA once enable_lora gave it some. Returns how many banks."""
    found = banks(backbone)
    for block in _blocks_of(backbone, found):
        bank = block.moe_expert_bank
        bank.routed = routed
        bank.experts_per_token = int(block.num_experts_per_token)
        keras_compat.replace_call(bank, _call(bank, type(bank).call.__get__(bank)))
    return len(found)


def _blocks_of(backbone, found: list) -> list:
    ids = {id(bank) for bank in found}
    return [
        layer
        for layer in backbone._flatten_layers(include_self=False)
        if id(getattr(layer, "moe_expert_bank", None)) in ids
    ]


def _call(bank, keras_hub_call):
    def call(x, dispatch_weights):
        adapted = getattr(bank, "lora_enabled", False)
        if bank.routed:
            return routed(bank, x, dispatch_weights, adapted)
        if not adapted:
            return keras_hub_call(x, dispatch_weights)
        return dense(bank, x, dispatch_weights)

    return call


def _scale(bank, dtype):
    return ops.cast(bank.lora_alpha / bank.lora_rank, dtype)


def dense(bank, x, dispatch_weights, adapted: bool = True):
    """keras-hub's Gemma4MoEBlock.call, every expert on every token, with each projection's LoRA update beside it:
    x W_e + s (x A_e) B_e for every expert e."""
    dtype = x.dtype

    def project(name, inputs, equation, low, up):
        out = ops.einsum(equation, inputs, ops.cast(getattr(bank, name), dtype))
        if not adapted:
            return out
        a, b = (ops.cast(getattr(bank, f"lora_{name}_{side}"), dtype) for side in "ab")
        return out + _scale(bank, dtype) * ops.einsum(up, ops.einsum(low, inputs, a), b)

    gate = project("gate_proj", x, "th,ehi->eti", "th,ehr->etr", "etr,eri->eti")
    up = project("up_proj", x, "th,ehi->eti", "th,ehr->etr", "etr,eri->eti")
    gate = ops.cast(keras.activations.gelu(ops.cast(gate, "float32"), approximate=True), dtype)
    out = project("down_proj", gate * up, "eti,eih->eth", "eti,eir->etr", "etr,erh->eth")
    out = out * ops.reshape(ops.cast(bank.per_expert_scale, dtype), (bank.num_experts, 1, 1))
    weights = ops.transpose(ops.cast(dispatch_weights, dtype), (1, 0))
    return ops.sum(out * weights[:, :, None], axis=0)


def routed(bank, x, dispatch_weights, adapted: bool = True):
    """The bank's output from each token's k experts alone: the token-expert pairs sorted by expert, each
    projection one grouped matmul over them (jax.lax.ragged_dot), then each pair scaled by its expert's scale and
    its routing weight and summed back into its token. JAX only.

    The router's dispatch weights hold k non-zero entries a token; their top k are those entries, and the
    gradient reaches them alone, as in the dense dispatch (the others multiply nothing the router computed).
    """
    import jax
    import jax.numpy as jnp

    dtype, k, experts = x.dtype, bank.experts_per_token, bank.num_experts
    dispatch_weights = jnp.asarray(dispatch_weights)
    _, chosen = jax.lax.top_k(dispatch_weights, k)  # (tokens, k)
    weights = jnp.take_along_axis(dispatch_weights, chosen, axis=-1).astype(dtype)
    pairs = chosen.reshape(-1)
    order = jnp.argsort(pairs, stable=True)  # the token-expert pairs, grouped by expert
    sizes = jnp.bincount(pairs, length=experts).astype("int32")
    inputs = jnp.asarray(x)[order // k]

    def project(name, inputs):
        out = jax.lax.ragged_dot(inputs, jnp.asarray(ops.cast(getattr(bank, name), dtype)), sizes)
        if not adapted:
            return out
        a, b = (jnp.asarray(ops.cast(getattr(bank, f"lora_{name}_{side}"), dtype)) for side in "ab")
        low = jax.lax.ragged_dot(inputs, a, sizes)
        return out + jnp.asarray(_scale(bank, dtype)) * jax.lax.ragged_dot(low, b, sizes)

    gate = jax.nn.gelu(project("gate_proj", inputs).astype("float32"), approximate=True).astype(dtype)
    out = project("down_proj", gate * project("up_proj", inputs))
    scale = jnp.asarray(ops.cast(bank.per_expert_scale, dtype))[pairs[order]]
    out = out * scale[:, None] * weights.reshape(-1)[order][:, None]
    unsorted = out[jnp.argsort(order)]  # back to (token, k) order: a gather, not a scatter of sums
    return unsorted.reshape(-1, k, out.shape[-1]).sum(axis=1)
