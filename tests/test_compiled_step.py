"""The bench's `compile` lever on PyTorch (lean_torch.compile_blocks: each decoder block's pass compiled with
torch.compile) trains what the eager step trains: the same losses in float32 on a CPU, one graph a block. JAX's
step is always compiled (XLA); TensorFlow's lever is Keras' jit_compile."""

import json

import keras
import numpy as np
import pytest
from conftest import BACKEND, float32_policy, packed_rows, train, train_losses
from test_lean_torch import _source  # tiny-gemma2: soft caps, post norms, a sliding window

from finetune.data import batching
from finetune.model import builder

torch_only = pytest.mark.skipif(keras.config.backend() != "torch", reason="torch.compile: the PyTorch backend's")


def block_losses(preset: str, compiled: bool, steps: int = 3) -> tuple[list[float], int]:
    """The losses of `steps` steps of `preset`'s tiny model (LoRA on query and value) on PyTorch's lean path, with
    each decoder block's pass compiled (lean_torch.compile_blocks, the bench's `compile` lever) or eager; and how
    many blocks took the compiled pass."""
    from finetune.config import LoraConfig
    from finetune.model import lean_torch
    from finetune.platform import backend, keras_compat

    keras_compat.lean_torch_ops()  # what apply_runtime_tweaks installs; lean_torch.enable reads it
    backend.set_seed(0)
    lm, preprocessor = builder.build(_source(preset), 48, "float32")
    builder.enable_lora(lm, LoraConfig(rank=2, targets=["query", "value"]), seed=0)
    took = lean_torch.compile_blocks(lm.backbone) if compiled else 0
    trainer = builder.compile(lm, 1e-2, 0.0)
    feed = batching.Feed(inputs=builder.input_names(lm))  # Gemma 4's position ids
    order = batching.TrainOrder(packed_rows(preprocessor.tokenizer), 4, seed=0, feed=feed)
    found = []
    for step in range(steps):
        x, y, w = order.batch(step)
        found.append(float(trainer.train_on_batch(x, y, sample_weight=w)))
    return found, took


@torch_only
@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma2", "tiny-gemma3", "tiny-gemma4"])
def test_compiled_blocks_train_what_the_eager_ones_do_in_one_graph_each(preset):
    """The bench's `compile` lever on PyTorch: every decoder block's pass compiled (regional compilation: the lean
    Gemma 1-3 blocks after their mask, keras-hub's own Gemma 4 blocks) trains what the eager blocks do, in float32 on a CPU, and each is one graph:
    a graph break would put keras' per-op host work back between its pieces."""
    import torch
    from torch._dynamo.utils import counters

    from finetune.model import families

    with float32_policy():
        eager, _ = block_losses(preset, False)
        counters.clear()
        compiled, took = block_losses(preset, True)
    assert took == len(families.decoder_blocks(builder.build(_source(preset), 48, "float32")[0].backbone))
    assert min(eager[1:]) < eager[0]  # it learns, so equal losses say the updates were equal too
    np.testing.assert_allclose(compiled, eager, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] >= took  # it compiled: a graph per block at least (grad modes)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


COMPILED = {
    "torch": ("True", "torch.compile of 2 of 2 decoder blocks"),
    "tensorflow": ("True", "XLA (jit_compile)"),
    "jax": ("False", "JAX compiles every step already (XLA)"),
}


def test_a_run_with_compile_trains_what_the_eager_run_does_and_says_what_it_compiled(tmp_path):
    """`finetune gemma --compile`: the table's row says what was compiled on this backend, and the losses are the
    eager run's in float32; with LoRA dropout PyTorch's blocks stay eager, and the row says why."""
    flags = ["--precision", "float32", "--max-steps", "4"]
    eager = train(tmp_path / "eager", *flags)
    compiled = train(tmp_path / "compiled", *flags, "--compile")
    row = next(line for line in compiled.output.splitlines() if line.startswith("compile "))
    value, why = COMPILED[BACKEND]
    assert row.split()[1] == value and row.endswith(why), row
    assert not any(line.startswith("compile ") for line in eager.output.splitlines())
    losses = [[float(loss) for loss in train_losses(tmp_path / name)] for name in ("compiled", "eager")]
    np.testing.assert_allclose(*losses, rtol=1e-5)
    if BACKEND == "torch":
        dropped = train(tmp_path / "dropout", *flags, "--compile", "--lora-dropout", "0.1")
        row = next(line for line in dropped.output.splitlines() if line.startswith("compile "))
        assert row.split()[1] == "False" and "LoRA dropout draws its masks on the host" in row, row
        # Unpacked rows are cut to eighths of --seq-len, each length compiled once: the same losses as eager's.
        unpacked = [*flags, "--packing", "off", "--seq-len", "256"]
        rows = [
            train(tmp_path / name, *unpacked, *extra)
            for name, extra in (("u-eager", ()), ("u-compiled", ("--compile",)))
        ]
        row = next(line for line in rows[1].output.splitlines() if line.startswith("compile "))
        assert "unpacked rows are cut to eighths of --seq-len" in row, row
        losses = [[float(loss) for loss in train_losses(tmp_path / name)] for name in ("u-compiled", "u-eager")]
        np.testing.assert_allclose(*losses, rtol=1e-5)
        shares = [json.loads((tmp_path / name / "metrics.json").read_text())["padding_computed"]
                  for name in ("u-compiled", "u-eager")]  # fmt: skip
        assert shares[0] > shares[1], shares  # longer rows: the positions of fewer lengths
