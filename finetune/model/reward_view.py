"""The view that trains a reward model (methods/reward.py, --method reward): the backbone with LoRA and a ScoreHead
of one output, on preference pairs, with TRL's RewardTrainer's Bradley-Terry loss.

A batch of B pairs is 2B sequences, the chosen answers' then the rejected answers' (data/pair_batches.py, or
packed: data/pair_packing.py), as for DPO. Each sequence's reward is the head's score of the backbone's final
hidden state at its last token (score_head.last_states); no vocabulary projection is made. The pair's loss is
TRL's, -log sigmoid(r_chosen - r_rejected), plus, with --center-rewards C, C (r_chosen + r_rejected)^2, whose
mean over the pairs is TRL's center_rewards_coefficient term.

call() returns, for each pair i, in row i (rows B..2B-1 hold zeros): COLUMNS = loss, rewards_chosen,
rewards_rejected, accuracy, margin, then zeros to the preference views' width: the pairs' sample weights
(data/pair_batches.py, pair_packing.py) have a column for each of theirs. Training weighs column 0 alone
(objective.TokenShare sums output times weight), as the preference views do.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
from keras import ops

from finetune.data import pair_batches
from finetune.model import objective, score_head

COLUMNS = ("loss", "rewards_chosen", "rewards_rejected", "accuracy", "margin")
METRICS = COLUMNS[1:]
WIDTH = len(pair_batches.COLUMNS)  # the pairs' sample weights' columns


@dataclass(frozen=True)
class Objective:
    """The reward model's loss and what its head starts from.

    center_rewards: float. TRL's center_rewards_coefficient: the weight of the mean squared sum of a pair's
        rewards, which keeps them centred on 0; 0 leaves it out.
    seed: int. The head's starting weights (ScoreHead).
    """

    center_rewards: float = 0.0
    seed: int = 0
    name: str = "reward"

    def view(self, lm, chunk: int = 0, shards: int = 1) -> RewardView:
        """The view of `lm` that trains (and scores) this loss, with a head of its own."""
        return RewardView(lm, chunk, self, shards, dtype=keras.config.dtype_policy())


def bradley_terry(chosen, rejected, center_rewards: float = 0.0):
    """Each pair's loss from its two rewards, (B,) each: TRL's RewardTrainer's, per pair."""
    loss = -ops.log_sigmoid(chosen - rejected)
    if center_rewards:
        loss = loss + center_rewards * ops.square(chosen + rejected)
    return loss


def pair_values(rewards, center_rewards: float = 0.0):
    """(B, WIDTH) float32: each pair's loss and metrics (COLUMNS, then zeros) from its 2B sequences' rewards, chosen
    first."""
    half = rewards.shape[0] // 2
    chosen, rejected = rewards[:half], rewards[half:]
    loss = bradley_terry(chosen, rejected, center_rewards)
    good, bad = ops.stop_gradient(chosen), ops.stop_gradient(rejected)
    columns = [loss, good, bad, ops.cast(good > bad, "float32"), good - bad]
    return ops.stack(columns + [ops.zeros_like(loss)] * (WIDTH - len(columns)), axis=1)


class RewardView(objective.TrainingView):
    """`lm`'s backbone and a ScoreHead of one output: call() returns each pair's loss and metrics, (2B, WIDTH), in its
    first B rows (COLUMNS, then zeros). It takes a preference view's inputs (pair_view.PreferenceView): the gathered answer slots and
    `loss_sequence`, each slot's sequence; `loss_reference` counts the sequences. The head is the view's own
    layer, so the trainer's variables (what a checkpoint keeps, what the optimizer steps) hold it."""

    def __init__(self, lm, chunk: int, objective_: Objective, shards: int = 1, **kwargs):
        super().__init__(lm, chunk, shards, **kwargs)
        self.objective = objective_
        hidden = int(objective.logit_projection(lm.backbone)[0].shape[-1])
        self.head = score_head.ScoreHead(1, hidden, objective_.seed, name="score_head")

    @property
    def input_dtype(self):
        return "float32"  # loss_reference is read for its shape alone; the ids are cast by the backbone

    def rewards(self, inputs, training=None):
        """(S,) float32: each sequence's reward."""
        hidden = objective._gathered(self.lm.backbone, inputs, self.shards, training=training)
        weights = ops.reshape(inputs["loss_weights"], (-1,))
        sequence = ops.reshape(inputs["loss_sequence"], (-1,))
        sequences = inputs["loss_reference"].shape[0]
        return self.head(score_head.last_states(hidden, weights, sequence, sequences))[:, 0]

    def call(self, inputs, training=None):
        values = pair_values(self.rewards(inputs, training), self.objective.center_rewards)
        return ops.concatenate([values, ops.zeros_like(values)], axis=0)

    def step_metrics(self) -> list:
        """TRL's RewardTrainer's metrics of the step's pairs, each a mean weighted as the loss weighs them."""
        return [objective.ColumnMean(index + 1, name) for index, name in enumerate(METRICS)]

    def compute_output_spec(self, inputs):
        return keras.KerasTensor((inputs["loss_reference"].shape[0], WIDTH), dtype="float32")
