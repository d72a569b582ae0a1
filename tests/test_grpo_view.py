"""GRPO's per-token loss and metrics (model/grpo_view.token_values) against TRL's _compute_loss formulas."""

import numpy as np
import pytest
from keras import ops

from finetune.model import grpo_view

pytestmark = pytest.mark.backend_neutral


@pytest.mark.parametrize("beta, fresh", [(0.0, True), (0.04, False)])
def test_token_values_are_trls(beta, fresh):
    rng = np.random.default_rng(1)
    logps, old, ref = (rng.normal(-2, 0.3, (3, 5)).astype(np.float32) for _ in range(3))
    adv = np.repeat(rng.normal(size=(3, 1)), 5, axis=1).astype(np.float32)
    objective = grpo_view.Objective(beta=beta, epsilon=0.2, epsilon_high=0.28, fresh=fresh)
    got = np.asarray(ops.convert_to_numpy(grpo_view.token_values(objective, *map(ops.convert_to_tensor, (logps, old, ref, adv)))))  # fmt: skip
    old = logps if fresh else old
    ratio = np.exp(logps - old)
    loss = -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.28) * adv)
    kl = np.exp(ref - logps) - (ref - logps) - 1 if beta else np.zeros_like(logps)
    np.testing.assert_allclose(got[..., 0], loss + beta * kl, atol=1e-5)
    np.testing.assert_allclose(got[..., 1], kl, atol=1e-5)
    low, high = (ratio < 0.8) & (adv < 0), (ratio > 1.28) & (adv > 0)
    np.testing.assert_array_equal(got[..., 2:5], np.stack([low, high, low | high], -1).astype(np.float32))
