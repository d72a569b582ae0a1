"""Packing is exact: with the segment mask (attention.py), each packed example gets the loss and logits it would get
alone, on this backend.

For Gemma 1, a Gemma 2 layout, and the tiny presets of Gemma 3, Gemma 4 (dense and MoE) and Gemma 3n. How the
examples are placed in rows is test_packing.py's.
"""

import keras
import keras_hub
import numpy as np
import pytest
from conftest import examples_of, float32_policy

from finetune.data import batching, packing
from finetune.model import attention, builder, families, presets
from finetune.platform import backend


def _gemma1():
    backbone = presets.tiny_backbone(presets.tiny_tokenizer().vocabulary_size())
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _gemma2():
    """Gemma 2's layout: sliding-window layers (a window of 4, shorter than the examples), soft caps, post norms."""
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=256, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
        intermediate_dim=64, head_dim=8, query_head_dim_normalize=False, use_post_ffw_norm=True,
        use_post_attention_norm=True, final_logit_soft_cap=30.0, attention_logit_soft_cap=50.0,
        use_sliding_window_attention=True, sliding_window_size=4,
    )  # fmt: skip
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _tiny(name):
    """A newer family's tiny preset (presets.TINY): sliding and global layers, windows of 4, shorter than the
    examples; Gemma 4's with per-layer inputs and a layer that borrows keys and values, or with experts;
    Gemma 3n's with AltUp, Laurel and a layer that borrows keys and values."""
    return lambda: builder.load_base(presets.resolve(name), 32)[0]


MODELS = {
    "gemma": _gemma1,
    "gemma2-sliding-window": _gemma2,
    **{name: _tiny(name) for name in ("tiny-gemma3", "tiny-gemma4", "tiny-gemma4-moe", "tiny-gemma3n")},
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def lm(request):
    backend.set_seed(1)
    with float32_policy():  # the 1e-4 exactness is float32's
        built = MODELS[request.param]()
    assert attention.enable(built.backbone) == len(families.decoder_blocks(built.backbone))
    assert attention.packs_exactly(built.backbone)
    return built


def logits(lm, *row_sets):
    """The logits of each set of rows, from one forward pass over all of them (one dispatch of the eager model)."""
    arrays = {key: np.concatenate([rows[key] for rows in row_sets]) for key in ("token_ids", "segment_ids")}
    x = batching.model_inputs(arrays["token_ids"], arrays["segment_ids"], builder.input_names(lm))
    out = np.asarray(keras.ops.convert_to_numpy(lm(x)), np.float64)
    return np.split(out, np.cumsum([len(rows["token_ids"]) for rows in row_sets])[:-1])


def token_losses(logits_, labels):
    shifted = logits_ - logits_.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]


def test_each_packed_example_gets_the_loss_it_gets_alone_and_ignores_the_others(lm):
    examples = examples_of([12, 7, 17, 9, 5], seed=3)
    packed, alone = packing.pack(examples, 32), batching.pad(examples, 32)
    assert packed["segment_ids"].max() >= 3  # several examples share a row
    one_row = packing.pack(examples_of([9, 5, 8, 6], seed=5), 32)
    assert one_row["token_ids"].shape[0] == 1  # all four in one row
    changed = {k: v.copy() for k, v in one_row.items()}
    target = changed["segment_ids"][0] == 2
    changed["token_ids"][0, target] = (changed["token_ids"][0, target] + 17) % 200 + 10
    packed_logits, alone_logits, before, after = logits(lm, packed, alone, one_row, changed)

    packed_losses = token_losses(packed_logits, packed["labels"])
    alone_losses = token_losses(alone_logits, alone["labels"])
    for index, example in enumerate(examples):
        row, where = _locate(packed, example)
        n = len(example.token_ids) - 1
        weights = np.asarray(example.weights[1:])
        got = (packed_losses[row, where] * weights).sum() / weights.sum()
        want = (alone_losses[index, :n] * weights).sum() / weights.sum()
        assert got == pytest.approx(want, rel=1e-4), index
    # Changing one example of a row leaves the others' logits as they were.
    others = (one_row["segment_ids"][0] != 2) & (one_row["segment_ids"][0] > 0)  # padding may look anywhere
    np.testing.assert_allclose(after[0, others], before[0, others], rtol=1e-6, atol=1e-6)
    assert not np.allclose(after[0, target], before[0, target])


def test_one_example_rows_get_keras_hub_s_own_mask_in_every_block(lm):
    """The wrapped mask method, given one example per row, returns what keras-hub's own returns (windows too)."""
    import inspect

    arrays = batching.pad(examples_of([9, 14], seed=2), 16)
    for block in families.decoder_blocks(lm.backbone):
        wrapped = block._compute_attention_mask
        names = inspect.signature(wrapped.keras_hub).parameters
        hidden = np.zeros((2, 16, 8), "float32")
        args = {"x": hidden, "cache": None, "cache_update_index": 0, "vision_mask": None}
        args = {name: value for name, value in args.items() if name in names}
        ours = wrapped(padding_mask=arrays["segment_ids"], **args)
        theirs = wrapped.keras_hub(padding_mask=arrays["padding_mask"], **args)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours), keras.ops.convert_to_numpy(theirs))


def test_blocks_alike_share_one_packed_mask_a_forward_and_it_is_each_ones_own(lm, monkeypatch):
    """On PyTorch the blocks of a forward whose masks read the same (Gemma 4's sliding layers, its global ones)
    share the first one's, kept on the segment ids (attention._kept_block_masks): each equals the block's own."""
    import inspect

    arrays = packing.pack(examples_of([12, 7, 17, 9, 5], seed=3), 32)
    segments = keras.ops.convert_to_tensor(arrays["segment_ids"], "int32")
    blocks = families.decoder_blocks(lm.backbone)

    def masks():
        out = []
        for block in blocks:
            wrapped = block._compute_attention_mask
            names = inspect.signature(wrapped.keras_hub).parameters
            hidden = keras.ops.zeros((*segments.shape, 8))
            args = {"x": hidden, "cache": None, "cache_update_index": 0, "vision_mask": None}
            out.append(wrapped(padding_mask=segments, **{k: v for k, v in args.items() if k in names}))
        return out

    shared = masks()
    with monkeypatch.context() as patched:
        patched.setattr(attention, "_kept_block_masks", lambda segments: None)
        own = masks()
    for a, b in zip(shared, own, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
    if keras.config.backend() == "torch":
        kinds = {attention._block_mask_key(b, segments, 0) for b in blocks}
        assert len({id(m) for m in shared}) == len(kinds) <= len(blocks)
        assert len({id(m) for m in own}) == len(blocks)
    if "sliding_window_size" in str(lm.backbone.get_config()) and len(blocks) > 2:
        assert not all(np.array_equal(*map(keras.ops.convert_to_numpy, pair)) for pair in zip(shared, shared[1:]))


def test_the_segment_mask_of_one_example_rows_is_causal_onto_tokens():
    from keras_hub.src.layers.modeling.transformer_layer_utils import compute_causal_mask

    arrays = batching.pad(examples_of([9, 14], seed=2), 16)
    ours = keras.ops.convert_to_numpy(attention.segment_mask(arrays["segment_ids"]))
    causal = keras.ops.convert_to_numpy(compute_causal_mask(2, 16, 16))
    theirs = np.minimum(arrays["padding_mask"][:, None, :].astype(np.int32), causal)
    np.testing.assert_array_equal(ours, theirs)


def _locate(packed, example):
    n = len(example.token_ids) - 1
    for row in range(len(packed["token_ids"])):
        for segment in range(1, packed["segment_ids"][row].max() + 1):
            where = np.flatnonzero(packed["segment_ids"][row] == segment)
            if len(where) == n and list(packed["token_ids"][row, where]) == example.token_ids[:-1]:
                return row, where
    raise AssertionError("example not found in the packed rows")


@pytest.mark.parametrize("layout", ["gemma", "gemma2"])
def test_one_key_head_attention_equals_keras_hub_s_own_layout(layout):
    """gemma_2b's multi-query attention is computed in the (batch, query, head, key) layout (attention.py), which
    needs no transpose of the scores: the same outputs as keras-hub's einsum path, with its mask, soft cap and
    sliding window."""
    gemma2 = layout == "gemma2"
    with float32_policy():
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=1, hidden_dim=32,
            intermediate_dim=64, head_dim=8, query_head_dim_normalize=not gemma2,
            attention_logit_soft_cap=50.0 if gemma2 else None, use_sliding_window_attention=gemma2,
            sliding_window_size=4,
        )  # fmt: skip
    layer = families.decoder_blocks(backbone)[0].attention
    original = layer._compute_attention
    attention.enable(backbone)
    assert layer._compute_attention is not original and getattr(layer._compute_attention, "one_key_head", False)
    rng = np.random.default_rng(0)
    q, k, v = (keras.ops.convert_to_tensor(rng.standard_normal((2, 12, n, 8)).astype("float32")) for n in (4, 1, 1))
    mask = attention.segment_mask(np.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3]))
    ours = keras.ops.convert_to_numpy(layer._compute_attention(q, k, v, mask))
    theirs = keras.ops.convert_to_numpy(original(q, k, v, mask))
    assert ours.shape == theirs.shape == (2, 12, 4, 8)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
