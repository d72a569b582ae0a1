"""A frozen base built quantized: the whole float base never exists in memory.

`backbone.quantize("int4")` after `from_preset` needs the float model first:
gemma_7b_en is 17 GB in bfloat16 before it shrinks to about 5 GB, more than a
T4 or a 30 GB Kaggle host holds. Here the backbone is constructed with a dtype
policy map that makes each decoder kernel an int4 (or int8) variable from the
start, so construction allocates the quantized sizes only. Then each kernel is
filled from its float weights one layer at a time, from a preset's weights
file as keras reads it, or from random values for a benchmark; the float copy
of one kernel is the most that exists at once.

The quantizing itself is keras' own: a float twin of the layer (same config)
holds the kernel and runs `quantize()`, and its variables are copied over. So
the result is bit for bit what `backbone.quantize()` gives (tested), and keras'
quantized call paths and LoRA work on it unchanged.
"""

from __future__ import annotations

import keras
import numpy as np

from finetune import layouts

MODES = ("int4", "int8")
# int4 in groups of 128 input rows, each with its own scale and zero point: keras' default for quantize("int4")
# (Int4QuantizationConfig), finer than one scale per output channel. QLoRA's NF4 uses groups of 64.
INT4_BLOCK = 128


def policies(base_policy: str, mode: str, rules=layouts.RULES) -> keras.dtype_policies.DTypePolicyMap:
    """The dtype policy of every layer: `mode` for the decoder kernels `rules` name (layouts.rules_for), `base_policy`
    elsewhere.

    The token embedding stays in `base_policy`: it is also the output projection, and QLoRA keeps it in 16
    bits too. Quantizing it is what made LoRA on an int8 base train badly: with `backbone.quantize("int8")`,
    which quantizes the embedding as well, 10 steps on the tiny model ended at a held-out loss of 1.44
    against 1.18 in float; with the decoder kernels alone in int8, at 1.18 (JAX, float32 and mixed bf16).
    """
    kind = f"int4/{INT4_BLOCK}" if mode == "int4" else mode
    quantized = keras.dtype_policies.get(f"{kind}_from_{base_policy}")
    mapping = keras.dtype_policies.DTypePolicyMap(default_policy=keras.dtype_policies.get(base_policy))
    for rule in rules:
        if rule.target and rule.pattern.endswith("/kernel"):
            mapping[rule.pattern.removesuffix("/kernel")] = quantized
    return mapping


def quantized_layers(backbone) -> list:
    """The layers `policies` made quantized."""
    return [
        layer
        for layer in backbone._flatten_layers(include_self=False)
        if getattr(layer, "quantization_mode", None) in MODES and hasattr(layer, "quantize")
    ]


def fill(layer, kernel) -> None:
    """Quantize a float kernel as keras' quantize() would, into `layer`'s quantized variables.

    kernel: the float kernel as an array, or a callable from its shape to one.
    """
    twin = _float_twin(layer)
    twin.kernel.assign(kernel(tuple(twin.kernel.shape)) if callable(kernel) else kernel)
    twin.quantize(layer.quantization_mode)
    ours, theirs = _quantized_variables(layer), _quantized_variables(twin)
    for target, value in zip(ours, theirs, strict=True):
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(f"{target.path}: quantized shape {tuple(value.shape)}, expected {tuple(target.shape)}")
        target.assign(value)


def _float_twin(layer):
    """A float twin of `layer`: its config, input shape and source dtype, its kernel zeros (no random init)."""
    config = {**layer.get_config(), "dtype": _source_dtype(layer), "kernel_initializer": "zeros"}
    config.pop("lora_rank", None)
    twin = type(layer).from_config(config)
    twin.build_from_config(layer.get_build_config())
    return twin


def _source_dtype(layer) -> str:
    """The float dtype `layer` was quantized from (its policy's source): the twin holds the kernel in it."""
    return policy_of(layer).name.split("_from_")[-1]


def policy_of(layer):
    """The layer's own dtype policy, also when it was built with a DTypePolicyMap."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path]
    return policy


def _quantized_variables(layer) -> list:
    return [v for v in layer.variables if "lora" not in v.path]


def weights_only(backbone) -> None:
    """Quantize the kernels only, not the activations: keras' int8 layers otherwise round their inputs to int8.

    Weight-only is what QLoRA does, and keras' int4 already is. On the tiny
    model, 10 LoRA steps from a held-out loss of 1.59 ended at 1.1238 with
    weight-only int8 kernels and 1.1275 with int8 inputs too, against 1.1205
    for the float base (JAX, float32).
    """
    for layer in quantized_layers(backbone):
        layer.inputs_quantizer = None


def load_while_quantizing(backbone) -> None:
    """Make each quantized layer quantize the float kernel keras reads for it from a weights file.

    keras' load_weights hands each layer its own entry of the file and calls its
    `load_own_variables`; the quantized layers' are replaced, on these
    instances only, by one that reads the float kernel (entry "0") and fills.
    """
    for layer in quantized_layers(backbone):

        def load_own_variables(store, layer=layer):
            fill(layer, np.asarray(store["0"]))

        layer.load_own_variables = load_own_variables


def fill_random(backbone, seed: int = 0) -> None:
    """Random float kernels, quantized layer by layer: a benchmark's base at its real quantized size.

    Scaled as keras-hub initialises Gemma's kernels (variance 1 / fan-in), drawn
    in float32 one kernel at a time.
    """
    rng = np.random.default_rng(seed)
    for layer in quantized_layers(backbone):
        reduced = getattr(layer, "_kernel_reduced_axes", None)

        def kernel(shape, reduced=reduced):
            fan_in = int(np.prod([shape[i] for i in reduced])) if reduced else shape[-2]
            return rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(fan_in))

        fill(layer, kernel)
