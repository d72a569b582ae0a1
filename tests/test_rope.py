"""rope.py: keras-hub's rotary embeddings with their tables kept, on PyTorch: the same tensors, bit for bit."""

import keras
import numpy as np
import pytest
from conftest import BACKEND

from finetune.model import attention, families, presets, rope
from finetune.platform import keras_compat

torch_only = pytest.mark.skipif(BACKEND != "torch", reason="rope.py's lean path is PyTorch's alone")


def _inputs(backbone, length=12):
    """A packed row and a row of one example, as the trainer feeds them (segment ids in padding_mask)."""
    names = {t.name for t in keras.tree.flatten(backbone.inputs)}
    rng = np.random.default_rng(0)
    inputs = {"token_ids": rng.integers(1, 50, (2, length)).astype("int32"),
              "padding_mask": np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 10 + [0] * 2], "int32")}  # fmt: skip
    if "position_ids" in names:
        inputs["position_ids"] = np.tile(np.arange(length, dtype="int32"), (2, 1))
    return {k: v for k, v in inputs.items() if k in names}


def _numpy(out):
    return keras.tree.map_structure(lambda t: keras.ops.convert_to_numpy(keras.ops.cast(t, "float32")), out)


@torch_only
@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma3", "tiny-gemma4"])
@pytest.mark.parametrize("policy", ["float32", "bfloat16"])
def test_a_backbone_with_the_tables_kept_computes_what_keras_hub_does(preset, policy):
    keras.config.set_dtype_policy(policy)
    keras_compat.lean_torch_ops()
    backbone = presets.tiny_backbone(presets.tiny_vocabulary_size(preset), name=preset)
    attention.enable(backbone)
    inputs = _inputs(backbone)
    own = _numpy(backbone(inputs))
    took = rope.enable(backbone)
    assert took >= len(families.decoder_blocks(backbone))  # a rotary layer (Gemma 1: and its attention) per block
    assert rope.enable(backbone) == 0  # once
    for _ in range(2):  # the tables made, then kept
        ours = _numpy(backbone(inputs))
        for a, b in zip(keras.tree.flatten(ours), keras.tree.flatten(own)):
            np.testing.assert_array_equal(a, b)


@torch_only
def test_the_gradients_through_the_kept_tables_are_keras_hubs():
    import torch

    keras_compat.lean_torch_ops()
    backbone = presets.tiny_backbone(presets.tiny_vocabulary_size())
    inputs = _inputs(backbone)
    weights = [w for w in backbone.trainable_weights if "query" in w.path or "key" in w.path]

    def gradients():
        for w in weights:
            w.value.grad = None
        out = backbone(inputs)
        torch.sum(out.float() ** 2).backward()
        return [w.value.grad.clone() for w in weights]

    own = gradients()
    rope.enable(backbone)
    for a, b in zip(gradients(), own):
        assert torch.equal(a, b)


@torch_only
def test_a_later_start_or_given_positions_go_to_keras_hub_and_few_shapes_are_kept():
    import torch

    keras_compat.lean_torch_ops()
    layer = keras_compat.rotary_embedding_class()(max_wavelength=10_000.0)
    x = torch.randn(2, 8, 3, 16)
    own = [layer(x), layer(x, start_index=5), layer(x, positions=torch.arange(3, 11))]
    own_call = layer.call
    keras_compat.replace_call(layer, rope._kept_tables(layer))
    ours = [layer(x), layer(x, start_index=5), layer(x, positions=torch.arange(3, 11))]
    for a, b in zip(ours, own):
        assert torch.equal(a, b)
    tables = layer.call.__closure__[[c for c in layer.call.__code__.co_freevars].index("tables")].cell_contents
    assert len(tables) == 1  # row length 8 from position 0; the other two calls made theirs anew
    for length in range(9, 9 + 2 * rope.SHAPES_KEPT):
        y = torch.randn(1, length, 2, 16)
        assert torch.equal(layer(y), own_call(y))
    assert len(tables) == rope.SHAPES_KEPT


@torch_only
def test_the_masks_every_block_shares_are_made_once_a_forward(monkeypatch):
    keras_compat.lean_torch_ops()
    backbone = presets.tiny_backbone(presets.tiny_vocabulary_size())
    attention.enable(backbone)
    inputs = _inputs(backbone)
    own = _numpy(backbone(inputs))
    made = []
    real = attention.same_example
    monkeypatch.setattr(attention, "same_example", lambda s: made.append(1) or real(s))
    for count in (1, 2):
        np.testing.assert_array_equal(_numpy(backbone(inputs)), own)
        assert len(made) == count  # one a forward, for its blocks
    assert len(families.decoder_blocks(backbone)) > 1


@pytest.mark.skipif(BACKEND == "torch", reason="the traced backends")
def test_jax_and_tensorflow_keep_keras_hubs_rotary_call():
    backbone = presets.tiny_backbone(presets.tiny_vocabulary_size())
    assert rope.enable(backbone) == 0
