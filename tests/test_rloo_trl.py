"""RLOO against the installed TRL's RLOOTrainer, in float32, on the same log-probabilities, rewards and completions.

TRL's own code runs on our numbers: its `_compute_loss` (the per-sequence clipped loss, and the clip ratios and
entropy it logs) on a trainer whose model call returns the given log-probabilities, and the reward and advantage
block of its `_generate_and_score_completions` (the KL penalty on the reward, the leave-one-out baseline over the
scorable completions, normalize_advantages, and the kl, reward and frac_reward_zero_std it logs). Ours are
rloo_view.sequence_values on the gathered slots (batching.targets' layout, two data shards, so that the slots do
not line up with the rows), with rollouts.token_weights' "grpo" average as RLOO's order gives it, and
rloo.LeaveOneOutOrder.advantages summing the same slots by completion.
"""

import collections
import inspect
import textwrap
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
from test_grpo_trl import _Accelerator  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402
from trl.trainer.rloo_trainer import RLOOTrainer  # noqa: E402

from finetune.data import batching  # noqa: E402
from finetune.methods import rloo, rollouts  # noqa: E402
from finetune.model import rloo_view  # noqa: E402

pytestmark = pytest.mark.backend_neutral  # keras ops on torch tensors, for the gradient; the math is backend-free

PROMPT = 3  # each row's prompt positions before its completion
SHARDS = 2


def _case(seed=0, rows=8, width=7):
    """Per-token log-probabilities now, when sampled and under the base, an advantage a row, the completion mask,
    and each token's entropy."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, rows)
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.float32)
    logps = -rng.uniform(0.05, 2.0, (rows, width)).astype(np.float32)
    old = (logps + rng.normal(0, 0.15, (rows, width))).astype(np.float32)  # sequence ratios on both sides of the clip
    reference = (logps + rng.normal(0, 0.3, (rows, width))).astype(np.float32)
    advantages = rng.normal(0, 1, rows).astype(np.float32)
    advantages[:2] = -1.0, 1.0  # a clip on each side: a ratio below 1 - eps where the advantage is negative,
    old[:2] = logps[:2]  # and one above 1 + eps_high where it is positive
    old[0, 0], old[1, 0] = logps[0, 0] + 1.0, logps[1, 0] - 1.0
    entropy = rng.uniform(0, 3, (rows, width)).astype(np.float32)
    return logps, old, reference, advantages, mask, entropy


def _slots(mask):
    """The gathered layout of rows with these completions (batching.targets, SHARDS data shards): each slot's
    row and completion token (-1 at the padding slots), and its loss_positions, at seq_len PROMPT + width."""
    rows, width = mask.shape
    weights = np.zeros((rows, PROMPT + width), np.float32)
    weights[:, PROMPT:] = mask
    arrays = {"weights": weights, "labels": np.zeros_like(weights, dtype=np.int32)}
    gathered = batching.targets(arrays, np.arange(rows), SHARDS, width)
    positions, real = gathered["loss_positions"], gathered["loss_weights"] > 0
    per_shard = rows // SHARDS
    row = (np.arange(rows)[:, None] // per_shard) * per_shard + positions // (PROMPT + width)
    token = positions % (PROMPT + width) - PROMPT
    return np.where(real, row, -1), np.where(real, token, -1), positions, real


def _at_slots(values, row, token):
    """Per-token values (rows, width), a torch tensor or numpy, at the slots (0 at the padding ones)."""
    values = torch.as_tensor(values)
    return torch.where(torch.tensor(row >= 0), values[np.maximum(row, 0), np.maximum(token, 0)], 0.0)


def _theirs(case, epsilon, epsilon_high):
    logps, old, _, advantages, mask, entropy = case
    trainer = object.__new__(RLOOTrainer)
    settings = dict(epsilon_low=epsilon, epsilon_high=epsilon_high, aux_loss_enabled=False,
                    accelerator=_Accelerator(), model=types.SimpleNamespace(training=True),
                    _metrics={"train": collections.defaultdict(list)})  # fmt: skip
    for name, value in settings.items():
        object.__setattr__(trainer, name, value)
    now = torch.tensor(logps, requires_grad=True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (now, torch.tensor(entropy), None)
    rows, width = logps.shape
    inputs = {"prompt_ids": torch.zeros((rows, 1), dtype=torch.long), "prompt_mask": torch.ones((rows, 1)),
              "completion_ids": torch.zeros((rows, width), dtype=torch.long), "completion_mask": torch.tensor(mask),
              "old_logps": (torch.tensor(old) * torch.tensor(mask)).sum(1), "advantages": torch.tensor(advantages)}  # fmt: skip
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return float(loss), now.grad.numpy(), logged


def _ours(case, epsilon, epsilon_high, fresh):
    logps, old, _, advantages, mask, entropy = case
    objective = rloo_view.Objective(epsilon=epsilon, epsilon_high=epsilon_high, fresh=fresh)
    row, token, positions, real = _slots(mask)
    now = torch.tensor(logps, requires_grad=True)
    rows_of_slots = rloo_view.slot_rows(torch.tensor(positions), PROMPT + logps.shape[1], SHARDS)
    np.testing.assert_array_equal(np.where(real, rows_of_slots.numpy(), -1), row)  # the view finds each slot's row
    spread = np.where(real, advantages[np.maximum(row, 0)], 0.0).astype(np.float32)
    values = rloo_view.sequence_values(objective, _at_slots(now, row, token), _at_slots(old, row, token),
                                       torch.tensor(spread), (rows_of_slots, torch.tensor(real)),
                                       entropy=_at_slots(entropy, row, token))  # fmt: skip
    rows = logps.shape[0]
    weights = rollouts.token_weights("grpo", mask.sum(1), np.ones(rows, bool), rows, 1, logps.shape[1])
    slot_weights = torch.tensor(np.where(real, weights[np.maximum(row, 0)], 0.0).astype(np.float32))
    loss = (values[..., 0] * slot_weights).sum()
    loss.backward()
    columns = values.detach().numpy()

    def mean(name):  # objective.ColumnMean: the clip ratios by the slots' weights, the entropy by the slots
        weight = slot_weights.numpy() if name in rloo_view.SEQUENCE_METRICS else real.astype(np.float32)
        return float((columns[..., rloo_view.COLUMNS.index(name)] * weight).sum() / weight.sum())

    return float(loss), now.grad.numpy(), mean


@pytest.mark.parametrize("epsilon_high", [0.2, 0.28])
def test_the_loss_its_gradient_and_the_logged_clip_ratios_and_entropy_are_trl_s(epsilon_high):
    case = _case(seed=int(epsilon_high * 100))
    theirs, their_grad, logged = _theirs(case, 0.2, epsilon_high)
    ours, our_grad, mean = _ours(case, 0.2, epsilon_high, fresh=False)
    assert ours == pytest.approx(theirs, abs=1e-6)
    np.testing.assert_allclose(our_grad, their_grad, rtol=0, atol=1e-6)
    assert np.abs(their_grad).sum() > 0  # the case trains something
    for ours_name, trl_name in [("clip_ratio_low", "clip_ratio/low_mean"), ("clip_ratio_high", "clip_ratio/high_mean"),
                                ("clip_ratio_region", "clip_ratio/region_mean"), ("entropy", "entropy")]:  # fmt: skip
        assert mean(ours_name) == pytest.approx(logged[trl_name], abs=1e-6), ours_name
    assert logged["clip_ratio/low_mean"] > 0 and logged["clip_ratio/high_mean"] > 0  # both sides are checked


def test_one_step_on_fresh_rollouts_is_trl_s_with_its_old_log_probabilities_the_current_ones():
    """--num-iterations 1: the old log-probabilities are the current ones, detached (no scoring pass), as TRL's
    no-grad pass computes them: a ratio of 1, nothing clipped."""
    logps, old, reference, advantages, mask, entropy = _case(seed=5)
    case = (logps, logps.copy(), reference, advantages, mask, entropy)
    theirs, their_grad, logged = _theirs(case, 0.2, 0.2)
    ours, our_grad, mean = _ours(case, 0.2, 0.2, fresh=True)
    assert ours == pytest.approx(theirs, abs=1e-6)
    np.testing.assert_allclose(our_grad, their_grad, rtol=0, atol=1e-6)
    assert mean("clip_ratio_region") == logged["clip_ratio/region_mean"] == 0.0


def _trl_advantages(table, weights, generations, beta, normalize, old, reference, mask):
    """The reward and advantage block of TRL's installed _generate_and_score_completions, run on our numbers, up
    to its reward metrics; the advantages and what it logged."""
    source = inspect.getsource(RLOOTrainer._generate_and_score_completions)
    start = source.index("unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)")
    end = source.index("# Log prompts and completions")
    block = textwrap.dedent(source[source.rindex("\n", 0, start) + 1 : source.rindex("\n", 0, end)])
    rewards_per_func = torch.tensor(table, dtype=torch.float32)
    names = [f"f{i}" for i in range(table.shape[1])]
    this = types.SimpleNamespace(reward_weights=torch.tensor(weights, dtype=torch.float32), reward_clip_range=None,
                                 beta=beta, normalize_advantages=normalize, accelerator=_Accelerator(),
                                 reward_func_names=names, _metrics={"train": collections.defaultdict(list)})  # fmt: skip
    scope = {"self": this, "torch": torch, "nanstd": trl_utils.nanstd, "gather": lambda x: x, "device": "cpu",
             "rewards_per_func": rewards_per_func, "num_generations": generations, "mode": "train",
             "prompts": [None] * len(table), "old_per_token_logps": torch.tensor(old),
             "ref_per_token_logps": torch.tensor(reference), "completion_mask": torch.tensor(mask)}  # fmt: skip
    exec(compile(block, "trl_advantages", "exec"), scope)
    return scope["advantages"].numpy(), {name: values[-1] for name, values in this._metrics["train"].items()}


def _our_advantages(table, weights, generations, beta, normalize, old, reference, mask):
    """rloo.LeaveOneOutOrder.advantages, its KL summed from the gathered slots as a step's are (rollouts.SlotSums)."""
    row, token, _, _ = _slots(mask)
    x = {"loss_old": _at_slots(old, row, token).numpy(), "loss_reference": _at_slots(reference, row, token).numpy()}
    order = object.__new__(rloo.LeaveOneOutOrder)
    rewards = tuple(types.SimpleNamespace(weight=float(w)) for w in weights)
    order.prompts = types.SimpleNamespace(sampling=types.SimpleNamespace(rewards=rewards, generations=generations))
    order.constants = {"beta": beta, "normalize_advantages": normalize}
    return order.advantages(table, rollouts.SlotSums([x], [row], len(table)), mask.sum(1).astype(int))


@pytest.mark.parametrize("beta", [0.0, 0.05, 0.5])
@pytest.mark.parametrize("normalize", [False, True])
def test_the_advantages_kl_penalty_and_reward_metrics_are_trl_s(beta, normalize):
    rng = np.random.default_rng(1)
    g = 4
    table = rng.normal(0, 1, (16, 2)).astype(np.float32)  # 4 prompts x 4 completions, 2 reward functions
    table[1, 0] = np.nan  # one function gave None for one completion
    table[4:8] = 0.5  # a group whose rewards are all equal: advantage 0 where no KL tells them apart
    table[9] = np.nan  # an unscorable completion: left out of its siblings' baselines, advantage 0
    table[12:15] = np.nan  # a group with one scorable completion: no baseline, advantage 0
    weights = np.array([1.0, 0.5], np.float32)
    _, old, reference, _, mask, _ = _case(seed=2, rows=16)
    theirs, logged = _trl_advantages(table, weights, g, beta, normalize, old, reference, mask)
    ours, stats = _our_advantages(table, weights, g, beta, normalize, old, reference, mask)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    assert ours[9] == 0 and np.all(ours[12:16] == 0) and np.abs(ours).max() > 0.5
    if not beta:
        assert np.all(ours[4:8] == 0)
    for name in ("reward", "reward_std", "frac_reward_zero_std", *(["kl"] if beta else [])):
        assert stats[name] == pytest.approx(logged[name], abs=1e-6), name
