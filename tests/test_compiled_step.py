"""A compiled train step (Keras' jit_compile: torch.compile on PyTorch, the bench's `compile` lever) trains what
the eager step trains: the same losses in float32 on a CPU. JAX's step is always compiled (XLA)."""

import keras
import numpy as np
import pytest
from conftest import float32_policy, lora_model, packed_rows

from finetune.data import batching
from finetune.model import builder, presets

pytestmark = pytest.mark.skipif(keras.config.backend() != "torch", reason="torch.compile: the PyTorch backend's")


def losses(compiled: bool, steps: int = 2) -> list[float]:
    lm, _ = lora_model()
    trainer = builder.compile(lm, 1e-2, 0.0)
    trainer.jit_compile = compiled  # what the train function is made with, at the first step
    order = batching.TrainOrder(packed_rows(presets.tiny_tokenizer()), 4, seed=0)
    found = []
    for step in range(steps):
        x, y, w = order.batch(step)
        found.append(float(trainer.train_on_batch(x, y, sample_weight=w)))
    assert (trainer.train_function is not None) and (hasattr(trainer.train_function, "_torchdynamo_orig_callable")
                                                     or not compiled)  # fmt: skip
    return found


def test_the_compiled_step_trains_what_the_eager_one_does():
    with float32_policy():
        eager = losses(False)
        compiled = losses(True)
    assert eager[-1] < eager[0]  # it learns, so equal losses say the updates were equal too
    np.testing.assert_allclose(compiled, eager, rtol=1e-5)
