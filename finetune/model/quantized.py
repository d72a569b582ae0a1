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
from keras import ops

from finetune.model import layouts
from finetune.platform import keras_compat

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
        if rule.quantized:
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
        weights_only_layer(layer)


def weights_only_layer(layer) -> None:
    """One layer's part of weights_only."""
    keras_compat.drop_inputs_quantizer(layer)


def load_while_quantizing(backbone) -> None:
    """Make each quantized layer quantize the float kernel keras reads for it from a weights file.

    keras' load_weights hands each layer its own entry of the file and calls its
    `load_own_variables`; the quantized layers' are replaced, on these
    instances only, by one that reads the float kernel (entry "0") and fills.
    """
    for layer in quantized_layers(backbone):

        def load_own_variables(store, layer=layer):
            fill(layer, np.asarray(store["0"]))

        keras_compat.replace_loading(layer, load_own_variables)


def fill_random(backbone, seed: int = 0) -> None:
    """Random quantized kernels, written straight into the quantized storage: a benchmark's base at its real size.

    Throughput does not depend on the values, only that they stay finite, so no
    float kernel is drawn and quantized (that took 12 minutes for gemma-7b on 2
    cores): the codes are uniform (int4 nibbles in [-8, 7], int8 in [-127, 127])
    and the scales give the kernel a standard deviation of about 1 / sqrt(fan-in),
    as keras-hub initialises Gemma's kernels.
    """
    rng = np.random.default_rng(seed)
    for layer in quantized_layers(backbone):
        if layer.quantization_mode == "int4":
            codes, spread, fan_in = layer._kernel, 4.61, layer._int4_rows  # a uniform nibble's standard deviation
        else:
            reduced = layer._kernel_reduced_axes
            codes, spread, fan_in = layer._kernel, 73.6, int(np.prod([layer._kernel.shape[i] for i in reduced]))
        low, high = (-128, 128) if layer.quantization_mode == "int4" else (-127, 128)
        codes.assign(rng.integers(low, high, tuple(codes.shape), dtype=np.int8))
        scale = spread * np.sqrt(fan_in)
        grouped = getattr(layer, "_int4_block_size", None) not in (None, -1)
        # Sub-channel int4 multiplies by its scale; per-channel int4 and int8 divide by theirs.
        value = 1.0 / scale if layer.quantization_mode == "int4" and grouped else scale
        layer.kernel_scale.assign(np.full(tuple(layer.kernel_scale.shape), value, np.float32))
        if grouped:
            layer.kernel_zero.assign(np.zeros(tuple(layer.kernel_zero.shape), np.int8))


def lean_projection(layer):
    """`inputs -> einsum(inputs, kernel)` for a weight-only int4 or int8 EinsumDense, None for any other layer.

    keras' quantized calls dequantize the kernel in the forward and keep the
    result for the backward (its int4 unpacked, a byte a weight) while the
    whole step runs, and XLA, seeing dequantizations that depend on nothing
    but the weights, computes them all up front: gemma-7b in int4 asked for one
    34.4 GiB buffer on JAX, the float32 kernels of every layer at once. Here
    the kernel is dequantized when the layer's input arrives, used and let
    go, and dequantized again when the gradient arrives, so one layer's float
    kernel exists at a time and the step keeps only the packed weights. The
    arithmetic is keras' own, so the outputs are the same to the bit.
    """
    from keras.layers import EinsumDense

    mode = getattr(layer, "quantization_mode", None)
    if not isinstance(layer, EinsumDense) or mode not in MODES or layer.inputs_quantizer is not None:
        return None
    weights, dequantize = stored_and_dequantize(layer)

    @ops.custom_gradient
    def project(inputs, *stored):
        kernel = dequantize(*_after_all(stored, inputs))
        outputs = ops.einsum(layer.equation, inputs, kernel)

        def gradient(*args, upstream=None):
            if upstream is None:  # jax and tensorflow pass it positionally, torch by name
                (upstream,) = args
            kernel = dequantize(*_after_all(stored, upstream))
            return (ops.einsum(layer._custom_gradient_equation, upstream, kernel),) + (None,) * len(stored)

        return outputs, gradient

    return lambda inputs: project(inputs, *(ops.convert_to_tensor(w) for w in weights))


def stored_and_dequantize(layer) -> tuple:
    """(the int4 or int8 layer's stored weights, kernel first; the function of them that gives its float kernel)."""
    if layer.quantization_mode == "int4":
        return _int4_weights(layer), _int4_kernel(layer)
    return (layer._kernel, layer.kernel_scale), _int8_kernel(layer)


def _int4_weights(layer) -> tuple:
    if getattr(layer, "_int4_block_size", None) in (None, -1):
        return layer._kernel, layer.kernel_scale
    return layer._kernel, layer.kernel_scale, layer.kernel_zero


def _int4_kernel(layer):
    """The float kernel from int4 storage (rows x columns, two a byte): keras' unpack and dequantize, with each
    group's scale and zero point broadcast over its rows rather than gathered for every row."""
    from keras import quantizers

    block = getattr(layer, "_int4_block_size", None)
    rows, columns = layer._int4_rows, layer._int4_unpacked_column_size

    def kernel(packed, scale, zero=None):
        unpacked = quantizers.unpack_int4(packed, columns, axis=-1, dtype="int8")
        if zero is None:  # one scale per output column
            floats = ops.divide(ops.cast(unpacked, layer.compute_dtype), scale)
        elif rows % block == 0:  # (groups, block, columns) - (groups, 1, columns), times the same
            grouped = ops.reshape(unpacked, (rows // block, block, columns))
            zeros = ops.cast(ops.expand_dims(zero, 1), scale.dtype)
            floats = ops.cast(
                ops.multiply(ops.subtract(grouped, zeros), ops.expand_dims(scale, 1)), layer.compute_dtype
            )
        else:
            groups = ops.cast(ops.floor_divide(ops.arange(rows), block), "int32")
            mapped_scale, mapped_zero = ops.take(scale, groups, axis=0), ops.take(zero, groups, axis=0)
            floats = ops.multiply(ops.subtract(unpacked, ops.cast(mapped_zero, scale.dtype)), mapped_scale)
            floats = ops.cast(floats, layer.compute_dtype)
        return ops.reshape(floats, layer.original_kernel_shape)

    return kernel


def _int8_kernel(layer):
    """The float kernel from int8 storage: keras' weight-only dequantization (kernel / its scale)."""

    def kernel(stored, scale):
        return ops.divide(ops.cast(stored, layer.compute_dtype), layer._adjust_scale_for_dequant(scale))

    return kernel


def _after_all(values: tuple, anchor) -> tuple:
    """`values` (a layer's stored weights, its kernel first), made to wait for `anchor` (its input or gradient).

    Without the wait, XLA (JAX) and TensorFlow's executor are free to dequantize
    every layer's kernel at the start of the step, since the weights are there
    from the start, and XLA would merge the forward's dequantization with the
    backward's and keep it between them. On TensorFlow a control dependency
    orders it. XLA's CPU compiler drops optimisation barriers before it
    schedules, so there the kernel is made to depend on the input's value:
    plus zero times one of its elements (XLA does not fold 0 * x for floats).
    PyTorch runs eagerly, in order, and needs neither.
    """
    backend = keras.config.backend()
    if backend == "jax":
        import jax

        first = ops.cast(ops.reshape(anchor, (-1,))[0], "float32")
        kernel = values[0] + ops.cast(first * 0.0, values[0].dtype)
        return jax.lax.optimization_barrier((kernel, *values[1:], anchor))[:-1]
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.control_dependencies([anchor]):
            return tuple(tf.identity(v) for v in values)
    return values
