"""The view that trains a sequence classifier (methods/classify.py, --method classify): the backbone with LoRA and
a ScoreHead of one output per class, with the cross-entropy of each sequence's class.

A classifier's example (methods/classify.py) weighs one slot alone: its last input token's, whose label is the
class id. So the gathered slots (objective._gathered) are, in order, each sequence's last token, packed or not,
and the head reads the backbone's final hidden state there: transformers' AutoModelForSequenceClassification's
last non-padding token. No vocabulary projection is made.

call() returns each slot's cross-entropy, shaped as loss_labels (a TrainingView's output), so TokenShare's mean
over the weighted slots is the mean over the step's sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
from keras import ops

from finetune.model import objective, score_head


@dataclass(frozen=True)
class Objective:
    """The classifier's loss and its head.

    classes: int. The head's outputs, one a label.
    seed: int. The head's starting weights (ScoreHead).
    """

    classes: int
    seed: int = 0
    name: str = "classify"

    def view(self, lm, chunk: int = 0, shards: int = 1) -> ClassifyView:
        """The view of `lm` that trains (and scores) this loss, with a head of its own."""
        return ClassifyView(lm, chunk, self, shards, dtype=keras.config.dtype_policy())


def cross_entropy(logits, labels):
    """(N,) float32: each row's cross-entropy of `labels` under `logits` (N, classes)."""
    picked = ops.take_along_axis(logits, ops.expand_dims(ops.cast(labels, "int32"), -1), axis=-1)[:, 0]
    return ops.logsumexp(logits, axis=-1) - picked


class ClassifyView(objective.TrainingView):
    """`lm`'s backbone and a ScoreHead of `classes` outputs; the head is the view's own layer, so the trainer's
    variables (what a checkpoint keeps, what the optimizer steps) hold it."""

    def __init__(self, lm, chunk: int, objective_: Objective, shards: int = 1, **kwargs):
        super().__init__(lm, chunk, shards, **kwargs)
        self.objective = objective_
        hidden = int(objective.logit_projection(lm.backbone)[0].shape[-1])
        self.head = score_head.ScoreHead(objective_.classes, hidden, objective_.seed, name="score_head")

    def logits(self, inputs, training=None):
        """(slots, classes) float32: the head's scores at every gathered slot (the weighted ones are sequences)."""
        return self.head(objective._gathered(self.lm.backbone, inputs, self.shards, training=training))

    def call(self, inputs, training=None):
        labels = ops.reshape(inputs["loss_labels"], (-1,))
        # A filler slot's label is 0 and its weight 0; a class id is below `classes` (methods/classify.py).
        losses = cross_entropy(self.logits(inputs, training), ops.minimum(labels, self.objective.classes - 1))
        return ops.reshape(losses, ops.shape(inputs["loss_labels"]))
