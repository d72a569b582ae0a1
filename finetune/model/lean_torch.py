"""keras-hub's Gemma on PyTorch with less host work per step: the same ops on the same tensors, bit for bit.

PyTorch runs a step eagerly, and every keras op and layer call is host work in Python before its kernel is
queued; on a GPU, PyTorch's step was host-bound at every family's width (12.6 ms per decoder layer on an H200,
BENCHMARKS.md). JAX and TensorFlow trace a step once, where none of this costs anything, so all of it is
PyTorch's alone, and on only where keras_compat.lean_torch_ops is (off under the bench's `stock` lever).

- Rotary embeddings: a RotaryEmbedding layer keeps keras-hub's own cos and sin tables, made by its own method
  the first time a shape comes (rows of that length, from position 0: training, scoring, a prompt's prefill),
  and rotates with 4 torch ops, where keras-hub makes the tables again at every call (about 25 keras ops).
  Anything else (positions given, a later start: each generated token) goes to keras-hub's call. The tables
  depend on no weight: made outside autograd, they serve every later step and the backward. Gemma 1 and 2 lay
  the rotated halves out pairwise with torch's stack and reshape.
- Gemma 1, 2 and 3 decoder blocks and their attention: keras-hub's `call`, line for line, for a pass without
  a cache, with each sublayer's own `call` called directly where keras' Layer.__call__ would only have called it
  (keras_compat.calls_directly): built, not quantized, its input already in its dtype, no mask to carry, no
  hook or regularizer; in keras' autocast scope where its policy is mixed (LoRA's factors); the training flag
  passed as keras passes it. keras' __call__ costs about 75 us a layer on a CPU, against 37 for an
  EinsumDense's own call; a block calls 10 of them. The glue between (the residual sums, gelu, the wipe of
  queries that attend to nothing) is the same torch ops keras' wrappers call.
- RMS norms (Gemma 1 to 4's and 3n's, and Gemma 4's norm of the values) and plain projections (an EinsumDense
  without LoRA, bias or activation, not quantized): the torch ops keras' op wrappers call, in their order.

- Every layer of the backbone (Gemma 4's and 3n's blocks and sublayers included, whose calls keras-hub's own code
  makes): keras' Layer.__call__ skipped where it would do nothing but call the layer's `call`
  (keras_compat._direct_layer_calls, for the layers marked `direct_call` here).

A quantized layer, and a layer whose call is another hook's already, is left as it is.
"""

from __future__ import annotations

import keras

from finetune.model import families
from finetune.platform import keras_compat

SHAPES_KEPT = 4  # rotary tables per layer: a run's row lengths; generation's later starts are not kept


def enable(backbone) -> int:
    """Give `backbone`'s rotary embeddings, and its Gemma 1, 2 and 3 blocks and attention layers, the lean path, and
    every layer direct calls; returns how many layers took a lean call (once each). Nothing on JAX or TensorFlow,
    or with lean ops off."""
    if keras.config.backend() != "torch" or not keras_compat.lean_torch_ops_on():
        return 0
    rotary = keras_compat.rotary_embedding_class()
    gemma, gemma3 = keras_compat.gemma_attention_class(), keras_compat.gemma3_attention_class()
    blocks = (keras_compat.gemma_decoder_block_class(), keras_compat.gemma3_decoder_block_class())
    norms, dense = keras_compat.gemma_rms_normalization_classes(), keras.layers.EinsumDense
    gemma4_norms = keras_compat.gemma4_normalization_classes()
    gemma3n_norm = keras_compat.gemma3n_normalization_class()
    done = 0
    for layer in backbone._flatten_layers(include_self=True):
        layer.direct_call = True  # keras' Layer.__call__ skipped where it would only call `call` (keras_compat)
    for layer in backbone._flatten_layers(include_self=False):
        if not _own_call(layer) or getattr(layer, "quantization_mode", None) is not None:
            continue  # done already, another hook's call (remat's), or a quantized call (quantized.py's)
        if type(layer) is rotary:
            keras_compat.replace_call(layer, _kept_tables(layer))
        elif type(layer) in (gemma, gemma3):
            layer._apply_rope = _interleaved(layer) if type(layer) is gemma else _rope_directly(layer)
            keras_compat.replace_call(layer, _lean_attention(layer))
        elif type(layer) in blocks:
            keras_compat.replace_call(layer, _lean_block(layer))
        elif type(layer) in norms:
            keras_compat.replace_call(layer, _lean_norm(layer))
        elif type(layer) in gemma4_norms:
            keras_compat.replace_call(layer, _lean_gemma4_norm(layer, scaled=type(layer) is gemma4_norms[0]))
        elif gemma3n_norm is not None and type(layer) is gemma3n_norm:
            keras_compat.replace_call(layer, _lean_gemma3n_norm(layer))
        elif type(layer) is dense:
            keras_compat.replace_call(layer, _lean_einsum_dense(layer))
            layer.lora_in_torch = True  # its LoRA call, once enabled (builder.beside_the_kernel), in torch ops
        else:
            continue
        done += 1
    return done


def _own_call(layer) -> bool:
    """Whether `layer` computes with its class's own call (what this module mirrors)."""
    return getattr(layer.call, "__func__", None) is type(layer).call


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
            # keras-hub's own tables, outside autograd; plain tensors even when made under inference mode, so that
            # a later training step can save them for its backward
            with torch.inference_mode(False), torch.no_grad():
                kept = layer._compute_cos_sin_embedding(inputs, 0, None)
            if len(tables) < SHAPES_KEPT:
                tables[key] = kept
        cos, sin = kept
        if inputs.dtype != cos.dtype:  # keras would promote: left to it
            return own(inputs, start_index=start_index, positions=positions)
        first, second = torch.chunk(inputs, 2, dim=-1)  # keras-hub's _apply_rotary_pos_emb, in torch
        return inputs * cos + torch.cat((-second, first), dim=-1) * sin

    return call


def _interleaved(layer):
    """CachedGemmaAttention._apply_rope: the rotation, then the halves laid out pairwise (x0, x_h, x1, x_h+1...),
    as keras-hub's split, stack and reshape lay them."""
    import torch

    own = layer._apply_rope

    def apply_rope(x, start_index, positions=None):
        if positions is not None or not _plain(x) or x.shape[-1] % 2:
            return own(x, start_index, positions=positions)
        x = _sublayer(layer.rope_layer, x, None, start_index=start_index)
        return torch.stack(torch.chunk(x, 2, dim=-1), dim=-1).reshape(x.shape)

    return apply_rope


def _training():
    """The training flag keras' Layer.__call__ would hand a sublayer: the enclosing call's."""
    return keras_compat.current_call_value("training")


def _sublayer(layer, x, training, **kwargs):
    """`layer(x, **kwargs)` as keras' Layer.__call__ runs it, with its own call directly where that is all
    __call__ would do (keras_compat.calls_directly)."""
    if not keras_compat.calls_directly(layer, x):
        return layer(x, **kwargs)
    if training is not None and layer._call_has_context_arg.get("training", False):
        kwargs["training"] = training
    with keras_compat.reading_variables_as_computed(layer):
        return layer.call(x, **kwargs)


def _lean_block(block):
    """keras-hub's Gemma 1/2 (GemmaDecoderBlock) or Gemma 3 (Gemma3DecoderBlock) block call for a pass without a
    cache (keras-hub 0.32), sublayers called directly. Gemma 3's float16 clipping stays keras-hub's."""
    own = block.call
    if type(block) is keras_compat.gemma_decoder_block_class():

        def call(x, padding_mask=None, cache=None, cache_update_index=0):
            if cache is not None or not _plain(x) or block.dropout:
                return own(x, padding_mask=padding_mask, cache=cache, cache_update_index=cache_update_index)
            if _compiled_here(block, x):
                mask = block._compute_attention_mask(x, padding_mask, cache, cache_update_index)
                return _compiled_pass()(block, x, mask)
            return _block_pass(block, x, lambda normalized: block._compute_attention_mask(
                normalized, padding_mask, cache, cache_update_index))  # fmt: skip
    else:

        def call(x, padding_mask=None, vision_mask=None, cache=None, cache_update_index=0, cache_update_mask=None):
            if cache is not None or not _plain(x) or block.dropout or x.dtype == _float16():
                return own(x, padding_mask=padding_mask, vision_mask=vision_mask, cache=cache,
                           cache_update_index=cache_update_index, cache_update_mask=cache_update_mask)  # fmt: skip
            if _compiled_here(block, x):
                mask = block._compute_attention_mask(x, padding_mask, vision_mask, cache, cache_update_index)
                return _compiled_pass()(block, x, mask)
            return _block_pass(block, x, lambda normalized: block._compute_attention_mask(
                normalized, padding_mask, vision_mask, cache, cache_update_index))  # fmt: skip

    call.lean = True
    return call


def compile_blocks(backbone) -> int:
    """Compile each decoder block's pass with torch.compile (the bench's `compile` lever on PyTorch), and return
    how many blocks took it; 0 on JAX and TensorFlow, or without lean ops (the `stock` lever).

    Regional compilation: a block's pass is one graph, so keras' per-op host work and the eager step's kernel
    launches go for every op of the block, forward and backward. Gemma 1, 2 and 3: the lean block's pass after
    its attention mask (made eagerly, as before, and shared by the blocks). Gemma 4: keras-hub's own call of the
    block, its mask inside. The pass is the same function for every block, traced once for each (its sublayers
    are other objects), grad mode and shape; the generated kernels are reused, so a deeper model traces more but
    compiles no more. keras' whole-step compile (jit_compile) had not finished compiling gemma-2b's step in 150 s
    on an H200 (BENCHMARKS.md). A block with dropout, a cache (generation) or a float16 Gemma 3 input takes the
    eager path, as before; Gemma 3n's blocks (given a tuple) and a remat block stay eager."""
    import torch

    if keras.config.backend() != "torch" or not keras_compat.lean_torch_ops_on():
        return 0
    lean = (keras_compat.gemma_decoder_block_class(), keras_compat.gemma3_decoder_block_class())
    own = keras_compat.gemma4_decoder_block_class()  # Gemma 3n's blocks take a tuple: left eager
    blocks = [block for block in families.decoder_blocks(backbone)
              if (type(block) in lean and getattr(block.call, "lean", False))
              or (own is not None and type(block) is own and _own_call(block))]  # fmt: skip
    if not blocks:
        return 0
    keras_compat.prepare_direct_calls(backbone._flatten_layers(include_self=True))
    config = torch._dynamo.config
    # one trace per block, per grad mode (training, evaluation) and per row shape (up to 8 lengths, eighths of
    # seq_len: batching.length_step, and the last batches' rows), where torch's default keeps 8 in all
    config.recompile_limit = max(config.recompile_limit, 32 * len(blocks))
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 64 * len(blocks))
    for block in blocks:
        if type(block) in lean:
            block.__dict__["compiled_pass"] = True  # keras' __setattr__ would track it
        else:  # Gemma 4's: keras-hub's own call, compiled where no cache is given
            keras_compat.replace_call(block, _compiled_own_call(block))
    return len(blocks)


def _compiled_own_call(block):
    """keras-hub's call of `block` (Gemma 4), compiled for a pass without a cache: each keyword argument a
    tensor, None or a structure of them (Gemma 4's shared keys and values); generation's passes, with a cache, run
    as they were."""
    own = block.call

    def call(x, *args, **kwargs):
        if args or kwargs.get("cache") is not None or not _plain(x) or getattr(x, "_keras_mask", None) is not None:
            return own(x, *args, **kwargs)
        return _compiled_pass(_own_pass)(own, x, kwargs)

    call.compiled = True
    return call


def _own_pass(call, x, kwargs):
    return call(x, **kwargs)


def _compiled_here(block, x) -> bool:
    """Whether `block` takes its compiled pass on `x`: compiled (compile_blocks), and x carries no keras mask, so
    that its mask made from x is the one keras-hub makes from its normalized x (they differ in values alone)."""
    return block.__dict__.get("compiled_pass", False) and getattr(x, "_keras_mask", None) is None


_COMPILED: dict = {}


def _compiled_pass(function=None):
    """`function` (the lean blocks' _mask_given_pass) compiled, once a process."""
    function = function or _mask_given_pass
    if function not in _COMPILED:
        import torch

        _COMPILED[function] = torch.compile(function, dynamic=False)
    return _COMPILED[function]


def _mask_given_pass(block, x, mask):
    return _block_pass(block, x, lambda normalized: mask)


def _float16():
    import torch

    return torch.float16


def _block_pass(block, x, attention_mask):
    """The block's pass after its mask method (`attention_mask(normalized x)`), as keras-hub's call runs it."""
    import torch

    training = _training()
    normalized = _sublayer(block.pre_attention_norm, x, training)
    mask = attention_mask(normalized)
    attention = _sublayer(block.attention, normalized, training, attention_mask=mask)
    if block.use_post_attention_norm:
        attention = _sublayer(block.post_attention_norm, attention, training)
    attention_x = x + attention
    normalized = _sublayer(block.pre_ffw_norm, attention_x, training)
    gate = _sublayer(block.gating_ffw, normalized, training)
    up = _sublayer(block.gating_ffw_2, normalized, training)
    hidden = _sublayer(block.ffw_linear, torch.nn.functional.gelu(gate, approximate="tanh") * up, training)
    if block.use_post_ffw_norm:
        hidden = _sublayer(block.post_ffw_norm, hidden, training)
    return hidden + attention_x


def _lean_attention(layer):
    """keras-hub's Gemma 1/2 (CachedGemmaAttention) or Gemma 3 (CachedGemma3Attention) attention call for a pass
    without a cache (keras-hub 0.32): query and key norms (Gemma 3), rope, the attention, the wipe of queries
    that attend to nothing, sublayers called directly."""
    own = layer.call
    if type(layer) is keras_compat.gemma_attention_class():

        def call(x, attention_mask=None, cache=None, cache_update_index=0, training=False):
            if cache is not None or not _plain(x) or not _plain(attention_mask) or keras_compat.serving_with_vllm():
                return own(x, attention_mask=attention_mask, cache=cache, cache_update_index=cache_update_index,
                           training=training)  # fmt: skip
            return _attention_pass(layer, x, attention_mask, cache_update_index, training)
    else:

        def call(x, attention_mask=None, cache=None, cache_update_index=0, cache_update_mask=None, training=False):
            if cache is not None or not _plain(x) or not _plain(attention_mask) or keras_compat.serving_with_vllm():
                return own(x, attention_mask=attention_mask, cache=cache, cache_update_index=cache_update_index,
                           cache_update_mask=cache_update_mask, training=training)  # fmt: skip
            return _attention_pass(layer, x, attention_mask, cache_update_index, training)

    call.lean = True
    return call


def _attention_pass(layer, x, attention_mask, cache_update_index, training):
    import torch

    sublayer_training = _training()
    normed = getattr(layer, "use_query_key_norm", False)
    query = _sublayer(layer.query_dense, x, sublayer_training)
    if normed:
        query = _sublayer(layer.query_norm, query, sublayer_training)
    query = layer._apply_rope(query, cache_update_index)
    key = _sublayer(layer.key_dense, x, sublayer_training)
    if normed:
        key = _sublayer(layer.key_norm, key, sublayer_training)
    key = layer._apply_rope(key, cache_update_index)
    value = _sublayer(layer.value_dense, x, sublayer_training)
    vector = layer._compute_attention(query, key, value, attention_mask, training=training,
                                      cache_update_index=cache_update_index)  # fmt: skip
    attends_to_nothing = torch.all(torch.eq(attention_mask, 0), dim=-1, keepdim=True)[..., None]
    vector = torch.where(attends_to_nothing, torch.zeros_like(vector), vector)
    return _sublayer(layer.output_dense, vector, sublayer_training)


def _rope_directly(layer):
    """CachedGemma3Attention._apply_rope: its rotary layer, called directly."""
    own = layer._apply_rope

    def apply_rope(x, start_index):
        if not _plain(x):
            return own(x, start_index)
        return _sublayer(layer.rope_layer, x, None, start_index=start_index)

    return apply_rope


def _lean_norm(layer):
    """keras-hub's Gemma and Gemma 3 RMSNormalization.call (the same code), in the torch ops keras' wrappers
    call: in float32, x / sqrt(mean(x^2) + eps) * (1 + scale), cast to the compute dtype."""
    import torch

    own = layer.call

    def call(x):
        if not _plain(x):
            return own(x)
        x = x.to(torch.float32)
        scale = layer.scale.value.to(torch.float32)  # the variable as keras reads it (in an autocast scope, cast)
        variance = torch.mean(torch.square(x), [-1], True)
        normed = x * torch.reciprocal(torch.sqrt(variance + layer.epsilon))
        return (normed * (1 + scale)).to(keras_compat.torch_dtype(layer.compute_dtype))

    return call


def _lean_gemma4_norm(layer, scaled: bool):
    """keras-hub's Gemma 4 RMSNormalization.call (`scaled`) and Gemma4VNorm.call, in the torch ops keras' wrappers
    call: in float32, x * (mean(x^2) + eps) ** -0.5, times the scale, cast to the compute dtype. The exponent is
    the 0-d float32 tensor keras' power makes of -0.5, made once a device: torch's pow of a tensor exponent, as
    keras calls it (not its scalar path)."""
    import torch

    own = layer.call
    exponents: dict = {}

    def call(x):
        if not _plain(x) or not keras_compat.on_keras_device(x):
            return own(x)
        exponent = exponents.get(x.device)
        if exponent is None:
            with torch.inference_mode(False), torch.no_grad():
                exponent = exponents[x.device] = keras.ops.convert_to_tensor(-0.5)
        x = x.to(torch.float32)
        variance = torch.mean(torch.square(x), (-1,), True)
        normed = x * torch.pow(variance + layer.epsilon, exponent)
        if scaled:
            normed = normed * layer.scale.value.to(torch.float32)  # the variable as keras reads it
        return normed.to(keras_compat.torch_dtype(layer.compute_dtype))

    return call


def _lean_gemma3n_norm(layer):
    """keras-hub's Gemma3nRMSNorm.call in the torch ops keras' wrappers call: x * rsqrt(mean(x^2) + eps) in x's
    dtype, its mean taken in float32 and cast back as keras' mean does, times the scale (the variable as keras
    reads it) or 1.0."""
    import torch

    own = layer.call
    floats = (torch.float32, torch.bfloat16, torch.float16)

    def call(x):
        if not _plain(x) or x.dtype not in floats or not keras_compat.on_keras_device(x):
            return own(x)
        square = torch.square(x)
        mean = torch.mean(square.to(torch.float32), (-1,), True).to(x.dtype)
        normed = x * torch.rsqrt(mean + layer.eps)
        return normed * (layer.scale.value if layer.with_scale else layer.scale)

    return call


def _lean_einsum_dense(layer):
    """keras' EinsumDense.call for a float kernel without LoRA, bias or activation: torch.einsum of the input
    and the kernel as keras' einsum converts them. Anything else (LoRA, a quantized kernel, a bias) goes to the
    layer's own call; where LoRA or quantization gave the layer a call of ours, it is not this layer's own call,
    and enable leaves it."""
    import torch

    own = layer.call

    def call(inputs, training=None):
        if (
            not _plain(inputs)
            or getattr(layer, "lora_enabled", False)
            or getattr(layer, "quantization_mode", None) is not None
            or layer.bias is not None
            or layer.activation is not None
        ):
            return own(inputs, training=training)
        kernel = keras.ops.convert_to_tensor(layer.kernel)
        if inputs.dtype == kernel.dtype == torch.int8:
            return own(inputs, training=training)
        return torch.einsum(layer.equation, inputs, kernel)

    return call
