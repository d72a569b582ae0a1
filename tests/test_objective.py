"""The response-token loss at gathered positions (objective.py), the 16-bit base, and the rows a batch gathers from.

Each compares what training does now against a reference computed another way:
the full vocabulary projection with Keras' own weighted cross-entropy, a float32
base, each data shard alone, the whole row. The quantized base is checked so in
test_quantized.py, and remat in test_remat.py.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
from conftest import float32_policy, lora_model, packed_rows
from conftest import lora_train_losses as train_losses

from finetune.data import batching
from finetune.model import builder, objective, presets


def lora_values(lm):
    return [keras.ops.convert_to_numpy(v) for v in lm.trainable_variables]


def test_the_gathered_loss_and_its_gradient_are_the_full_projection_s():
    """Chunks of 8 positions (some all padding, so skipped) against every position's logits."""
    with float32_policy():
        ours, _ = lora_model()
        reference, preprocessor = lora_model()  # a seed set on TensorFlow ends the tokenizers made before it
        rows = packed_rows(preprocessor.tokenizer)
        view = objective.TrainingView(ours, chunk=8)
        view.compile(optimizer=keras.optimizers.SGD(0.5), loss=objective.WeightedMean())
        reference.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
            weighted_metrics=[],
        )
        order = batching.TrainOrder(rows, 4, seed=0)
        assert order.width * 4 > int((rows["weights"][:4] > 0).sum())  # the layout has weight-0 slots to skip
        for step in range(3):
            x, y, w = order.batch(step)
            rows_now = order.rows(step)
            full_x = {"token_ids": rows["token_ids"][rows_now], "padding_mask": rows["segment_ids"][rows_now]}
            got = float(view.train_on_batch(x, y, sample_weight=w))
            expected = reference.train_on_batch(
                full_x, rows["labels"][rows_now], rows["weights"][rows_now], return_dict=True
            )
            expected = float(expected["loss"])
            assert got == pytest.approx(expected, rel=1e-5)
        # SGD moves each factor by its gradient: equal factors after 3 steps mean equal gradients.
        for a, b in zip(lora_values(ours), lora_values(reference)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


class Hidden(keras.layers.Layer):
    """Hidden states as a weight, so SGD with rate 1 exposes the loss's gradient in any backend."""

    def __init__(self, values, kernel, labels, weights, soft_cap):
        super().__init__()
        self.values = self.add_weight(shape=values.shape, initializer=keras.initializers.Constant(values))
        self.kernel, self.labels, self.w, self.soft_cap = kernel, labels, weights, soft_cap

    def compute_output_spec(self, x):
        return keras.KerasTensor((1, self.values.shape[0]), dtype="float32")

    def call(self, x):
        hidden = keras.ops.convert_to_tensor(self.values) * 1.0  # a tensor, as the backbone hands the op
        kernel = keras.ops.cast(keras.ops.convert_to_tensor(self.kernel), hidden.dtype)
        labels, weights = (keras.ops.convert_to_tensor(a) for a in (self.labels, self.w))
        losses = objective.token_losses(objective.Targets(hidden, labels, weights, kernel, self.soft_cap), 4)
        return keras.ops.expand_dims(losses, 0) + 0.0 * keras.ops.cast(keras.ops.sum(x), losses.dtype)


@pytest.mark.parametrize("soft_cap", [None, 3.0])
def test_loss_and_gradient_against_numpy_with_and_without_a_soft_cap(soft_cap):
    rng = np.random.default_rng(0)
    hidden, kernel = rng.standard_normal((12, 6)).astype("float32"), rng.standard_normal((20, 6)).astype("float32")
    labels = rng.integers(0, 20, 12).astype("int32")
    weights = np.array([1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0], "float32")  # positions 4-7: a chunk that is skipped
    logits = hidden @ kernel.T
    if soft_cap:
        logits = np.tanh(logits / soft_cap) * soft_cap
    log_total = np.log(np.exp(logits).sum(-1))
    expected = log_total - logits[np.arange(12), labels]
    dlogits = np.exp(logits - log_total[:, None])
    dlogits[np.arange(12), labels] -= 1
    if soft_cap:
        dlogits *= 1 - (logits / soft_cap) ** 2
    expected_grad = (weights / weights.sum())[:, None] * (dlogits @ kernel)

    with float32_policy():
        layer = Hidden(hidden, kernel, labels, weights, soft_cap)
        inputs = keras.Input((1,))
        net = keras.Model(inputs, layer(inputs))
        net.compile(optimizer=keras.optimizers.SGD(1.0), loss=objective.WeightedMean())
        losses = keras.ops.convert_to_numpy(net(np.zeros((1, 1), "float32")))[0]
        net.train_on_batch(np.zeros((1, 1), "float32"), np.zeros((1, 12)), sample_weight=weights[None])
        grad = hidden - keras.ops.convert_to_numpy(layer.values)
    np.testing.assert_allclose(losses[weights > 0], expected[weights > 0], rtol=1e-5)
    assert not losses[4:8].any()  # the skipped chunk's positions
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_16_bit_base_trains_like_float32_with_float32_factors(precision):
    """Stated tolerance: each of 6 losses within 2% of the float32 base's (bf16 keeps 8 bits of mantissa, float16
    11; float16 trains under Keras' loss scaling)."""
    before = keras.config.dtype_policy()
    try:
        lm, _ = lora_model(precision)
        assert {v.dtype for v in lm.backbone.weights if not v.trainable} == {precision}
        assert {v.dtype for v in lm.trainable_variables} == {"float32"}  # LoRA factors, and so AdamW's moments
        narrow = train_losses(lm)
        lm, _ = lora_model("float32")
        f32 = train_losses(lm)
    finally:
        keras.config.set_dtype_policy(before)
    np.testing.assert_allclose(narrow, f32, rtol=2e-2)
    assert narrow[-1] < narrow[0]


def test_a_confident_softmax_keeps_its_gradient_in_bfloat16():
    """p(label) near 0.998: softmax - one-hot is formed in float32 before the bf16 matmul (bf16 alone cancels it)."""
    rng = np.random.default_rng(1)
    kernel = rng.standard_normal((64, 32)).astype("float32")
    labels = rng.integers(0, 64, 16).astype("int32")
    hidden = kernel[labels] / 32  # each row points at its label's embedding: its logit stands out, the rest stay small

    def softmax(scale):
        logits = scale * hidden @ kernel.T
        p = np.exp(logits - logits.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True)

    scale = 1.0
    while softmax(scale)[np.arange(16), labels].mean() < 0.998:  # sharpen until the labels hold p about 0.998
        scale *= 1.1
    hidden *= scale
    # The op sees both in bf16: the reference starts from the same rounded values, in float64.
    hidden = hidden.astype(ml_dtypes.bfloat16).astype("float32")
    kernel = kernel.astype(ml_dtypes.bfloat16).astype("float32")
    probabilities = softmax(1.0).astype("float64")
    assert 0.99 <= probabilities[np.arange(16), labels].mean() < 0.9999
    probabilities[np.arange(16), labels] -= 1
    weights = np.ones(16, "float32")
    expected = (weights / weights.sum())[:, None] * (probabilities @ kernel)

    before = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy("mixed_bfloat16")  # the hidden states and the kernel reach the op in bf16
        layer = Hidden(hidden, kernel.astype("float32"), labels, weights, None)
        inputs = keras.Input((1,))
        net = keras.Model(inputs, layer(inputs))
        net.compile(optimizer=keras.optimizers.SGD(1.0), loss=objective.WeightedMean())
        net.train_on_batch(np.zeros((1, 1), "float32"), np.zeros((1, 16)), sample_weight=weights[None])
        grad = hidden - keras.ops.convert_to_numpy(layer.values)
    finally:
        keras.config.set_dtype_policy(before)
    error = np.linalg.norm(grad - expected) / np.linalg.norm(expected)
    # Subtracting the one-hot after the bf16 cast cancels the gradient here (an error near 100%); what is left
    # is the bf16 rounding of the logits themselves (logits near 12 round by about 0.02).
    assert error < 0.1, error


def test_targets_of_two_data_shards_gather_from_their_own_rows():
    """With shards=2 each half of the batch indexes its own rows: the same targets as each half alone."""
    tokenizer = presets.tiny_tokenizer()
    rows = packed_rows(tokenizer)
    chosen = np.arange(4)
    both = batching.targets(rows, chosen, shards=2, width=48)
    for shard, half in enumerate((chosen[:2], chosen[2:])):
        alone = batching.targets(rows, half, shards=1, width=48)
        for name, value in alone.items():
            np.testing.assert_array_equal(both[name][shard * 2 : shard * 2 + 2], value, err_msg=name)
    assert both["loss_positions"].max() < 2 * 48  # an index into its shard's 2 rows, never the other's


def test_a_batch_cut_to_its_longest_row_scores_as_the_whole_row():
    """Trimming a batch to its longest row (batch_length) changes no loss: only padding is cut."""
    tokenizer = presets.tiny_tokenizer()
    examples, _ = batching.tokenize([("Instruction:\nSay hi.\n\nResponse:\n", "hi " * (i + 1)) for i in range(4)],
                                    tokenizer, 48)  # fmt: skip
    rows = batching.pad(examples, 48)
    chosen = np.arange(4)
    length = batching.batch_length(np.count_nonzero(rows["padding_mask"], axis=1), 16, 48)
    assert length < 48
    with float32_policy():
        lm, _ = lora_model()
        trainer = builder.compile(lm, 1e-3, 0.0)
        whole = trainer.predict_on_batch(batching.inputs(rows, chosen, 1, 48)[0])
        cut = trainer.predict_on_batch(batching.inputs(rows, chosen, 1, 48, length)[0])
    np.testing.assert_allclose(cut, whole, rtol=1e-5, atol=1e-6)
