"""Every keras and keras-hub internal finetune touches, in one place: private imports and patches.

Written against keras 3.15.1 and keras-hub 0.32.0 (WRITTEN_AGAINST). Each entry says what public API lacks and
what was measured; tests/test_keras_compat.py checks each against the installed versions, so an upgrade that
moves or changes one fails there, by name, not deep inside a run. Modules elsewhere decide *what* to compute
(the lean projection, segment masks, remat, quantized loading); they reach keras' insides only through here.

No keras import at module level: backend.py, below everything, uses this before the backend is chosen.
"""

from __future__ import annotations

import contextlib
import math
import sys

WRITTEN_AGAINST = {"keras": "3.15.1", "keras-hub": "0.32.0"}


# === Private modules ===


def h5_store(path, mode: str = "r"):
    """keras' own H5 weights store (keras.src.saving.saving_lib.H5IOStore).

    keras-hub's load_lora_weights reads a .lora.h5 without checks (a damaged file ends in a raw OSError, NaN
    weights load silently); adapter.read_factors checks it first, through the store that wrote it, so that
    the file's layout stays keras' business. keras has no public reader for it.
    """
    from keras.src.saving.saving_lib import H5IOStore

    return H5IOStore(path, mode=mode)


def preset_loader(handle: str):
    """keras-hub's loader of a preset (keras_hub.src.utils.preset_utils.get_preset_loader).

    from_preset builds every encoder a multimodal preset names, and quantizes only after loading the float
    weights: model._from_preset edits the loader's config to leave the encoders out, and loads the weights
    into a base quantized as it reads them (load_backbone_weights).
    """
    from keras_hub.src.utils.preset_utils import get_preset_loader

    return get_preset_loader(handle)


def load_backbone_weights(loader, backbone) -> None:
    """The loader's own weight reading (one file, or its shards), into a backbone built without weights."""
    loader._load_backbone_weights(backbone)


def preset_config(handle: str) -> dict:
    """A hub preset's config.json (preset_utils.load_json), read without building anything: the plan and the
    mesh need its dims before the weights download."""
    from keras_hub.src.utils.preset_utils import load_json

    return load_json(handle)


def transformers_exporter():
    """keras-hub's transformers exporter (keras_hub.src.utils.transformers.export.hf_exporter), for Gemma 3 and 4:
    CausalLM.export_to_transformers writes the task as it is, and finetune writes a merged backbone."""
    from keras_hub.src.utils.transformers.export import hf_exporter

    return hf_exporter


def transformers_gemma_exporter():
    """keras-hub's Gemma 1 mapping to transformers (keras_hub.src.utils.transformers.export.gemma): its config
    and weight names, which export._gemma_transformers completes with every key/value head."""
    from keras_hub.src.utils.transformers.export import gemma

    return gemma


# === Patches of keras classes ===


def keep_float16_matmuls() -> bool:
    """Keras' PyTorch matmul computes float16 in float32 on a CPU; make it multiply float16 as PyTorch can.

    keras (3.15) casts both operands to float32 first, from the days when
    PyTorch had no float16 matmul on a CPU: at gemma-2b's size the loss's
    projection onto the tied 256k x 2048 embedding then made a 2 GiB float32
    copy of it, in each chunk forward and backward, and a step peaked at 10.2
    GiB against 6.9 with a bf16 base. PyTorch 2 multiplies float16 on a CPU
    natively (313 GFLOP/s against 258 in float32 on 2 cores with AVX512-FP16).
    Returns whether Keras' function was replaced (once per process).
    """
    import torch
    from keras.src.backend.torch import numpy as torch_numpy

    original = torch_numpy.matmul
    if getattr(original, "keeps_float16", False):
        return False

    def matmul(x1, x2):
        x1, x2 = torch_numpy.convert_to_tensor(x1), torch_numpy.convert_to_tensor(x2)
        if x1.dtype == x2.dtype == torch.float16 and x1.device.type == "cpu":
            return torch.matmul(x1, x2)
        return original(x1, x2)

    matmul.keeps_float16 = True
    torch_numpy.matmul = matmul
    return True


def numbers_filled_on_the_device() -> bool:
    """Keras' PyTorch convert_to_tensor makes a Python number a tensor on the device by copying it from the host;
    make it fill the tensor there instead.

    keras (3.15) calls torch.as_tensor(x, device=...), which builds the number on the host and copies it over:
    on a GPU, a copy from pageable memory that then waits for the stream, every kernel queued before it
    included. keras and keras-hub turn a Python number into a tensor about 17 times per decoder layer in a
    training step (rope's constants, the attention's scale, the masks' fill values, LoRA's scale, softmax's
    where), so the host waited on the GPU some 320 times in each gemma-2b step, and the host's work and the
    GPU's never overlapped (PyTorch at 12.6 ms per layer on an H200, BENCHMARKS.md). torch.full makes the same
    tensor with a fill kernel: no copy, no wait. Python numbers only, with keras' own dtype rule
    (_number_dtype); arrays still copy, and on a CPU keras' function runs as it was. Every binding of keras'
    function in keras' modules is replaced. Returns whether it was replaced (once per process).
    """
    from keras.src.backend.torch import core

    original = core.convert_to_tensor
    if getattr(original, "fills_numbers", False):
        return False

    def convert_to_tensor(x, dtype=None, sparse=None, ragged=None):
        if isinstance(x, (bool, int, float)) and not sparse and not ragged:
            device = core.get_device()
            if not str(device).startswith("cpu"):
                filled = filled_number(x, dtype, device)
                if filled is not None:
                    return filled
        return original(x, dtype=dtype, sparse=sparse, ragged=ragged)

    convert_to_tensor.fills_numbers = True
    for name, module in list(sys.modules.items()):
        if name.startswith("keras") and getattr(module, "convert_to_tensor", None) is original:
            module.convert_to_tensor = convert_to_tensor
    return True


def filled_number(x, dtype, device):
    """The Python number `x` as keras' PyTorch convert_to_tensor makes it (its dtype rule), filled on `device`; None
    where a fill could differ from keras' copy (a float into an integer dtype, an integer out of its range)."""
    import torch
    from keras.src.backend.torch import core

    if dtype is not None:
        torch_dtype = core.to_torch_dtype(dtype)
    elif isinstance(x, bool):
        torch_dtype = torch.bool
    elif isinstance(x, int):
        torch_dtype = torch.int64 if x < -(2**31) or x >= 2**31 else torch.int32
    else:
        torch_dtype = core.to_torch_dtype(core.floatx())
    if isinstance(x, float) and not (torch_dtype.is_floating_point or torch_dtype.is_complex):
        return None
    try:
        return torch.full((), x, dtype=torch_dtype, device=device)
    except RuntimeError:  # an integer out of the dtype's range, which keras' copy wraps: left to keras
        return None


def set_seed_leaving_tensorflow_alone(seed: int) -> None:
    """keras.utils.set_random_seed, leaving TensorFlow's own seed alone on the other backends.

    Setting TensorFlow's seed clears its kernel caches, and tensorflow-text
    (2.21.1) keeps each SentencePiece model in a kernel-owned resource: every
    tokenizer made before then fails with NotFoundError. On JAX and PyTorch,
    TensorFlow only tokenizes, and finetune draws no TensorFlow random numbers.
    keras' function takes no option to skip it, so tf.random.set_seed is stood
    aside while it runs.
    """
    import keras

    if keras.config.backend() == "tensorflow" or sys.modules.get("tensorflow") is None:
        keras.utils.set_random_seed(seed)
        return
    import tensorflow as tf

    original = tf.random.set_seed
    tf.random.set_seed = lambda _: None
    try:
        keras.utils.set_random_seed(seed)
    finally:
        tf.random.set_seed = original


FULL_COLLECTION_FIRST = True
"""Whether collections_of_new_objects_only starts with a full collection: it frees the garbage of what came
before (a notebook's previous model and its device buffers) before the build loads the next. It walks every
object of the process: in a test worker that has built hundreds of models on TensorFlow, 14 s a build. The test
suite turns it off (tests/conftest.py); what came before is then collected by Python's own collections."""


@contextlib.contextmanager
def collections_of_new_objects_only():
    """Within it, the garbage collections keras runs scan only the objects made inside it.

    keras' Layer.__delattr__ runs a full gc.collect() for every variable a layer
    deletes (keras/src/layers/layer.py, to free device buffers early), and a
    quantized build deletes each float kernel it replaces. A full collection
    walks every object of the process, millions once TensorFlow is imported:
    a tiny int4 Gemma took 5.0 s to build on TensorFlow, 0.29 s with the
    objects that exist before the build frozen (gc.freeze), so that each
    collection walks only what the build made. Unfrozen on the way out.
    """
    import gc

    if FULL_COLLECTION_FIRST:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def large_variables_start_as_zeros(at_least: int):
    """Variables made inside start as zeros where they are float and hold `at_least` values or more.

    keras draws each variable's initial values first (Variable._initialize_with_initializer), and the draw
    costs memory the weights never needed when a preset's weights replace them next: on TensorFlow a
    (256,000 x 2,048) float16 embedding drawn by keras' RandomNormal raised the process's resident memory by
    3.1 GB for good (a float32 draw, then a cast, in memory TensorFlow keeps), where zeros raise it by the 1.0
    GB the variable holds. keras has no public way to choose a layer's initializers from outside it.
    """
    import keras

    cls = keras.Variable
    own = cls.__dict__.get("_initialize_with_initializer")
    original = cls._initialize_with_initializer

    def initialize(variable, initializer):
        dtype = keras.backend.standardize_dtype(variable._dtype)
        if "float" in dtype and math.prod(variable._shape) >= at_least:
            initializer = keras.initializers.Zeros()
        original(variable, initializer)

    cls._initialize_with_initializer = initialize
    try:
        yield
    finally:
        if own is None:
            del cls._initialize_with_initializer
        else:
            cls._initialize_with_initializer = own


# === Patches of keras and keras-hub instances ===
#
# Each replaces one method of one layer object (never its class), so another model in the process is untouched.


def replace_call(layer, call, takes_training: bool = False) -> None:
    """Make `layer` compute with `call`: its `call`, and on a quantized layer the `quantized_call` that keras'
    Layer.__call__ runs instead. Used by the lean projection (model.lean_call) and remat (remat.enable): keras
    takes no custom call from outside a layer's class.

    takes_training: bool. Pass `call` the training flag, though the layer's own call takes none (the token
        embedding's, for NEFTune): keras reads which context arguments a call takes once, in Layer.__init__.
    """
    layer.call = call
    if getattr(layer, "quantization_mode", None) is not None:
        layer.quantized_call = call
    if takes_training:
        layer._call_has_context_arg["training"] = True
        layer._call_has_training_arg = True


@contextlib.contextmanager
def calling(layer, training):
    """Run what follows as inside `layer`'s call, for the layers it calls: with keras' call context, whose
    `training` flag a layer called without one reads.

    keras-hub's decoder blocks pass no `training` to their layers; Layer.__call__ keeps it in a call context
    (global_state's current_call_ctx, per thread) from which they read it. remat's recomputation of a block
    runs in the backward, outside every call (on PyTorch, in autograd's thread), where its layers would read
    none and LoRA dropout would drop nothing. Inside a call already, that call's context stays. keras has no
    public way to enter one.
    """
    from keras.src.backend.common import global_state
    from keras.src.layers.layer import CallContext

    if global_state.get_global_attribute("current_call_ctx") is not None:
        yield
        return
    context = CallContext(entry_layer=layer)
    context.set_value("training", training)
    global_state.set_global_attribute("current_call_ctx", context)
    try:
        yield
    finally:
        global_state.set_global_attribute("current_call_ctx", None)


@contextlib.contextmanager
def adding_variables(layer):
    """Let a built `layer` take new variables and seed generators (DoRA's magnitude, LoRA dropout's count of
    training passes, NEFTune's seed), as keras' own enable_lora does: a built layer's tracker is locked against
    new state."""
    layer._tracker.unlock()
    try:
        yield layer
    finally:
        layer._tracker.lock()


def learning_rate_ratio(optimizer, chosen, ratio: float) -> None:
    """Make `optimizer` step the variables that `chosen(variable)` picks at `ratio` times its learning rate, their
    weight decay (learning rate times decay, in AdamW) included: LoRA+'s two learning rates in one optimizer.

    Scaling their gradients instead is not the same for Adam, which divides each step by the gradient's own
    size. Keras' optimizers take one learning rate; each backend steps a list of variables in
    `_backend_update_step` (PyTorch's all at once) and decays them in `_apply_weight_decay`, so the picked
    variables are stepped and decayed in a second call of each.
    """
    update, decay = optimizer._backend_update_step, optimizer._apply_weight_decay

    def update_step(grads, variables, learning_rate):
        picked = [chosen(v) for v in variables]
        for wanted, rate in ((False, learning_rate), (True, learning_rate * ratio)):
            pairs = [(g, v) for g, v, p in zip(grads, variables, picked) if p == wanted]
            if pairs:
                update([g for g, _ in pairs], [v for _, v in pairs], rate)

    def weight_decay(variables):
        decay([v for v in variables if not chosen(v)])
        own = optimizer.weight_decay
        optimizer.weight_decay = own * ratio if own else own  # keras decays by learning rate * weight_decay
        try:
            decay([v for v in variables if chosen(v)])
        finally:
            optimizer.weight_decay = own

    optimizer._backend_update_step = update_step
    optimizer._apply_weight_decay = weight_decay


def replace_attention_mask(block, compute_attention_mask) -> None:
    """A keras-hub decoder block's `_compute_attention_mask`, which builds its causal and sliding-window mask
    from `padding_mask`: attention.enable gives it segment ids, so packed rows attend within their example."""
    block._compute_attention_mask = compute_attention_mask


def gemma_attention_class():
    """keras-hub's Gemma 1/2 attention layer class (keras_hub.src.models.gemma.gemma_attention), which has no
    public name: attention.py recognises its layers to lay out one key head."""
    from keras_hub.src.models.gemma.gemma_attention import CachedGemmaAttention

    return CachedGemmaAttention


def replace_compute_attention(layer, compute_attention) -> None:
    """A keras-hub Gemma attention layer's `_compute_attention(q, k, v, attention_mask, training,
    cache_update_index)`, the scores and their weighted sum: attention.py lays them out for one key head."""
    layer._compute_attention = compute_attention


def widen_input_dtype(tensor, dtype: str) -> bool:
    """Declare a symbolic input tensor `dtype`; False where this keras has no such field (nothing changed).

    keras-hub declares Gemma 3n's padding mask boolean, and keras casts every input to its declared dtype,
    which would fold segment ids 2, 3... into 1; a symbolic tensor's dtype has no public setter.
    """
    if not hasattr(tensor, "_dtype"):
        return False
    tensor._dtype = dtype
    return True


def replace_loading(layer, load_own_variables) -> None:
    """What `layer` does with its entry of a weights file: keras' load_weights calls its `load_own_variables`.
    quantized.load_while_quantizing reads the float kernel and quantizes it as it loads, so the float base never
    exists whole in memory."""
    layer.load_own_variables = load_own_variables


def drop_inputs_quantizer(layer) -> None:
    """Quantize `layer`'s kernel only: keras' int8 layers also round their inputs to int8 (an `inputs_quantizer`,
    set by its dtype policy, with no option to leave it out); quantized.weights_only says what that costs."""
    layer.inputs_quantizer = None
