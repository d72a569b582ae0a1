"""--remat (remat.py): recomputing each block's activations changes no loss, LoRA dropout's included.

What remat saves in memory is planned in test_plan.py.
"""

import keras
import numpy as np
from conftest import adapter_arrays, float32_policy, lora_model, packed_rows, train, train_losses
from conftest import lora_train_losses as lora_losses

from finetune.data import batching
from finetune.model import builder, objective, presets


def test_remat_changes_no_loss():
    with float32_policy():
        plain = lora_losses(lora_model()[0], steps=3)
        recomputed = lora_losses(lora_model(remat=True)[0], steps=3)
    np.testing.assert_allclose(recomputed, plain, rtol=1e-5)


def gradients(remat: bool, steps: int = 2) -> list[dict]:
    """Each step's gradient of every LoRA factor, by path, LoRA dropout 0.5 on: a step of SGD at learning rate 1
    moves each factor by its gradient. B starts off zero, so A's gradient passes through the dropped inputs."""
    with float32_policy():
        lm, _ = lora_model(remat=remat, dropout=0.5)
        rng = np.random.default_rng(0)
        for layer in lm.backbone._flatten_layers(include_self=False):
            if getattr(layer, "lora_enabled", False):
                layer.lora_kernel_b.assign(rng.normal(0, 0.5, tuple(layer.lora_kernel_b.shape)).astype("float32"))
        view = objective.TrainingView(lm, builder.chunk_for(lm))
        view.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0), loss=objective.TokenShare())
        order = batching.TrainOrder(packed_rows(presets.tiny_tokenizer()), 4, seed=0)
        found = []
        for step in range(steps):
            before = {v.path: keras.ops.convert_to_numpy(v) for v in lm.trainable_variables}
            x, y, w = order.batch(step)
            view.train_on_batch(x, y, sample_weight=w)
            found.append({v.path: before[v.path] - keras.ops.convert_to_numpy(v) for v in lm.trainable_variables})
    return found


def test_remat_recomputes_lora_dropout_with_the_forward_s_masks():
    """The backward's recomputation of a block drops the inputs its forward dropped: the gradients equal those
    without remat. Before, PyTorch's and TensorFlow's recomputation drew new masks (PyTorch's checkpoint refused
    the seed's update outright)."""
    plain, recomputed = gradients(remat=False), gradients(remat=True)
    for step, (expected, got) in enumerate(zip(plain, recomputed)):
        assert got.keys() == expected.keys()
        for path, wanted in expected.items():
            # float32 sums in another order, grown by step 1's update (up to 1.4e-5 on TensorFlow); a mask drawn
            # anew moved every value, by about the value itself
            np.testing.assert_allclose(got[path], wanted, rtol=1e-5, atol=1e-4, err_msg=f"step {step + 1}: {path}")
    assert all(np.abs(value).max() > 1e-4 for step in plain for value in step.values())  # every factor learns


def test_a_run_with_lora_dropout_trains_the_same_with_remat(tmp_path):
    """--remat on and off, LoRA dropout on: the same losses and adapter."""
    flags = ["--precision", "float32", "--lora-dropout", "0.1", "--seed", "3", "--max-steps", "4"]
    plain, recomputed = tmp_path / "off", tmp_path / "on"
    train(plain, *flags, "--remat", "off")
    train(recomputed, *flags, "--remat", "on")
    losses = [float(loss) for loss in train_losses(plain)]
    assert len(losses) == 4
    np.testing.assert_allclose([float(loss) for loss in train_losses(recomputed)], losses, rtol=1e-5, atol=1e-5)
    expected, got = adapter_arrays(plain / "adapter.lora.h5"), adapter_arrays(recomputed / "adapter.lora.h5")
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_remat_lowers_the_compiled_step_s_memory_on_every_backend_s_compiler():
    """On JAX the step is compiled whole, and XLA's CPU compiler merged jax.checkpoint's recomputation back into
    the forward (its optimization barrier expanded away): the same temporaries with remat as without. Measured
    here as XLA plans them, for the tiny model's backbone with LoRA at batch 8 of 64 positions."""
    if keras.config.backend() != "jax":
        return  # eager PyTorch and TensorFlow free each block's activations as its recomputation is made
    import jax

    def temporaries(remat: bool) -> int:
        with float32_policy():
            lm, _ = lora_model(remat=remat)
        backbone = lm.backbone
        trainable = [v.value for v in backbone.trainable_variables]
        frozen = [v.value for v in backbone.non_trainable_variables]
        x = {"token_ids": np.ones((8, 64), "int32"), "padding_mask": np.ones((8, 64), "int32")}

        def loss(trainable, frozen):
            out, _ = backbone.stateless_call(trainable, frozen, x, training=True)
            return jax.numpy.sum(out**2)

        step = jax.jit(jax.grad(loss)).lower(trainable, frozen).compile()
        return step.memory_analysis().temp_size_in_bytes

    kept, recomputed = temporaries(False), temporaries(True)
    assert recomputed < 0.7 * kept, (recomputed, kept)
