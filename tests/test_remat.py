"""--remat (remat.py): recomputing each block's activations changes no loss.

What remat saves in memory is planned in test_plan.py.
"""

import numpy as np
from conftest import float32_policy, lora_model
from conftest import lora_train_losses as train_losses


def test_remat_changes_no_loss():
    with float32_policy():
        plain = train_losses(lora_model()[0], steps=3)
        recomputed = train_losses(lora_model(remat=True)[0], steps=3)
    np.testing.assert_allclose(recomputed, plain, rtol=1e-5)
