"""ScoreHead: n scores of a sequence from the backbone's final hidden state at its last token.

transformers' AutoModelForSequenceClassification puts a linear layer without a bias on the decoder's final
(normed) hidden states and reads it at each sequence's last non-padding token; TRL's RewardTrainer trains one of
n=1 as a reward model. This is that layer, made once: the reward model (model/reward_view.py, --method reward)
uses it with one output, and a classifier (model/classify_view.py, --method classify) uses it with one output per label.

The last token is found from the gathered target slots (objective._gathered): a sequence's target slots are its
answer's positions in order, and the last of them is the position of its last input token (whose label is the
closing <eos>, or the last answer token where the answer was cut), packed or not.
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops


class ScoreHead(keras.layers.Layer):
    """A linear map without a bias from a hidden state to `outputs` scores, in float32.

    Args:
        outputs: int. The scores it gives each sequence: 1 for a reward model, the labels for a classifier.
        hidden: int. The backbone's hidden size.
        seed: int. The numpy seed of its starting weights: a normal of standard deviation 1/sqrt(hidden), drawn
            alike on every backend (transformers' draws 0.02 with torch's generator, which no backend shares).
    """

    def __init__(self, outputs: int, hidden: int, seed: int = 0, **kwargs):
        super().__init__(dtype="float32", **kwargs)
        # === Config ===
        self.outputs, self.hidden, self.seed = outputs, hidden, seed
        # === Layers ===
        self.kernel = self.add_weight(shape=(hidden, outputs), initializer="zeros", name="kernel")
        rng = np.random.default_rng(seed)
        self.kernel.assign(rng.normal(0.0, 1.0 / math.sqrt(hidden), (hidden, outputs)).astype("float32"))
        self.built = True

    def call(self, states):
        """(S, outputs) float32 scores of (S, hidden) states, computed in float32 whatever the policy."""
        return ops.matmul(ops.cast(states, "float32"), self.kernel)

    def get_config(self):
        return {**super().get_config(), "outputs": self.outputs, "hidden": self.hidden, "seed": self.seed}


def last_states(hidden, weights, sequence, sequences: int):
    """(sequences, hidden): each sequence's hidden state at its last target slot.

    hidden: (N, D): the gathered slots' hidden states. weights: (N,): each slot's weight (0 for a padding slot).
    sequence: (N,): each slot's sequence, 0..sequences-1. A sequence with no slot (a filler pair's, whose weights
    are zeroed) reads slot 0: a value its zero weight discards.
    """
    count = hidden.shape[0]
    index = ops.cast(ops.arange(count), "float32") + 1.0
    marked = ops.where(weights > 0, index, 0.0)  # 0: not a slot of any sequence
    one_hot = ops.one_hot(ops.cast(sequence, "int32"), sequences, dtype="float32")  # (N, S)
    last = ops.max(one_hot * ops.expand_dims(marked, 1), axis=0)  # (S,): 1 + the last slot, or 0
    return ops.take(hidden, ops.cast(ops.maximum(last - 1.0, 0.0), "int32"), axis=0)
