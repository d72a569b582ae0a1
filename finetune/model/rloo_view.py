"""The view that trains RLOO's clipped objective (methods/rloo.py): GRPO's view (grpo_view.py), its loss made per
sequence.

TRL's RLOOTrainer clips each completion's ratio as a whole: r = exp(sum of the
completion's token log-probabilities now - their sum when sampled), and the
loss is the mean over completions of -min(r A, clip(r, 1 - eps, 1 + eps_high) A).
Its KL to the base is no term of the loss but a penalty on the reward, taken
when the rollouts are scored (methods/rloo.py).

A micro-batch's completion tokens are gathered into (rows, width) slots that do
not line up with the rows (batching.targets): `loss_positions // seq_len` is
each slot's row within its data shard. Each completion's sums are made over its
slots by a one-hot matrix of slots by rows, and its loss is set at each of its
slots; the sample weights (rollouts.token_weights' "grpo", 1 / (rows x its
tokens)) make objective.TokenShare's sum the mean over the step's completions.

call() returns (rows, width, len(COLUMNS)): each slot's completion's loss, then
what TRL logs of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
from keras import ops

from finetune.model import grpo_view, objective

COLUMNS = ("loss", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "entropy", "logps")
SEQUENCE_METRICS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region")  # TRL's means over completions
TOKEN_METRICS = ("entropy",)  # TRL's mean over completion tokens


@dataclass(frozen=True)
class Objective(grpo_view.Objective):
    """RLOO's constants, as the method decided them (TRL's RLOOConfig names): GRPO's, where beta is the weight of
    the KL penalty on the reward (k1, summed over each completion), which the rollouts take off the rewards."""

    columns = COLUMNS

    @property
    def scores_old(self) -> bool:
        """The KL penalty takes the log-probabilities when sampled, whatever --num-iterations."""
        return not self.fresh or self.beta != 0.0

    def view(self, lm, chunk: int, shards: int = 1) -> RLOOView:
        return RLOOView(lm, chunk, self, shards, dtype=keras.config.dtype_policy())


def slot_rows(positions, seq_len, shards: int):
    """Each slot's row in the batch, (rows, width) int32, from its gathered position (row-in-shard * seq_len +
    position: batching.targets)."""
    rows = positions.shape[0]
    per_shard = rows // shards
    first = (ops.arange(rows, dtype="int32") // per_shard) * per_shard
    return first[:, None] + ops.floor_divide(ops.cast(positions, "int32"), ops.cast(seq_len, "int32"))


def sequence_values(objective_: Objective, logps, old, advantages, slots, entropy=None):
    """(rows, width, len(COLUMNS)) float32: each slot's completion's loss and TRL's clip flags, its entropy, its
    log-probability.

    logps, old, advantages: (rows, width), each slot's log-probability now, when sampled (ignored where
    objective_.fresh), and its completion's advantage; slots: (rows, real), each slot's row in the batch
    (slot_rows) and whether it holds a completion token (the padding slots do not); entropy: each slot's, passed
    through (0 where None).
    """
    count, (rows, real) = logps.shape[0], slots
    real = ops.cast(real, "float32")
    spread = ops.one_hot(rows, count, dtype="float32") * real[..., None]  # (rows, width, sequences)
    now = ops.einsum("rws,rw->s", spread, logps)
    then = ops.stop_gradient(now) if objective_.fresh else ops.einsum("rws,rw->s", spread, old)
    # Each completion's advantage, as its slots carry it (all alike): their mean
    given = ops.einsum("rws,rw->s", spread, advantages) / ops.maximum(ops.sum(spread, axis=(0, 1)), 1.0)
    ratio = ops.exp(now - then)
    clipped = ops.clip(ratio, 1.0 - objective_.epsilon, 1.0 + objective_.epsilon_high)
    loss = -ops.minimum(ratio * given, clipped * given)
    low = ops.logical_and(ratio < 1.0 - objective_.epsilon, given < 0)
    high = ops.logical_and(ratio > 1.0 + objective_.epsilon_high, given > 0)
    per_sequence = [loss] + [ops.cast(f, "float32") for f in (low, high, ops.logical_or(low, high))]
    back = [ops.einsum("rws,s->rw", spread, value) for value in per_sequence]  # each at its completion's slots
    entropy = ops.zeros_like(logps) if entropy is None else ops.stop_gradient(ops.cast(entropy, "float32"))
    return ops.stack([back[0], *(ops.stop_gradient(b) for b in back[1:]), entropy, ops.stop_gradient(logps)], axis=-1)


class RLOOView(grpo_view.GRPOView):
    """GRPO's view with RLOO's sequence-level loss (sequence_values). Its inputs are GRPO's view's: loss_reference
    is read by the rollouts alone (the KL penalty), not by the loss."""

    def values(self, inputs, logps, entropy):
        rows = slot_rows(inputs["loss_positions"], ops.shape(inputs["token_ids"])[1], self.shards)
        real = ops.cast(inputs["loss_weights"], "float32") > 0
        given = [ops.cast(inputs[name], "float32") for name in ("loss_old", "loss_advantages")]
        return sequence_values(self.objective, logps, *given, (rows, real), entropy=entropy)

    def step_metrics(self) -> list:
        """The clip ratios' means over the completions (each slot by its sample weight, 1 / its completion's tokens),
        the entropy's over the completion tokens, as TRL's."""
        return [objective.ColumnMean(COLUMNS.index(name), name, by_weight=True) for name in SEQUENCE_METRICS] + [
            objective.ColumnMean(COLUMNS.index(name), name, by_weight=False) for name in TOKEN_METRICS
        ]
