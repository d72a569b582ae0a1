"""RLOO: online RL on prompts, as GRPO (grpo.py), with TRL's RLOOTrainer's advantages and loss.

The rollouts are GRPO's (rollouts.py): --num-generations completions of each
prompt, scored by the same reward functions. What differs, as TRL's:

- the KL to the base is a penalty on the reward, not a term of the loss: each
  completion's k1 estimate, the sum over its tokens of (log-probability when
  sampled - under the base), times --beta, is taken off its reward;
- a completion's advantage is its reward less the mean reward of the other
  completions of its prompt (leave-one-out), over the scorable ones alone (a
  completion no reward function scored has none and is left out of the mean),
  optionally normalised over the batch (--normalize-advantages);
- the loss is per completion (model/rloo_view.py): its ratio is that of the
  whole sequence, exp(sum of its log-probabilities now - when sampled), clipped
  as GRPO's, and the loss is the mean over the step's completions.

The constants, their names and defaults are TRL's RLOOConfig's (docs/rl.md);
TRL's code checks ours on the same numbers in tests/test_rloo_trl.py.
"""

from __future__ import annotations

import warnings

import numpy as np

from finetune.methods import rollouts
from finetune.methods.grpo import GRPO


def leave_one_out(table: np.ndarray, weights: np.ndarray, generations: int, penalty=None, normalize: bool = False):
    """(each completion's advantage, the rewards' statistics): TRL's RLOOTrainer's.

    table: (completions, functions), NaN where a function gave None; rows are G to a prompt, in order.
    penalty: (completions,) or None: beta x each completion's KL, taken off its total reward.
    The total reward is the weighted sum of those given; a completion no function scored is NaN, left out of
    the others' baselines, and its advantage is 0, as is that of the one scorable completion of a group.
    """
    unscorable = np.isnan(table).all(axis=1)
    scored = np.nansum(table * weights[None, :], axis=1)
    scored[unscorable] = np.nan
    rewards = scored if penalty is None else scored - penalty
    grouped = rewards.reshape(-1, generations)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        std = rollouts.nanstd(grouped, axis=1)
        scorable = np.sum(~np.isnan(grouped), axis=1, keepdims=True)
        baselines = (np.nansum(grouped, axis=1, keepdims=True) - grouped) / (scorable - 1)
        out = rewards - baselines.reshape(-1)
        if normalize:  # over the scorable ones (the others are NaN still)
            out = (out - np.nanmean(out)) / (rollouts.nanstd(out) + 1e-4)
    # The statistics are of the rewards before the KL penalty, as TRL logs them; its zero-std groups after it.
    stats = {"reward": rollouts._nanmean(scored), "reward_std": float(rollouts.nanstd(scored)),
             "frac_reward_zero_std": float(np.mean(np.isclose(np.nan_to_num(std, nan=1.0), 0.0)))}  # fmt: skip
    return np.nan_to_num(out, nan=0.0), stats


class LeaveOneOutOrder(rollouts.RolloutOrder):
    """GRPO's rollouts (rollouts.RolloutOrder), with RLOO's advantages, loss weights and metric weights."""

    def advantages(self, table, sums, counts):
        """leave_one_out's, with the KL penalty where --beta: each completion's sum over its tokens of (its
        log-probability when sampled - under the base), and the step's `kl`, their mean per completion token."""
        weights = np.array([r.weight for r in self.prompts.sampling.rewards])
        beta, count = self.constants["beta"], len(table)
        kl = (sums("loss_old") - sums("loss_reference"))[:count] if beta else None
        advantage, stats = leave_one_out(table, weights, self.prompts.sampling.generations,
                                         None if kl is None else beta * kl,
                                         self.constants["normalize_advantages"])  # fmt: skip
        if kl is not None:
            stats["kl"] = float(kl.sum() / max(counts[:count].sum(), 1))
        return advantage, stats

    def loss_weights(self, counts, real, micro_rows):
        """1 / (rows x its tokens) at each completion token: the view's per-completion loss, set at each of its
        slots, sums to the mean over the step's completions."""
        return rollouts.token_weights("grpo", counts, real, micro_rows, self.grad_accum,
                                      self.prompts.sampling.max_completion_length)  # fmt: skip

    def micro_weights(self, counts, real, micro_rows):
        """Each micro-batch's real completions: TRL averages its micro-batches' metrics alike (each holds as many)."""
        return [float(real[s : s + micro_rows].sum()) for s in range(0, len(real), micro_rows)]


class RLOO(GRPO):
    name = "rloo"
    title = "RLOO"
    sequences_per_example = 2  # --num-generations' default: each prompt is G rows
    defaults = {
        "beta": (0.05, "TRL's RLOOConfig: the KL penalty on the reward, against the base (LoRA off)"),
        "num_generations": (2, "TRL's RLOOConfig"),
        "max_completion_length": (256, "half of TRL's 512: a LoRA run on one device"),
        "temperature": (1.0, "TRL's RLOOConfig"),
        "top_p": (1.0, "TRL's RLOOConfig"),
        "epsilon": (0.2, "TRL's RLOOConfig"),
        "epsilon_high": (None, "--epsilon's, as TRL's"),
        "num_iterations": (1, "TRL's RLOOConfig"),
        "normalize_advantages": (False, "TRL's RLOOConfig"),
    }
    rollout_order = LeaveOneOutOrder
    bench_peer = False  # TRL's RLOOTrainer is no bench peer yet (docs/not-yet.md)

    def objective(self, train):
        from finetune.model import rloo_view  # keras: imported once the backend is chosen

        c = self.constants(train)
        return rloo_view.Objective(c["beta"], c["epsilon"], c["epsilon_high"], c["temperature"],
                                   fresh=c["num_iterations"] == 1)  # fmt: skip

    kl_words = (
        "the KL penalty's reference is the base with LoRA off, and it takes the log-probabilities when "
        "sampled: two more forward passes per rollout, no second model"
    )


RLOO_METHOD = RLOO()
