"""LoRA dropout's masks (lora_dropout.py): one for each layer and training pass, drawn again alike.

That remat's recomputation draws the forward's masks is checked in test_remat.py, and that a resumed run draws
the whole run's in test_checkpoint.py.
"""

import keras
import numpy as np
from conftest import float32_policy, lora_model

from finetune.model import lora_dropout


def test_one_layer_and_pass_draw_one_mask_and_another_layer_or_pass_another():
    x = keras.ops.ones((4, 256), "float32")
    passes = keras.random.SeedGenerator(0)

    def drawn(layer: int):
        return keras.ops.convert_to_numpy(lora_dropout.dropped(x, 0.25, lora_dropout.Seed(layer, passes)))

    first = drawn(7)
    assert set(np.unique(first)) <= {0.0, np.float32(1 / 0.75)}  # dropped, or kept and scaled up
    assert 0.2 < np.mean(first == 0) < 0.3
    np.testing.assert_array_equal(drawn(7), first)
    assert np.mean(drawn(8) != first) > 0.2
    passes.next()
    assert np.mean(drawn(7) != first) > 0.2


def test_each_training_pass_draws_new_masks_from_the_backbone_s_count():
    """The backbone counts its training passes (a checkpoint keeps the count, its saved weights do not); set back,
    the count draws the same masks again. Inference neither drops nor counts."""
    with float32_policy():
        lm, _ = lora_model(dropout=0.5)
        for layer in lm.backbone._flatten_layers(include_self=False):
            if getattr(layer, "lora_enabled", False):  # B off zero: the dropped inputs reach the output
                layer.lora_kernel_b.assign(np.full(tuple(layer.lora_kernel_b.shape), 0.5, "float32"))
        tokens = {"token_ids": np.arange(2, 26, dtype="int32").reshape(2, 12), "padding_mask": np.ones((2, 12), bool)}
        state = lm.backbone.lora_dropout_passes.state
        start = keras.ops.convert_to_numpy(state)

        def logits(training: bool):
            return keras.ops.convert_to_numpy(lm(tokens, training=training))

        first, second = logits(True), logits(True)
        assert counted(lm) == 2 and np.abs(second - first).max() > 1e-3
        np.testing.assert_array_equal(logits(False), logits(False))
        assert counted(lm) == 2
        state.assign(start)
        np.testing.assert_array_equal(logits(True), first)


def counted(lm) -> int:
    """The training passes the backbone of `lm` has counted."""
    return int(keras.ops.convert_to_numpy(lm.backbone.lora_dropout_passes.state)[1])


def test_the_count_is_no_weight_a_backbone_saves(tmp_path):
    """A backbone trained with dropout saves the weights of one without: a checkpoint keeps the count, not them."""
    with float32_policy():
        lm, _ = lora_model(dropout=0.1)
        path = str(tmp_path / "backbone.weights.h5")
        lm.backbone.save_weights(path)
        plain, _ = lora_model()
        plain.backbone.load_weights(path)
