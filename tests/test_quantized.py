"""quantized.py: a base built quantized, its random fill for benchmarks, and its own call."""

import keras
import numpy as np
import pytest
from conftest import float32_policy

from finetune import presets, quantized


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
