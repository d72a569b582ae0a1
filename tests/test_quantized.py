"""quantized.py: a base built quantized, its random fill for benchmarks, and its own call.

Each quantized base is compared with keras' own quantize() of the float base, and trained with LoRA.
"""

import keras
import numpy as np
import pytest
from conftest import float32_policy, lora_model
from conftest import lora_train_losses as train_losses

from finetune.model import builder, presets, quantized
from finetune.platform import keras_compat


@pytest.fixture(autouse=True)
def _collections_walk_the_test_s_objects():
    """These tests build quantized bases through presets.tiny_backbone, outside builder.load_base's guard: each
    float kernel a quantized build deletes runs a full gc.collect() (keras_compat.collections_of_new_objects_only)."""
    with keras_compat.collections_of_new_objects_only():
        yield


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_random_fill_gives_kernels_of_variance_one_over_fan_in_without_a_float_kernel(mode):
    """The benchmark's random base: codes and scales written straight in, dequantizing to std about 1/sqrt(fan-in)."""
    with float32_policy():
        backbone = presets.tiny_backbone(
            presets.tiny_tokenizer().vocabulary_size(), dtype=quantized.policies("float32", mode)
        )
        quantized.weights_only(backbone)
        quantized.fill_random(backbone, seed=3)
        layers = quantized.quantized_layers(backbone)
        assert layers
        for layer in layers:
            stored = tuple(quantized._int4_weights(layer) if mode == "int4" else (layer._kernel, layer.kernel_scale))
            kernel = (quantized._int4_kernel(layer) if mode == "int4" else quantized._int8_kernel(layer))(
                *(keras.ops.convert_to_tensor(v) for v in stored)
            )
            kernel = keras.ops.convert_to_numpy(kernel)
            fan_in = kernel.size // int(
                np.prod([kernel.shape[i] for i in range(kernel.ndim) if i not in layer._kernel_reduced_axes])
            )
            assert 0.7 < kernel.std() * np.sqrt(fan_in) < 1.3, layer.path
        hidden = backbone({"token_ids": np.ones((1, 8), "int32"), "padding_mask": np.ones((1, 8), "int32")})
    assert np.isfinite(keras.ops.convert_to_numpy(hidden)).all()


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_base_loaded_quantized_equals_keras_quantize_of_the_float_base(mode):
    """Built quantized and filled layer by layer, the decoder kernels are bit for bit keras' quantize()."""
    before = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy("mixed_bfloat16")
        vocabulary = presets.tiny_tokenizer().vocabulary_size()
        reference = presets.tiny_backbone(vocabulary, dtype="bfloat16")
        reference.quantize(mode)
        ours = presets.tiny_backbone(vocabulary, dtype=quantized.policies("bfloat16", mode))
    finally:
        keras.config.set_dtype_policy(before)
    expected = {v.path: keras.ops.convert_to_numpy(v) for v in reference.weights}
    decoder = [v for v in ours.weights if v.path.startswith("decoder_block")]
    assert {v.path.rsplit("/", 1)[-1] for v in decoder} >= {"kernel", "kernel_scale"}
    for variable in decoder:
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), expected[variable.path])
    # The embedding is also the output projection: it stays bfloat16 (keras' quantize() makes it int).
    assert ours.token_embedding.embeddings.dtype == "bfloat16"


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_quantized_base_s_own_call_trains_as_keras_quantized_call(mode):
    """Each quantized layer's own call (its kernel dequantized when its input arrives, LoRA beside it) against
    keras' quantized call on the same weights: the same losses over steps, so the same outputs and gradients."""
    with float32_policy():
        ours = train_losses(lora_model(quantize=mode)[0], steps=3)
        if mode == "int8" and keras.config.backend() == "torch":
            # keras' own int8 call fails to train on PyTorch (its backward adjusts the scale's axes a second
            # time, einsum_dense.py, keras 3.15), which ours does not inherit: JAX and TensorFlow compare.
            assert np.isfinite(ours).all() and ours[-1] < ours[0]
            return
        lm, _ = lora_model(quantize=mode)
        layers = quantized.quantized_layers(lm.backbone)
        assert layers and all("quantized_call" in vars(layer) for layer in layers)
        for layer in layers:
            del layer.call, layer.quantized_call  # keras' own again
        theirs = train_losses(lm, steps=3)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert ours[-1] < ours[0]


@pytest.mark.skipif(keras.config.backend() != "jax", reason="XLA's compiled memory: JAX only")
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_xla_keeps_one_dequantized_kernel_at_a_time(mode):
    """Eight quantized layers' input gradient, compiled: its scratch memory holds about one layer's float kernel.

    keras' own call let XLA dequantize every kernel up front and keep them all to
    the backward (8 float32 kernels, 32 MiB here; gemma-7b asked 34.4 GiB so)."""
    import jax
    from keras.src.backend.jax.core import StatelessScope

    with float32_policy():
        layers = []
        for _ in range(8):
            layer = keras.layers.EinsumDense("btd,df->btf", output_shape=(None, 1024))
            layer.build((1, 4, 1024))
            layer.quantize(mode)
            quantized.weights_only_layer(layer)
            assert builder.beside_the_kernel(layer)
            layers.append(layer)
    variables = [v for layer in layers for v in layer.variables]

    def loss(x, values):
        with StatelessScope(state_mapping=list(zip(variables, values))):
            for layer in layers:
                x = keras.ops.tanh(layer(x))
        return keras.ops.sum(x)

    compiled = jax.jit(jax.grad(loss)).lower(np.ones((1, 4, 1024), "float32"), [v.value for v in variables]).compile()
    kernel_bytes = 1024 * 1024 * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * kernel_bytes


def test_lora_factors_stay_float32_on_an_int4_bfloat16_base():
    before = keras.config.dtype_policy()
    try:
        lm, _ = lora_model("bfloat16", quantize="int4")
        assert {v.dtype for v in lm.trainable_variables} == {"float32"}
        frozen = {v.path.rsplit("/", 1)[-1]: v.dtype for v in lm.backbone.weights if not v.trainable}
        assert frozen["embeddings"] == "bfloat16" and "int8" in set(frozen.values())  # int4 packed in int8
        losses = train_losses(lm, steps=4)
    finally:
        keras.config.set_dtype_policy(before)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.backend_neutral  # the settings' check and auto's choice are Python
def test_an_int8_base_is_not_computed_in_float16(tmp_path, monkeypatch):
    """keras' int8 layers refuse float16 (it was an exit 1 when the model was built): --precision float16 with
    --quantize int8 is exit 2 before anything is written, and auto picks float32 where it would pick float16."""
    from conftest import invoke

    from finetune import config
    from finetune.platform import backend
    from finetune.training import resolve

    out = tmp_path / "run"
    result = invoke("gemma", "--preset", "tiny", "--quantize", "int8", "--precision", "float16", "--output", out)
    assert result.exit_code == 2 and "keras' int8 layers do not compute in float16" in result.output
    assert not out.exists()
    monkeypatch.setattr(backend, "auto_precision_why", lambda device, overflows: ("float16", "auto: a T4"))
    for mode, expected in (("int8", "float32"), ("int4", "float16"), (None, "float16")):
        cfg = config.load("tiny", {"model.quantize": mode})
        assert resolve._precision(cfg, "gpu", None).value == expected, mode
