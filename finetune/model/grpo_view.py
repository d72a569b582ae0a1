"""The view that trains GRPO's clipped objective (methods/grpo.py) on SFT's response-token machinery.

A rollout row is a prompt and one sampled completion, weighted on the
completion's tokens; the backbone's hidden states are gathered at those
positions and each position's log-probability comes from
objective.token_losses at the sampling temperature, as TRL's
_get_per_token_logps divides the logits by it. Beside the gathered labels each
slot carries its completion's advantage, and where asked its log-probability
when sampled (--num-iterations above 1) and under the base (--beta above 0).

call() returns (rows, width, len(COLUMNS)): each position's loss, then what
TRL logs of it. The loss is TRL's per-token loss,
-min(r A, clip(r, 1 - eps, 1 + eps_high) A) + beta k3, r = exp(logp - old);
the sample weights (column 0 alone) make it the --loss-type's average
(methods/grpo.py, `token_weights`), summed by objective.TokenShare.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
from keras import ops

from finetune.model import objective

COLUMNS = ("loss", "kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "entropy", "logps")
METRICS = ("kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "entropy")


@dataclass(frozen=True)
class Objective:
    """GRPO's constants, as the method decided them (TRL's GRPOConfig names).

    beta: float. The weight of the KL to the base (k3); 0: no reference pass.
    epsilon, epsilon_high: float. The clip range, (1 - epsilon, 1 + epsilon_high).
    temperature: float. The rollouts' sampling temperature, which the log-probabilities are taken at.
    fresh: bool. The rollouts train one optimizer step (--num-iterations 1): their log-probabilities when
        sampled are the current ones, detached (TRL's shortcut), so no scoring pass is needed.
    """

    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    temperature: float = 1.0
    fresh: bool = True

    columns = COLUMNS  # the view's output columns; the last is each slot's log-probability (rollouts.score_logps)

    @property
    def scores_old(self) -> bool:
        """The rollouts score each slot's log-probability when sampled (loss_old): the loss takes it."""
        return not self.fresh

    def view(self, lm, chunk: int, shards: int = 1) -> GRPOView:
        return GRPOView(lm, chunk, self, shards, dtype=keras.config.dtype_policy())


def token_values(objective_: Objective, logps, old, reference, advantages, entropy=None):
    """(..., len(COLUMNS)) float32: each token's loss and TRL's metrics of it, from its log-probability now,
    when sampled (`old`; ignored where objective_.fresh), under the base (`reference`; ignored where beta is 0),
    and its completion's advantage; `entropy`, the softmax's at the token (TRL's metric), is passed through
    (0 where None). Every argument has one shape."""
    old = ops.stop_gradient(logps) if objective_.fresh else old
    ratio = ops.exp(logps - old)
    clipped = ops.clip(ratio, 1.0 - objective_.epsilon, 1.0 + objective_.epsilon_high)
    loss = -ops.minimum(ratio * advantages, clipped * advantages)
    kl = ops.zeros_like(logps)
    if objective_.beta != 0.0:
        kl = ops.exp(reference - logps) - (reference - logps) - 1.0
        loss = loss + objective_.beta * kl
    low = ops.logical_and(ratio < 1.0 - objective_.epsilon, advantages < 0)
    high = ops.logical_and(ratio > 1.0 + objective_.epsilon_high, advantages > 0)
    region = ops.logical_or(low, high)
    flags = [ops.cast(f, "float32") for f in (low, high, region)]
    entropy = ops.zeros_like(logps) if entropy is None else ops.stop_gradient(ops.cast(entropy, "float32"))
    return ops.stack([loss, ops.stop_gradient(kl), *flags, entropy, ops.stop_gradient(logps)], axis=-1)


class GRPOView(objective.TrainingView):
    """`lm`'s backbone with GRPO's loss: call() returns each gathered position's loss and metrics,
    (rows, width, len(COLUMNS)).

    Beside a TrainingView's inputs it takes `loss_advantages`, `loss_old` and `loss_reference`, each
    (rows, width) as the gathered labels are laid out.
    """

    def __init__(self, lm, chunk: int, objective_: Objective, shards: int = 1, **kwargs):
        super().__init__(lm, chunk, shards, **kwargs)
        self.objective = objective_

    @property
    def input_dtype(self):
        """float32 for the float inputs: a log-probability in bfloat16 is off by up to 0.03 at -8 nats, which the
        ratio exp(logp - old) would take for a step of the policy."""
        return "float32"

    def call(self, inputs, training=None):
        t = objective.targets(self.lm.backbone, inputs, self.shards, training=training)
        # The logits at the sampling temperature, as keras-hub's samplers divide the (capped) logits: a kernel and
        # a soft cap both divided by T give exactly that, cap/T tanh((x/T) / (cap/T)) = (cap tanh(x / cap)) / T.
        temperature = self.objective.temperature
        t = t._replace(kernel=t.kernel / ops.cast(temperature, t.kernel.dtype),
                       soft_cap=t.soft_cap / temperature if t.soft_cap is not None else None)  # fmt: skip
        shape = ops.shape(inputs["loss_labels"])
        entropy = None
        if training:  # with each token's entropy, made from the logits the loss makes (TRL's metric)
            both = objective.token_losses_and_entropies(t, self.chunk)
            losses, entropy = both[:, 0], ops.reshape(both[:, 1], shape)
        else:  # scoring (the rollouts' old and reference log-probabilities): no custom-gradient op
            losses, _ = objective.token_scores(t, self.chunk)
        return self.values(inputs, -ops.reshape(losses, shape), entropy)

    def values(self, inputs, logps, entropy):
        """(rows, width, len(columns)): each slot's loss and metrics, from its log-probability now (`logps`) and
        its entropy (None where not training)."""
        given = [ops.cast(inputs[name], "float32") for name in ("loss_old", "loss_reference", "loss_advantages")]
        return token_values(self.objective, logps, *given, entropy=entropy)

    def step_metrics(self) -> list:
        return [objective.ColumnMean(COLUMNS.index(name), name, by_weight=False) for name in METRICS]

    def compute_output_spec(self, inputs):
        return keras.KerasTensor((*inputs["loss_labels"].shape, len(self.objective.columns)), dtype="float32")
