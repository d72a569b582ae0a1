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

        return keras.remat(recomputable)(*tensors.values())

    recomputed_call.rematerialized = True
    return recomputed_call


def _is_tensor(value) -> bool:
    return value is not None and keras.ops.is_tensor(value)
