"""keras-hub's rotary embeddings on PyTorch, their cos and sin made once per shape: the same tensors, less host work.

keras-hub's RotaryEmbedding makes its cos and sin tables again at every call, from the positions up (about 25
keras ops), and Gemma 1 and 2 then lay the rotated halves out pairwise with 3 more: twice per decoder layer
(queries and keys) and step. On PyTorch each keras op is host work in Python, and a GPU step was host-bound
(BENCHMARKS.md): at gemma-2b's structure, the rotary embeddings were 18% of a step's host time on a CPU.

Here, on PyTorch only (JAX and TensorFlow trace a step once, where these cost nothing), with
keras_compat.lean_torch_ops on:

- A RotaryEmbedding layer keeps keras-hub's own cos and sin, made by its own method the first time a shape
  comes (rows of that length, from position 0: training, scoring and a prompt's prefill), and rotates with 4
  torch ops. Anything else (positions given, a later start: each generated token) goes to keras-hub's call.
- Gemma 1 and 2's attention interleaves the halves with torch's stack and reshape, past keras-hub's op wrappers.

The tables depend on no weight, so one made in a step serves every later step and the backward; they are made
outside autograd. Each layer keeps at most a few shapes (a run has one or two: its row length, and eval's).
"""

from __future__ import annotations

import keras

from finetune.platform import keras_compat

SHAPES_KEPT = 4  # per layer: a run's row lengths; generation's later starts are not kept


def enable(backbone) -> int:
    """Give every rotary embedding layer of `backbone` (and Gemma 1 and 2 attention layer) the lean path; returns
    how many layers took it. Nothing on JAX or TensorFlow, or where lean ops are off (the bench's stock lever)."""
    if keras.config.backend() != "torch" or not keras_compat.lean_torch_ops_on():
        return 0
    rotary, attention = keras_compat.rotary_embedding_class(), keras_compat.gemma_attention_class()
    done = 0
    for layer in backbone._flatten_layers(include_self=False):
        if type(layer) is rotary and not getattr(layer.call, "tables_kept", False):
            keras_compat.replace_call(layer, _kept_tables(layer))
            done += 1
        elif type(layer) is attention and not getattr(layer._apply_rope, "interleaved", False):
            layer._apply_rope = _interleaved(layer)
            done += 1
    return done


def _plain(x) -> bool:
    import torch

    return type(x) in (torch.Tensor, torch.nn.Parameter) and x.device.type != "meta"


def _kept_tables(layer):
    import torch

    own = layer.call
    tables: dict = {}

    def call(inputs, start_index=0, positions=None):
        if (
            positions is not None
            or type(start_index) is not int
            or start_index != 0
            or not _plain(inputs)
            or inputs.ndim < 2
            or inputs.shape[-1] % 2
            or not keras_compat.on_keras_device(inputs)
            or layer.sequence_axis != 1
            or layer.feature_axis not in (-1, inputs.ndim - 1)
        ):
            return own(inputs, start_index=start_index, positions=positions)
        key = (inputs.ndim, inputs.shape[1], inputs.shape[-1], inputs.device, layer.compute_dtype)
        kept = tables.get(key)
        if kept is None:
            with torch.no_grad():
                kept = layer._compute_cos_sin_embedding(inputs, 0, None)  # keras-hub's own tables
            if len(tables) < SHAPES_KEPT:
                tables[key] = kept
        cos, sin = kept
        if inputs.dtype != cos.dtype:  # keras would promote: left to it
            return own(inputs, start_index=start_index, positions=positions)
        first, second = torch.chunk(inputs, 2, dim=-1)  # keras-hub's _apply_rotary_pos_emb, in torch
        return inputs * cos + torch.cat((-second, first), dim=-1) * sin

    call.tables_kept = True
    return call


def _interleaved(layer):
    """CachedGemmaAttention._apply_rope: the rotation, then the halves laid out pairwise (x0, x_h, x1, x_h+1...),
    as keras-hub's split, stack and reshape lay them."""
    import torch

    own = layer._apply_rope

    def apply_rope(x, start_index, positions=None):
        if positions is not None or not _plain(x) or x.shape[-1] % 2:
            return own(x, start_index, positions=positions)
        rope = layer.rope_layer
        if (
            rope.built
            and getattr(rope.call, "tables_kept", False)
            and x.dtype == keras_compat.torch_dtype(rope.compute_dtype)
        ):
            x = rope.call(x, start_index=start_index)  # its __call__ would cast nothing: x is in its dtype
        else:
            x = rope(x, start_index=start_index)
        return torch.stack(torch.chunk(x, 2, dim=-1), dim=-1).reshape(x.shape)

    apply_rope.interleaved = True
    return apply_rope
