"""Packing is exact: each packed example gets the loss and logits it would get alone, on this backend."""

import keras
import keras_hub
import numpy as np
import pytest
from conftest import float32_policy

from finetune import attention, batching, packing, presets
from finetune.batching import Example


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(5, 300, size=500)]
    bins = packing.best_fit_decreasing(lengths, 512)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    # Best-fit decreasing is within 11/9 OPT + 1 bins; the sum bound is a lower bound on OPT.
    assert len(bins) <= 11 / 9 * (sum(lengths) / 512 + 1) + 1
    assert bins == packing.best_fit_decreasing(lengths, 512)  # deterministic


def examples_of(lengths, seed=0, vocabulary=200):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = [batching.BOS, *(int(t) for t in rng.integers(10, vocabulary, size=n - 2)), batching.EOS]
        prompt = n // 3
        out.append(Example(ids, [0.0] * (prompt + 1) + [1.0] * (n - prompt - 1)))
    return out


def test_packed_rows_keep_each_example_whole_and_its_targets_inside_it():
    examples = examples_of([20, 9, 14, 30, 6, 11])
    arrays = packing.pack(examples, 32)
    assert arrays["token_ids"].shape[1] == 32 and arrays["token_ids"].shape[0] < len(examples)
    found = []
    for row in range(len(arrays["token_ids"])):
        segments = arrays["segment_ids"][row]
        for segment in range(1, segments.max() + 1):
            where = np.flatnonzero(segments == segment)
            assert (np.diff(where) == 1).all()  # contiguous
            ids = [*arrays["token_ids"][row, where].tolist(), int(arrays["labels"][row, where[-1]])]
            found.append((ids, arrays["weights"][row, where].tolist()))
    assert sorted(map(str, found)) == sorted(str((e.token_ids, e.weights[1:])) for e in examples)
    assert packing.padding_fraction(arrays) < packing.padding_fraction(batching.pad(examples, 32))


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


def _gemma3():
    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=256, image_size=896, num_layers=2, num_query_heads=4, num_key_value_heads=1,
        hidden_dim=32, intermediate_dim=64, head_dim=8, sliding_window_size=4, vision_encoder=None,
    )  # fmt: skip
    return keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=None)


MODELS = {"gemma": _gemma1, "gemma2-sliding-window": _gemma2, "gemma3": _gemma3}


@pytest.fixture(scope="module", params=sorted(MODELS))
def lm(request):
    keras.utils.set_random_seed(1)
    with float32_policy():  # the 1e-4 exactness is float32's
        model = MODELS[request.param]()
    assert attention.enable(model.backbone) == len(model.backbone.transformer_layers)
    return model


def logits(lm, arrays):
    x = {"token_ids": arrays["token_ids"], "padding_mask": arrays["segment_ids"]}
    return np.asarray(keras.ops.convert_to_numpy(lm(x)), np.float64)


def token_losses(logits_, labels):
    shifted = logits_ - logits_.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]


def test_each_packed_example_gets_the_loss_it_gets_alone(lm):
    examples = examples_of([12, 7, 17, 9, 5], seed=3)
    packed = packing.pack(examples, 32)
    assert packed["segment_ids"].max() >= 3  # several examples share a row
    packed_losses = token_losses(logits(lm, packed), packed["labels"])
    alone = batching.pad(examples, 32)
    alone_losses = token_losses(logits(lm, alone), alone["labels"])
    for index, example in enumerate(examples):
        row, where = _locate(packed, example)
        n = len(example.token_ids) - 1
        weights = np.asarray(example.weights[1:])
        got = (packed_losses[row, where] * weights).sum() / weights.sum()
        want = (alone_losses[index, :n] * weights).sum() / weights.sum()
        assert got == pytest.approx(want, rel=1e-4), index


def test_changing_one_example_leaves_the_others_logits_unchanged(lm):
    examples = examples_of([12, 7, 17, 9], seed=5)
    packed = packing.pack(examples, 48)
    assert packed["token_ids"].shape[0] == 1  # all four in one row
    before = logits(lm, packed)
    changed = {k: v.copy() for k, v in packed.items()}
    target = changed["segment_ids"][0] == 2
    changed["token_ids"][0, target] = (changed["token_ids"][0, target] + 17) % 200 + 10
    after = logits(lm, changed)
    others = (packed["segment_ids"][0] != 2) & (packed["segment_ids"][0] > 0)  # padding may look anywhere
    np.testing.assert_allclose(after[0, others], before[0, others], rtol=1e-6, atol=1e-6)
    assert not np.allclose(after[0, target], before[0, target])


def test_one_example_rows_get_keras_hub_s_own_mask(lm):
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
