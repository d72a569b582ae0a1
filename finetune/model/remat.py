"""--remat: recompute each decoder block's activations in the backward pass instead of keeping them.

A block's backward needs what its forward made (the FFW's gate and up
projections, the attention scores); kept for every block at once they are most of a step's
memory above the weights. Rematerialised, only each block's input is kept,
and one block's activations exist at a time, recomputed during the backward:
one more forward pass. With the base frozen the backward costs about one forward
(no weight gradients), so that is about half again the compute for a fraction
of the activation memory; measured at gemma-2b on TensorFlow on a CPU, a step
took about 30% longer.

keras.RematScope cannot do it for keras-hub's blocks on TensorFlow: they are
called with keyword arguments, which tf.recompute_grad refuses in a graph. So
each block's `call` is wrapped (on the instance, as attention.py does) to pass
its tensors positionally to `keras.remat`. Generation, which passes a cache,
runs the block as it is. The recomputation runs in the backward, outside the
block's call, so it re-enters keras' call context with the forward's training
flag (keras_compat.calling): LoRA dropout reads it there, and draws the
forward's masks (lora_dropout.py).
"""

from __future__ import annotations

import functools
import inspect

import keras

from finetune.model import families
from finetune.platform import keras_compat


def enable(backbone) -> int:
    """Rematerialise every decoder block of `backbone`; returns how many were wrapped (idempotent)."""
    wrapped = 0
    for block in families.decoder_blocks(backbone):
        if getattr(block.call, "rematerialized", False):
            continue
        keras_compat.replace_call(block, _recomputed(block, block.call), takes_training=True)
        wrapped += 1
    return wrapped


def _recomputed(block, call):
    names = list(inspect.signature(call).parameters)
    takes_training = "training" in names  # Gemma 3n's blocks do

    @functools.wraps(call)
    def recomputed_call(*args, training=None, **kwargs):
        if takes_training:
            kwargs["training"] = training
        bound = {**dict(zip(names, args)), **kwargs}
        if bound.get("cache") is not None:
            return call(*args, **kwargs)
        tensors = {name: value for name, value in bound.items() if _is_tensor(value)}
        others = {name: value for name, value in bound.items() if name not in tensors}

        def recomputable(*values):
            with keras_compat.calling(block, training):
                return call(**dict(zip(tensors, values)), **others)

        return _remat(recomputable)(*tensors.values())

    recomputed_call.rematerialized = True
    return recomputed_call


def _is_tensor(value) -> bool:
    return value is not None and keras.ops.is_tensor(value)


def _remat(function):
    """keras.remat, but on JAX a recomputation that XLA's CPU compiler cannot merge back into the forward.

    jax.checkpoint fences the backward's recomputation with an optimization barrier, which XLA's CPU
    pipeline expands away before it eliminates common subexpressions: the recomputed block is then the
    forward's own ops, whose results stay alive from the forward to the backward, and remat saves nothing
    (a 16-layer probe's compiled gradient had the same temporaries with and without it). Here the backward
    recomputes from its input plus zero times one element of the incoming gradient: the same values
    bit for bit, but ops that wait for the gradient and are not the forward's. The block's weights are the
    function's closure (keras' stateless scope); jax.closure_convert makes them explicit inputs, so
    their gradients flow as keras.remat's do.
    """
    if keras.config.backend() != "jax":
        return keras.remat(function)
    import jax

    def recomputed(*tensors):
        pure, weights = jax.closure_convert(function, *tensors)
        floating = [jax.numpy.issubdtype(t.dtype, jax.numpy.floating) for t in tensors]

        @jax.custom_vjp
        def block(tensors, weights):
            return pure(*tensors, *weights)

        def forward(tensors, weights):
            return block(tensors, weights), (tensors, weights)

        def backward(kept, gradient):
            tensors, weights = kept
            first = jax.tree_util.tree_leaves(gradient)[0].reshape(-1)[0]
            tied = [t + (first * 0).astype(t.dtype) if f else t for t, f in zip(tensors, floating)]
            _, pullback = jax.vjp(lambda ts, ws: pure(*ts, *ws), tuple(tied), tuple(weights))
            return pullback(gradient)

        block.defvjp(forward, backward)
        return block(tuple(tensors), tuple(weights))

    return recomputed
