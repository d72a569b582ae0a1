"""A segment-aware attention mask on keras-hub's Gemma decoder blocks, for packed rows.

keras-hub's Gemma, Gemma 2 and Gemma 3 decoder blocks build their attention
mask from `padding_mask` alone: causal, and not onto padding. A packed row
holds several examples, and each must attend only within itself. So the
row's segment ids (1, 2, 3... per example, 0 for padding) are fed where the
backbone takes `padding_mask`, and each decoder block's mask method is
wrapped to make them a block-diagonal causal mask: position i attends to j
when j <= i and both lie in the same example.

- For rows of one example (ids 0 and 1) the mask equals keras-hub's own, so
  the hook is always on; padding positions still attend to the real tokens
  before them, as in keras-hub, so no softmax row is empty.
- Generation (with a cache) and Gemma 3 images go through keras-hub's method.
- Rotary embeddings depend only on i - j, so an example's attention scores do
  not depend on where it sits in the row. Gemma 2 and 3 apply their sliding
  windows after this mask, inside the attention layer, so a window never
  reaches across examples either.
"""

from __future__ import annotations

import inspect

from keras import ops


def enable(backbone) -> int:
    """Wrap every decoder block's mask method; returns how many were wrapped (idempotent)."""
    wrapped = 0
    for block in backbone.transformer_layers:
        original = block._compute_attention_mask
        if getattr(original, "segment_aware", False):
            continue
        block._compute_attention_mask = _segment_aware(original)
        wrapped += 1
    return wrapped


def _segment_aware(original):
    names = list(inspect.signature(original).parameters)

    def compute_attention_mask(*args, **kwargs):
        bound = {**dict(zip(names, args)), **kwargs}
        segments = bound.get("padding_mask")
        if bound.get("cache") is not None or bound.get("vision_mask") is not None or segments is None:
            return original(*args, **kwargs)
        return segment_mask(segments)

    compute_attention_mask.segment_aware = True
    return compute_attention_mask


def segment_mask(segment_ids):
    """(batch, length, length) int32, 1 where query i may attend to key j."""
    segments = ops.cast(segment_ids, "int32")
    positions = ops.arange(ops.shape(segments)[1])
    causal = ops.expand_dims(ops.greater_equal(ops.expand_dims(positions, 1), ops.expand_dims(positions, 0)), 0)
    key_is_token = ops.expand_dims(ops.greater(segments, 0), 1)
    same_example = ops.equal(ops.expand_dims(segments, 2), ops.expand_dims(segments, 1))
    query_is_padding = ops.expand_dims(ops.equal(segments, 0), 2)
    allowed = ops.logical_and(ops.logical_and(causal, key_is_token), ops.logical_or(same_example, query_is_padding))
    return ops.cast(allowed, "int32")
