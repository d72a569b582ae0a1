"""A segment-aware attention mask on keras-hub's Gemma decoder blocks, for packed rows.

keras-hub's Gemma decoder blocks (Gemma 1 to 4 and 3n) build their attention
mask from `padding_mask` alone: causal, not onto padding, and for Gemma 4's
sliding-window layers within the window. A packed row holds several
examples, and each must attend only within itself. So the row's segment ids
(1, 2, 3... per example, 0 for padding) are fed where the backbone takes
`padding_mask`, and each decoder block's mask method is wrapped: it builds
keras-hub's own mask from the tokens (segment id > 0), then keeps only the
pairs within one example. Position i attends to j when keras-hub's mask
allows it and both lie in the same example.

- For rows of one example (ids 0 and 1) the mask equals keras-hub's own, so
  the hook is always on; padding positions still attend to the real tokens
  before them, as in keras-hub, so no softmax row is empty.
- Generation (with a cache) and images go through keras-hub's method alone.
  Gemma 3n's layers that borrow another layer's keys and values are handed
  that cache in training too; they take the segment mask whenever the mask
  holds segment ids (keras-hub's generation casts Gemma 3n's to booleans).
- Sliding windows compose with it: Gemma 1-3 and 3n apply theirs inside the
  attention layer, after this mask; Gemma 4 applies its own in the method
  wrapped here, before the example mask is laid over it. Either way a
  window never reaches across examples.
- Rotary embeddings depend only on i - j, so an example's attention scores do
  not depend on where it sits in the row; mixture-of-experts routing, Gemma
  3n's AltUp, Laurel and per-layer inputs work token by token.

Gemma 1 and 2 layers with one key-value head (gemma_2b's multi-query
attention) also compute their scores in another layout when keras-hub takes
its einsum path (no fused op: a CPU): keras-hub splits the query heads into
(key head, group) and lays the scores out (batch, head, group, query, key),
so each einsum's backward transposes the whole score tensor. With one key
head the query heads and positions are one axis of a plain batched matmul,
(batch, query, head, key), which needs no transpose: the same sums, and on
XLA's CPU backend the attention's forward and backward in 72% of the time
(cpu-small rows of 512, fwd+bwd).
"""

from __future__ import annotations

import contextvars
import inspect
import math

from keras import ops

from finetune.model import families
from finetune.platform import keras_compat


def enable(backbone) -> int:
    """Wrap every decoder block's mask method; returns how many were wrapped (idempotent).

    Returns 0, wrapping nothing, when the backbone's padding mask cannot carry
    segment ids (packs_exactly is then False).
    """
    if not _take_segment_ids(backbone):
        return 0
    wrapped = 0
    for block in families.decoder_blocks(backbone):
        original = block._compute_attention_mask
        if getattr(original, "segment_aware", False):
            continue
        keras_compat.replace_attention_mask(block, _segment_aware(block, original))
        wrapped += 1
        _one_key_head_layout(block)
    return wrapped


def _one_key_head_layout(block) -> None:
    """keras-hub's Gemma 1/2 attention with one key-value head: its einsum path in the (batch, query, head, key)
    layout (the module's docstring); the fused op, when keras-hub takes it, as it was."""
    layer = getattr(block, "attention", None)
    if type(layer) is not keras_compat.gemma_attention_class() or layer.num_key_value_heads != 1:
        return
    original = layer._compute_attention
    if getattr(original, "one_key_head", False):
        return

    def compute_attention(q, k, v, attention_mask, training=False, cache_update_index=0):
        if layer._use_fused_attention_op():
            return original(q, k, v, attention_mask, training=training, cache_update_index=cache_update_index)
        width = layer.head_dim if layer.query_head_dim_normalize else layer.hidden_dim // layer.num_query_heads
        if layer.use_sliding_window_attention and attention_mask is not None:
            attention_mask = layer._mask_sliding_window(attention_mask, cache_update_index=cache_update_index)
        q = ops.multiply(q, ops.cast(1 / math.sqrt(width), q.dtype))  # a float: torch.compile traces no numpy scalar
        logits = ops.einsum("btnh,bsh->btns", q, k[:, :, 0, :])
        if layer.logit_soft_cap is not None:
            logits = ops.multiply(ops.tanh(ops.divide(logits, layer.logit_soft_cap)), layer.logit_soft_cap)
        if attention_mask is not None:
            attention_mask = attention_mask[:, :, None, :]
        scores = ops.cast(layer.softmax(logits, mask=attention_mask), logits.dtype)
        if layer.dropout:
            scores = layer.dropout_layer(scores, training=training)
        return ops.einsum("btns,bsh->btnh", scores, v[:, :, 0, :])

    compute_attention.one_key_head = True
    keras_compat.replace_compute_attention(layer, compute_attention)


def packs_exactly(backbone) -> bool:
    """Whether every decoder block of `backbone` takes the segment mask (after enable)."""
    blocks = families.decoder_blocks(backbone)
    return bool(blocks) and all(getattr(b._compute_attention_mask, "segment_aware", False) for b in blocks)


def _take_segment_ids(backbone) -> bool:
    """Let the backbone's `padding_mask` input carry segment ids; False when it cannot.

    keras-hub declares Gemma 3n's padding mask boolean, and Keras casts every
    input to its declared dtype, which would fold segment ids 2, 3... into 1.
    Its decoder blocks cast the mask to int32 themselves, so the declared
    dtype is widened to int32 (a symbolic tensor's dtype has no public setter).
    The task model and any view of it share this input tensor.
    """
    import keras

    for tensor in keras.tree.flatten(backbone.inputs):
        if (
            tensor.name == "padding_mask"
            and tensor.dtype == "bool"
            and not keras_compat.widen_input_dtype(tensor, "int32")
        ):
            return False  # another Keras: leave it, and packing with it
    return True


# Generation of left-padded prompts (methods/rollouts.py): (batch, cache length) 1 where a key is a token, set
# around keras-hub's generate step so that each block's mask keeps the queries off the padding on the left. Set
# within the step's trace, it is a value of that trace (JAX, TensorFlow) or of the eager call (PyTorch).
GENERATION_KEYS = contextvars.ContextVar("generation_keys", default=None)


def left_padded_generate_step(lm):
    """`lm`'s generate step made to take `key_mask` beside `token_ids` and `padding_mask`: the prompts laid out
    on the right of their rows, padding on the left, and every row's prompt ending where the sampler starts.

    keras-hub's loop runs from its shortest prompt's end to the last position; right-padded prompts of unlike
    lengths make it sample (and throw away) the difference. Left-padded, it samples exactly the budget. The
    rotary embeddings see only i - j, so a prompt's scores do not change with where it sits; the mask keeps
    every query off the padding. Installed once on `lm` (an attribute keras-hub's generate function calls).

    The step's outputs that are None are left out: Gemma 3's and 4's steps return `images` None for text, which
    keras-hub's generate cannot gather when no preprocessor is attached (ids in, ids out)."""
    original = type(lm).generate_step

    def generate_step(inputs, stop_token_ids=None):
        inputs = dict(inputs)
        keys = inputs.pop("key_mask", None)
        token = GENERATION_KEYS.set(keys)
        try:
            out = original(lm, inputs, stop_token_ids=stop_token_ids)
        finally:
            GENERATION_KEYS.reset(token)
        return {name: value for name, value in out.items() if value is not None}

    lm.generate_step = generate_step
    lm.generate_function = None  # made again around this step


def _segment_aware(block, original):
    names = list(inspect.signature(original).parameters)
    borrows_cache = bool(getattr(block, "is_kv_shared_layer", False)) and "cache" in names

    def compute_attention_mask(*args, **kwargs):
        bound = {**dict(zip(names, args)), **kwargs}
        keys = GENERATION_KEYS.get() if bound.get("cache") is not None else None  # (a compiled block has none)
        if keys is not None:  # a left-padded prompt's generation
            allowed = ops.cast(original(*args, **kwargs), "int32")
            return ops.minimum(allowed, ops.expand_dims(ops.cast(keys, "int32"), 1))
        segments = bound.get("padding_mask")
        if segments is None or bound.get("vision_mask") is not None:
            return original(*args, **kwargs)
        if bound.get("cache") is not None and not (borrows_cache and _holds_segment_ids(segments)):
            return original(*args, **kwargs)
        segments = ops.cast(segments, "int32")
        kept, key = _kept_block_masks(segments), None
        if kept is not None and bound.get("cache") is None:
            key = _block_mask_key(block, bound[names[0]], bound.get("cache_update_index", 0))
            if key in kept:
                return kept[key]
        tokens, same = _per_row_of_segments(segments)
        bound["padding_mask"] = tokens
        allowed = ops.cast(original(**bound), "int32")  # keras-hub's own: causal, tokens, its window
        mask = ops.minimum(allowed, same)
        if key is not None:
            kept[key] = mask
        return mask

    compute_attention_mask.segment_aware = True
    compute_attention_mask.keras_hub = original
    return compute_attention_mask


def _per_row_of_segments(segments) -> tuple:
    """(segment id > 0, same_example) of `segments`: what every block of a forward builds alike from the one tensor
    of segment ids the backbone hands each. On PyTorch, which runs each op as it comes, they are made by the first
    block and kept on that tensor for the others (and for remat's recomputation), gone with it; JAX and TensorFlow
    trace the step once, and XLA shares them."""
    import keras

    kept = None
    if keras.config.backend() == "torch":
        import torch

        if type(segments) is torch.Tensor:
            kept = getattr(segments, "finetune_masks", None)
            if kept is None:
                kept = segments.finetune_masks = (ops.greater(segments, 0), same_example(segments))
    return kept or (ops.greater(segments, 0), same_example(segments))


# What a block's own mask method (keras-hub 0.32) reads of the block besides its arguments: Gemma 3's and 4's
# bidirectional attention, Gemma 4's sliding window (the window's width is its attention layer's).
_MASK_ATTRIBUTES = ("use_bidirectional_attention", "use_sliding_window_attention", "is_global_attention")


def _kept_block_masks(segments):
    """On PyTorch, the masks of the blocks of one forward, kept on its tensor of segment ids (as
    _per_row_of_segments keeps theirs): blocks alike in what their mask reads share one mask, made by the first
    of them (about 20 ops a block otherwise, and one mask kept for each block's backward where one serves all).
    None on JAX and TensorFlow, whose traced step shares them already."""
    import keras

    if keras.config.backend() != "torch":
        return None
    import torch

    if type(segments) is not torch.Tensor:
        return None
    kept = getattr(segments, "finetune_block_masks", None)
    if kept is None:
        kept = segments.finetune_block_masks = {}
    return kept


def _block_mask_key(block, x, cache_update_index):
    """What `block`'s mask is a function of, for rows of segment ids `x`'s shape without a cache: its class, the
    attributes its method reads (_MASK_ATTRIBUTES, the window's width) and the rows' shape and device."""
    if type(cache_update_index) is not int:
        return None
    window = getattr(getattr(block, "attention", None), "sliding_window_size", None)
    attributes = tuple(getattr(block, name, None) for name in _MASK_ATTRIBUTES)
    return type(block), attributes, window, cache_update_index, tuple(x.shape[:2]), x.device


def _holds_segment_ids(mask) -> bool:
    import keras

    return keras.backend.standardize_dtype(mask.dtype) != "bool"


def same_example(segment_ids):
    """(batch, length, length) int32, 1 where query i and key j lie in one example, or query i is padding."""
    segments = ops.cast(segment_ids, "int32")
    same = ops.equal(ops.expand_dims(segments, 2), ops.expand_dims(segments, 1))
    query_is_padding = ops.expand_dims(ops.equal(segments, 0), 2)
    return ops.cast(ops.logical_or(same, query_is_padding), "int32")


def segment_mask(segment_ids):
    """(batch, length, length) int32, 1 where query i may attend to key j: causal, onto tokens, in one example."""
    segments = ops.cast(segment_ids, "int32")
    positions = ops.arange(ops.shape(segments)[1])
    causal = ops.expand_dims(ops.greater_equal(ops.expand_dims(positions, 1), ops.expand_dims(positions, 0)), 0)
    key_is_token = ops.expand_dims(ops.greater(segments, 0), 1)
    allowed = ops.cast(ops.logical_and(causal, key_is_token), "int32")
    return ops.minimum(allowed, same_example(segments))
