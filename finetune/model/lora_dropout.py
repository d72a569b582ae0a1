"""LoRA dropout's masks: each a pure function of the run's seed, the layer, and the training pass.

--remat recomputes each decoder block in the backward, and the recomputation must drop the inputs its forward
dropped. A keras SeedGenerator advances its state at every draw, so under remat PyTorch's and TensorFlow's
recomputation drew new masks (half their positions differed from the forward's: silently wrong gradients),
PyTorch's checkpoint refused the state's update (a different number of tensors saved), and JAX's let the
update escape jax.checkpoint (UnexpectedTracerError).

Here each adapted layer keeps a constant seed, and the backbone one count of its training passes, advanced as a
pass enters the backbone, outside every block: each draw of a pass, in the forward or recomputed, reads the same
(layer seed, count). The count is a SeedGenerator's state, the kind of state keras keeps apart from the
weights: JAX's and TensorFlow's traced steps read it as state, a checkpoint keeps it (training/checkpoint.kept),
so a resumed run draws the masks the whole run would have, and the backbone's saved weights do not hold it.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import numpy as np

from finetune.platform import keras_compat


@dataclass(frozen=True)
class Seed:
    """What one layer's masks are drawn from: its own constant, and the backbone's count of training passes."""

    layer: int
    passes: keras.random.SeedGenerator  # the backbone's, shared by every adapted layer: its state is (seed, count)

    def count(self):
        return self.passes.state.value[1]


def enable(backbone, layers, rate: float, seed: int) -> None:
    """Dropout of `rate` on the LoRA input of each of `layers` (builder._with_lora draws it with dropped()), the
    layers' seeds drawn from the numpy seed `seed`, apart from the factors' draws."""
    rng = np.random.default_rng([seed, 1])
    passes = getattr(backbone, "lora_dropout_passes", None)
    if passes is None:
        with keras_compat.adding_variables(backbone):
            # Its state is (0, count): only the count is read, the layers' constants carry the run's seed.
            backbone.lora_dropout_passes = passes = keras.random.SeedGenerator(0, name="lora_dropout_passes")
        _count_training_passes(backbone, passes)
    for layer in layers:
        layer.lora_dropout = rate
        layer.lora_dropout_seed = Seed(int(rng.integers(2**31)), passes)


def _count_training_passes(backbone, passes) -> None:
    own = backbone.call

    def call(inputs, training=None, **kwargs):
        if training:
            passes.next()  # the state's count goes up by one
        return own(inputs, training=training, **kwargs)

    keras_compat.replace_call(backbone, call)


def dropped(inputs, rate: float, seed: Seed):
    """`inputs` with a `rate` of its values zeroed and the rest scaled by 1 / (1 - rate), the mask drawn from
    `seed`: the same for the same layer and pass."""
    backend = keras.config.backend()
    if backend == "jax":
        import jax

        key = jax.random.fold_in(jax.random.key(seed.layer), seed.count())
        kept = jax.random.bernoulli(key, 1.0 - rate, inputs.shape)
        return jax.numpy.where(kept, inputs / (1.0 - rate), 0)
    if backend == "tensorflow":
        import tensorflow as tf

        pair = tf.stack([tf.constant(seed.layer, tf.int64), tf.cast(seed.count(), tf.int64)])
        return tf.nn.experimental.stateless_dropout(inputs, rate, seed=pair)
    # PyTorch runs eagerly, and its generators take a Python int: one for each (layer, pass).
    count = int(keras.ops.convert_to_numpy(seed.count()))
    mixed = np.random.SeedSequence([seed.layer, count]).generate_state(1)[0]
    return keras.random.dropout(inputs, rate, seed=int(mixed))
