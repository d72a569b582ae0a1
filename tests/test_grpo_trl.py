"""GRPO against the installed TRL's GRPOTrainer, in float32, on the same log-probabilities, rewards and completions.

TRL's own code runs on our numbers: its `_compute_loss` (the per-token loss, each --loss-type's average, the KL
and the clip ratios it logs) on a trainer whose model call returns the given log-probabilities, and the advantage
block of its `_generate_and_score_completions` (sum_then_normalize, each --scale-rewards). Ours are
grpo_view.token_values (each token's loss and metrics), rollouts.token_weights (the loss type's average) and
rollouts.advantages.
"""

import collections
import inspect
import textwrap
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
from trl.trainer import utils as trl_utils  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

from finetune.methods import rollouts  # noqa: E402
from finetune.model import grpo_view  # noqa: E402

pytestmark = pytest.mark.backend_neutral  # keras ops on torch tensors, for the gradient; the math is backend-free


class _Accelerator:
    num_processes = 1
    process_index = 0
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def _trl(loss_type, beta, epsilon, epsilon_high, completion_length):
    """A GRPOTrainer with only what _compute_loss reads: TRL's defaults otherwise (token-level ratios, no entropy
    bonus, no vLLM), one process, no accumulation."""
    trainer = object.__new__(GRPOTrainer)
    settings = dict(loss_type=loss_type, beta=beta, epsilon_low=epsilon, epsilon_high=epsilon_high,
                    max_completion_length=completion_length, top_entropy_quantile=1.0,
                    off_policy_mask_threshold=None, importance_sampling_level="token", use_vllm=False,
                    vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False, aux_loss_enabled=False,
                    current_gradient_accumulation_steps=1, accelerator=_Accelerator(),
                    model=types.SimpleNamespace(training=True),
                    args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
                    _metrics={"train": collections.defaultdict(list)})  # fmt: skip
    for name, value in settings.items():
        object.__setattr__(trainer, name, value)
    return trainer


def _case(seed=0, rows=6, width=9):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, rows)
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.float32)
    logps = -rng.uniform(0.05, 4.0, (rows, width)).astype(np.float32)
    old = logps + rng.normal(0, 0.3, (rows, width)).astype(np.float32)  # ratios on both sides of the clip range
    reference = logps + rng.normal(0, 0.5, (rows, width)).astype(np.float32)
    advantages = rng.normal(0, 1, rows).astype(np.float32)
    advantages[:2] = -1.0, 1.0  # a clip on each side: a ratio below 1 - eps where the advantage is negative,
    old[:2, 0] = logps[0, 0] + 1.0, logps[1, 0] - 1.0  # and one above 1 + eps_high where it is positive
    return logps, old, reference, advantages, mask


def _theirs(case, loss_type, beta, epsilon, epsilon_high, fresh):
    logps, old, reference, advantages, mask = case
    trainer = _trl(loss_type, beta, epsilon, epsilon_high, logps.shape[1])
    now = torch.tensor(logps, requires_grad=True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (now, torch.zeros_like(now), None)
    rows, width = logps.shape
    inputs = {"prompt_ids": torch.zeros((rows, 1), dtype=torch.long), "prompt_mask": torch.ones((rows, 1)),
              "completion_ids": torch.zeros((rows, width), dtype=torch.long), "completion_mask": torch.tensor(mask),
              "advantages": torch.tensor(advantages), "ref_per_token_logps": torch.tensor(reference),
              "num_items_in_batch": torch.tensor(mask.sum())}  # fmt: skip
    if not fresh:
        inputs["old_per_token_logps"] = torch.tensor(old)
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return float(loss), now.grad.numpy(), logged


def _ours(case, loss_type, beta, epsilon, epsilon_high, fresh):
    logps, old, reference, advantages, mask = case
    objective = grpo_view.Objective(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, fresh=fresh)
    now = torch.tensor(logps, requires_grad=True)
    spread = np.broadcast_to(advantages[:, None], logps.shape).copy()
    values = grpo_view.token_values(objective, now, torch.tensor(old), torch.tensor(reference), torch.tensor(spread))
    rows = logps.shape[0]
    weights = rollouts.token_weights(loss_type, mask.sum(1), np.ones(rows, bool), rows, 1, logps.shape[1])
    loss = (values[..., 0] * torch.tensor(mask) * torch.tensor(weights)[:, None]).sum()
    loss.backward()
    columns = values.detach().numpy()

    def mean(name):
        return float((columns[..., grpo_view.COLUMNS.index(name)] * mask).sum() / mask.sum())

    return float(loss), now.grad.numpy(), mean


LOSS_TYPES = ["grpo", "dapo", "dr_grpo", "bnpo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(("beta", "fresh"), [(0.0, True), (0.04, False), (0.0, False)])
def test_the_loss_its_gradient_and_the_logged_kl_and_clip_ratios_are_trl_s(loss_type, beta, fresh):
    case = _case(seed=LOSS_TYPES.index(loss_type))
    theirs, their_grad, logged = _theirs(case, loss_type, beta, 0.2, 0.28, fresh)
    ours, our_grad, mean = _ours(case, loss_type, beta, 0.2, 0.28, fresh)
    assert ours == pytest.approx(theirs, abs=1e-4)
    np.testing.assert_allclose(our_grad, their_grad, rtol=0, atol=1e-5)
    assert np.abs(their_grad).sum() > 0  # the case trains something
    for ours_name, trl_name in [("clip_ratio_low", "clip_ratio/low_mean"), ("clip_ratio_high", "clip_ratio/high_mean"),
                                ("clip_ratio_region", "clip_ratio/region_mean")]:  # fmt: skip
        assert mean(ours_name) == pytest.approx(logged[trl_name], abs=1e-5)
    if beta:
        assert mean("kl") == pytest.approx(logged["kl"], abs=1e-5)
    if not fresh:  # the case clips on both sides, so the ratios are checked where they count
        assert logged["clip_ratio/low_mean"] > 0 and logged["clip_ratio/high_mean"] > 0


def _trl_advantages(table, weights, generations, scale):
    """The sum_then_normalize block of TRL's installed _generate_and_score_completions, run on `table`."""
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.index('if self.multi_objective_aggregation == "sum_then_normalize":')
    end = source.index('elif self.multi_objective_aggregation == "normalize_then_sum":')
    block = textwrap.dedent(source[source.rindex("\n", 0, start) + 1 : end])
    rewards_per_func = torch.tensor(table, dtype=torch.float32)
    scope = {"self": types.SimpleNamespace(multi_objective_aggregation="sum_then_normalize", scale_rewards=scale,
                                           reward_weights=torch.tensor(weights, dtype=torch.float32)),
             "torch": torch, "nanstd": trl_utils.nanstd, "device": "cpu", "rewards_per_func": rewards_per_func,
             "unscorable_mask": torch.isnan(rewards_per_func).all(dim=1), "num_generations": generations}  # fmt: skip
    exec(compile(block, "trl_advantages", "exec"), scope)
    return scope["advantages"].numpy()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_advantages_are_trl_s_for_every_scale_rewards(scale):
    rng = np.random.default_rng(1)
    table = rng.normal(0, 1, (12, 2)).astype(np.float32)  # 3 prompts x 4 completions, 2 reward functions
    table[1, 0] = np.nan  # one function gave None for one completion
    table[4:8] = 0.5  # a group whose rewards are all equal: advantage 0
    weights = np.array([1.0, 0.5], np.float32)
    theirs = _trl_advantages(table, weights, 4, scale)
    ours, _ = rollouts.advantages(table, weights, 4, scale)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
    assert np.all(ours[4:8] == 0) and np.abs(ours).max() > 0.5


@pytest.mark.parametrize("soft_cap", [None, 30.0])
def test_the_entropy_is_trls_from_the_logits_the_loss_makes(soft_cap):
    """Each completion token's entropy (GRPO's `entropy` metric) equals TRL's entropy_from_logits on the logits at
    the sampling temperature, in both forms of the loss's chunk (PyTorch's in place, XLA's), and asking for it
    changes neither the loss nor its gradient."""
    from keras import ops

    from finetune.model import objective

    rng = np.random.default_rng(3)
    hidden = torch.tensor(rng.normal(size=(10, 16)), dtype=torch.float32, requires_grad=True)
    kernel = torch.tensor(rng.normal(size=(50, 16)) / 2, dtype=torch.float32) / 0.7  # at temperature 0.7
    labels, weights = torch.tensor(rng.integers(0, 50, size=10)), torch.ones(10)
    logits = hidden.detach() @ kernel.T
    if soft_cap is not None:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    theirs = trl_utils.entropy_from_logits(logits).numpy()
    both = objective.token_losses_and_entropies(objective.Targets(hidden, labels, weights, kernel, soft_cap), 4)
    np.testing.assert_allclose(both[:, 1].detach().numpy(), theirs, rtol=1e-5, atol=1e-5)
    _, _, compiled_form = objective._loss_and_delta(logits, labels, eager=False, entropy=True)
    np.testing.assert_allclose(np.asarray(ops.convert_to_numpy(compiled_form)), theirs, rtol=1e-5, atol=1e-5)
    (with_entropy,) = torch.autograd.grad(both[:, 0].sum() + 5.0 * both[:, 1].sum(), hidden)
    alone = objective.token_losses(objective.Targets(hidden, labels, weights, kernel, soft_cap), 4)
    (plain,) = torch.autograd.grad(alone.sum(), hidden)
    np.testing.assert_allclose(both[:, 0].detach().numpy(), alone.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(with_entropy.numpy(), plain.numpy(), rtol=1e-6, atol=1e-7)
