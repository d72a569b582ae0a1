"""The view that trains a preference loss (methods/preference.py: DPO, IPO, ORPO, SimPO) on SFT's response-token
machinery.

A batch of B pairs is 2B rows, the chosen answers' then the rejected answers'
(as TRL's concatenated forward lays them out), each weighted 1 on its answer's
tokens. The backbone's hidden states are gathered at those positions and each
position's loss comes from objective.token_losses, as for SFT, so the
vocabulary projection costs what the loss needs; its custom gradient takes any
upstream gradient, so the per-pair loss made of them trains as SFT's does.
Summed per sequence (the `loss_sequence` input names each position's
sequence: its row, or, packed, its segment: data/pair_packing.py), they are
each answer's log-probability, log π(y | x); the pair's loss is made of those
(docs/preference.md, "Losses and defaults"). The sequences are counted by
`loss_reference`, one per sequence, not by the rows: a packed micro-batch of R
rows holds 2S sequences, and its labels and sample weights have 2S rows.

call() returns, for each pair i, in row i (rows B..2B-1 hold zeros):
COLUMNS = loss, rewards_chosen, rewards_rejected, reward_accuracy,
reward_margin, logps_chosen, logps_rejected. Training weighs column 0 alone
(objective.TokenShare sums output times weight); the others are reported as
TRL names them, through objective.ColumnMean metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import keras
from keras import ops

from finetune.data import pair_batches
from finetune.model import objective

COLUMNS, METRICS = pair_batches.COLUMNS, pair_batches.METRICS


@dataclass(frozen=True)
class Objective:
    """A preference loss and its constants, as the method (methods/preference.py) decided them.

    name: str. The method's name, as config.yaml records it.
    loss: callable(chosen, rejected, reference, count, objective, nll) -> (loss, (reward_chosen, reward_rejected)),
        each (B,): the pair loss from each answer's log-probability (length-averaged where `averaged`), the
        reference log-probabilities and the answers' token counts, each (2B,) with the chosen rows first, and the
        chosen sequences' NLL (a scalar where `whole_chosen`, else None).
    beta: float. DPO's and SimPO's beta; IPO's tau; ORPO's lambda.
    label_smoothing: float. DPO's epsilon.
    gamma: float. SimPO's target margin.
    averaged: bool. The log-probabilities are per answer token (ORPO, SimPO); else summed over the answer.
    needs_reference: bool. The loss compares against the base's log-probabilities, scored once before training.
    whole_chosen: bool. The loss takes the NLL of the chosen sequences' every token, prompt and answer (ORPO, as
        TRL's ORPOTrainer), a token mean over the batch: its rows carry every target (pair_batches.PairArrays),
        and `loss_answer` marks the answers' slots among them.
    """

    name: str
    loss: Callable
    beta: float
    label_smoothing: float = 0.0
    gamma: float = 0.0
    averaged: bool = False
    needs_reference: bool = False
    whole_chosen: bool = False

    def view(self, lm, chunk: int, shards: int = 1) -> PreferenceView:
        """The view of `lm` that trains (and scores) this loss."""
        return PreferenceView(lm, chunk, self, shards, dtype=keras.config.dtype_policy())


def sequence_logps(token_losses, weights, sequence, rows: int):
    """(each row's summed log-probability, each row's weighted token count), from the gathered positions'.

    token_losses, weights, sequence: (N,): each position's loss, weight (1 on answers, 0 on padding slots) and
    row. A one-hot matmul sums them: N x rows is small, and it has a gradient on every backend.
    """
    one_hot = ops.one_hot(ops.cast(sequence, "int32"), rows, dtype="float32")
    mask = ops.cast(weights > 0, "float32")
    logp = ops.matmul(ops.expand_dims(-token_losses * mask, 0), one_hot)[0]
    count = ops.matmul(ops.expand_dims(mask, 0), one_hot)[0]
    return logp, count


def pair_values(objective_: Objective, logp, count, reference, whole=None):
    """(B, 7) float32: each pair's loss and metrics (COLUMNS) from its 2B rows' log-probabilities.

    logp, count, reference: (2B,): each row's summed log-probability, answer tokens, and reference log-probability
    (DPO's; zeros otherwise). Rows 0..B-1 are the chosen answers, B..2B-1 the rejected.
    whole: (logp, scale) where the objective is `whole_chosen`: each row's log-probability over its every target,
        prompt and answer, and each chosen token's NLL weight (pair_batches.nll_scale: the step's pairs over its
        chosen tokens), so that the pairs' mean is the token mean over the step's chosen sequences.
    """
    half = logp.shape[0] // 2
    nll = None
    if whole is not None:  # every token of the batch's chosen sequences, a mean over them (filler rows have none)
        nll = -whole[0][:half] * whole[1][:half]
    if objective_.averaged:  # a filler row has no tokens: 1 keeps its (unweighted) value finite
        logp = logp / ops.maximum(count, 1.0)
    loss, rewards = objective_.loss(logp[:half], logp[half:], reference, count, objective_, nll)
    return _reported(loss, rewards, logp[:half], logp[half:])


def _reported(loss, rewards, chosen, rejected):
    """(B, 7): the loss and TRL's metrics, which carry no gradient."""
    good, bad = (ops.stop_gradient(r) for r in rewards)
    accuracy = ops.cast(good > bad, "float32")
    reported = [good, bad, accuracy, good - bad, ops.stop_gradient(chosen), ops.stop_gradient(rejected)]
    return ops.stack([loss, *reported], axis=1)


class PreferenceView(objective.TrainingView):
    """`lm`'s backbone with a preference loss: call() returns each pair's loss and metrics, (2B, 7), in its
    first B rows.

    Beside a TrainingView's inputs it takes `loss_sequence` (each gathered slot's row in the batch) and
    `loss_reference` (each row's reference log-probability: DPO's, from reference(); zeros for the others).
    Compiled with TokenShare and column-0 weights of each pair's share of its step, train_on_batch minimises the
    mean pair loss of the step, however its pairs fall into micro-batches.
    """

    def __init__(self, lm, chunk: int, objective_: Objective, shards: int = 1, **kwargs):
        super().__init__(lm, chunk, shards, **kwargs)
        self.objective = objective_

    @property
    def input_dtype(self):
        """float32 for the view's float inputs, whatever the policy: keras casts them to the compute dtype, and a
        reference log-probability (a sum over an answer, -40 or -200) cast to bfloat16 is off by up to 0.1 or 0.5
        nats, which the loss took for a margin (a fresh DPO run scored 0.696, not ln 2, in bfloat16). The backbone
        casts what it computes itself."""
        return "float32"

    def call(self, inputs, training=None):
        t = objective.targets(self.lm.backbone, inputs, self.shards, training=training)
        weights = t.weights
        if training:
            losses = objective.token_losses(t, self.chunk)
        else:  # scoring (the reference pass, held-out pairs): no gradient, so no custom-gradient op, which
            # TensorFlow refuses outside a training step when it reads the embedding variable
            losses, _ = objective.token_scores(t, self.chunk)
        rows = inputs["loss_reference"].shape[0]  # the sequences: 2B, or 2S of a packed micro-batch's R rows
        sequence = ops.reshape(inputs["loss_sequence"], (-1,))
        whole = None
        if self.objective.whole_chosen:
            whole = (sequence_logps(losses, weights, sequence, rows)[0], ops.cast(inputs["loss_nll_scale"], "float32"))
            weights = weights * ops.reshape(ops.cast(inputs["loss_answer"], weights.dtype), (-1,))
        logp, count = sequence_logps(losses, weights, sequence, rows)
        values = pair_values(self.objective, logp, count, ops.cast(inputs["loss_reference"], "float32"), whole)
        return ops.concatenate([values, ops.zeros_like(values)], axis=0)

    def step_metrics(self) -> list:
        """TRL's metrics of the step's pairs, each a mean weighted as the loss weighs them."""
        return metrics()

    def compute_output_spec(self, inputs):
        return keras.KerasTensor((inputs["loss_reference"].shape[0], len(COLUMNS)), dtype="float32")


def metrics() -> list:
    """The step's TRL-named metrics, each an objective.ColumnMean of its column over the pairs."""
    return [objective.ColumnMean(index + 1, name) for index, name in enumerate(METRICS)]
