import keras
import numpy as np
import pytest

from finetune.data import batching
from finetune.model import builder, presets
from finetune.platform import backend
from finetune.platform.errors import UserError

TINY = presets.Source("tiny", "tiny", "gemma")


def build(rank=2, alpha=None, targets=("query", "value")):
    backend.set_seed(0)
    lm, preprocessor = builder.build(TINY, seq_len=32)
    builder.enable_lora(lm, rank, alpha, list(targets))
    return lm, preprocessor


def a_batch(preprocessor, n=4):
    pairs = [(f"Instruction:\nSay {i}.\n\nResponse:\n", f"{i} {i} {i}.") for i in range(n)]
    examples, _ = batching.tokenize(pairs, preprocessor.tokenizer, seq_len=32)
    return batching.TrainOrder(batching.pad(examples, 32), batch_size=n, seed=0).batch(0)


def logits(lm, x):
    tokens = {"token_ids": x["token_ids"], "padding_mask": x["padding_mask"]}
    return keras.ops.convert_to_numpy(lm(tokens, training=False))


def test_tiny_base_weights_are_the_same_on_every_build():
    first, _ = builder.build(TINY, seq_len=32)
    second, _ = builder.build(TINY, seq_len=32)
    for a, b in zip(first.backbone.weights, second.backbone.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


def test_only_lora_factors_train():
    lm, _ = build(rank=2)
    names = {v.path.split("/")[-1] for v in lm.trainable_weights}
    assert names == {"lora_kernel_a", "lora_kernel_b"}
    # Keras factors an einsum kernel of shape (heads, hidden, head_dim) into
    # A (heads, hidden, rank) and B (rank, head_dim): query has 4 heads, value 1.
    query, value = 4 * 128 * 2 + 2 * 32, 1 * 128 * 2 + 2 * 32
    assert builder.trainable_parameters(lm) == 2 * (query + value)


def test_alpha_sets_the_layer_scale_and_targets_are_checked():
    lm, _ = build(rank=2, alpha=8.0, targets=("query",))
    adapted = [layer for layer in lm.backbone._flatten_layers() if getattr(layer, "lora_enabled", False)]
    assert [layer.name for layer in adapted] == ["query", "query"]
    assert all(layer.lora_alpha == 8.0 for layer in adapted)
    fresh, _ = builder.build(TINY, seq_len=32)
    with pytest.raises(UserError, match="no layer named 'qkv'"):
        builder.enable_lora(fresh, 2, None, ["qkv"])


def test_adapter_save_then_load_gives_identical_logits(tmp_path):
    lm, preprocessor = build(rank=2, alpha=4.0)
    trainer = builder.compile(lm, learning_rate=1e-2, weight_decay=0.0)
    x, y, w = a_batch(preprocessor)
    for _ in range(3):
        trainer.train_on_batch(x, y, sample_weight=w)
    path = str(tmp_path / "adapter.lora.h5")
    lm.backbone.save_lora_weights(path)

    base, _ = build(rank=2, alpha=4.0)
    assert not np.allclose(logits(base, x), logits(lm, x), atol=1e-4)  # training moved the adapter
    base.backbone.load_lora_weights(path)
    np.testing.assert_allclose(logits(base, x), logits(lm, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zeros_from", [None, 1], ids=["large-floats-zeroed", "every-float-zeroed"])
def test_local_preset_directory_resolves_and_loads(tmp_path, monkeypatch, zeros_from):
    """every-float-zeroed: each float variable starts as zeros (model.zeros_until_loaded), so one the preset's weights
    missed would show in the logits."""
    if zeros_from is not None:
        monkeypatch.setattr(builder, "_LARGE", zeros_from)
    lm, preprocessor = builder.build(TINY, seq_len=32)
    lm.preprocessor = preprocessor
    lm.save_to_preset(str(tmp_path / "tiny-preset"))
    source = presets.resolve(str(tmp_path / "tiny-preset"))
    assert (source.kind, source.family) == ("local", "gemma")
    loaded, loaded_preprocessor = builder.build(source, seq_len=32)
    x, _, _ = a_batch(preprocessor)
    lm.preprocessor = None
    np.testing.assert_allclose(logits(loaded, x), logits(lm, x), rtol=1e-5, atol=1e-5)
    assert loaded_preprocessor.tokenizer.vocabulary_size() == preprocessor.tokenizer.vocabulary_size()


def test_a_local_preset_loads_quantized_as_keras_quantizes_it(tmp_path, monkeypatch):
    """--quantize int4 on a saved preset: each decoder kernel quantized as it loads, equal to keras' quantize().

    Every float variable of the loaded base starts as zeros (model.zeros_until_loaded), so one the load missed
    would show."""
    monkeypatch.setattr(builder, "_LARGE", 1)
    before = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy("float32")
        lm, preprocessor = builder.build(TINY, seq_len=32)
        lm.preprocessor = preprocessor
        lm.save_to_preset(str(tmp_path / "tiny-preset"))
        source = presets.resolve(str(tmp_path / "tiny-preset"))
        loaded, _ = builder.load_base(source, 32, "float32", "int4")
        embedding = keras.ops.convert_to_numpy(lm.backbone.token_embedding.embeddings)
        lm.backbone.quantize("int4")
    finally:
        keras.config.set_dtype_policy(before)
    expected = {v.path: keras.ops.convert_to_numpy(v) for v in lm.backbone.weights}
    decoder = [v for v in loaded.backbone.weights if v.path.startswith("decoder_block")]
    assert {v.path.rsplit("/", 1)[-1] for v in decoder} >= {"kernel", "kernel_scale"}
    for variable in decoder:
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), expected[variable.path], variable.path)
    assert loaded.backbone.token_embedding.embeddings.dtype == "float32"  # the output projection stays float
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded.backbone.token_embedding.embeddings), embedding)


@pytest.mark.parametrize(
    "targets", [("query", "value"), ("query", "key", "value", "attention_output", "ffw_gating", "ffw_linear")]
)
def test_lora_beside_the_kernel_gives_keras_merged_output(targets):
    """The adapted layers' own call (x W + s (x A) B) against Keras' merged kernel (x (W + s A B)), with B
    nonzero, float32: the same logits to rounding."""
    from conftest import float32_policy

    with float32_policy():
        lm, preprocessor = build(rank=2, alpha=3.0, targets=targets)
        adapted = [layer for layer in lm.backbone._flatten_layers() if getattr(layer, "lora_enabled", False)]
        rng = np.random.default_rng(0)
        for layer in adapted:
            b = layer.lora_kernel_b
            b.assign(rng.normal(0, 0.5, tuple(b.shape)).astype("float32"))
        if keras.config.backend() == "jax":
            assert adapted and not any("call" in vars(layer) for layer in adapted)  # Keras' own call on JAX
            return
        assert adapted and all("call" in vars(layer) for layer in adapted)  # every one is applied beside
        x, _, _ = a_batch(preprocessor)
        beside = logits(lm, x)
        for layer in adapted:
            del layer.call  # back to Keras' own call, which merges
        merged = logits(lm, x)
    np.testing.assert_allclose(beside, merged, rtol=1e-4, atol=1e-4)


def test_a_base_to_be_loaded_starts_its_large_floats_as_zeros_and_keras_draws_again_after():
    with builder.zeros_until_loaded():
        big = keras.layers.Dense(512, dtype="float16")
        big.build((None, 256))  # 131,072 kernel values: large
        norm = keras.layers.LayerNormalization(dtype="float32")
        norm.build((None, 256))
    assert not np.any(keras.ops.convert_to_numpy(big.kernel))
    assert np.all(keras.ops.convert_to_numpy(norm.gamma) == 1)  # small: its own initializer
    after = keras.layers.Dense(512, dtype="float32")
    after.build((None, 256))
    assert np.any(keras.ops.convert_to_numpy(after.kernel))  # keras' own initializer again
