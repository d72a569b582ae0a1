"""Every keras and keras-hub internal finetune touches, in one place: private imports and patches.

Written against keras 3.15.1 and keras-hub 0.32.0 (WRITTEN_AGAINST). Each entry says what public API lacks and
what was measured; tests/test_keras_compat.py checks each against the installed versions, so an upgrade that
moves or changes one fails there, by name, not deep inside a run. Modules elsewhere decide *what* to compute
(the lean projection, segment masks, remat, quantized loading); they reach keras' insides only through here.

No keras import at module level: backend.py, below everything, uses this before the backend is chosen.
"""

from __future__ import annotations

import contextlib
import inspect
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


def gemma3n_clip_padding(backbone) -> None:
    """Gemma 3n's clip positions past a clip's end take the padding embedding, as transformers' Gemma3nModel gives
    them, so that a clip reads the same beside a longer one in its batch as alone.

    keras-hub's Gemma3nBackbone embeds every output of the audio encoder, the ones past a clip's end too, which
    the encoder zeroes (its mask is dropped): a clip padded to a longer clip's frames got the embedding of zeros
    in its tail soft tokens, where alone (or in transformers) it gets the padding embedding. The audio embedder's
    soft path now gives rows of zeros the padding embedding (the last of its vocabulary, which keras-hub's backbone
    and transformers' model both pad a clip's tokens with). Nothing where the backbone has no audio embedder.
    """
    embedder = getattr(backbone, "embed_audio", None)
    if embedder is None or getattr(embedder, "pads_clips", False) or not hasattr(embedder, "vocab_offset"):
        return
    import keras

    ops, own = keras.ops, embedder.call

    def call(inputs):
        embedded = own(inputs)
        if isinstance(inputs, list) or "int" in str(inputs.dtype):
            return embedded  # the hard path: token ids
        last = embedder.vocab_offset + embedder.embedding.input_dim - 1
        padding = ops.cast(own(ops.convert_to_tensor([[last]], dtype="int32")), embedded.dtype)
        past_the_end = ops.all(ops.equal(inputs, 0), axis=-1, keepdims=True)
        return ops.where(past_the_end, padding, embedded)

    embedder.call, embedder.pads_clips = call, True


def exact_tensorflow_adds() -> bool:
    """Keras' TensorFlow `add` puts a (B, 1) tensor beside a (B, N) one along the wrong axis when N == B; make it
    broadcast as NumPy does.

    keras (3.15) sends an `add` whose second operand squeezes to a vector to tf.nn.bias_add, as a bias along the
    first operand's last axis (or axis 1), whenever the vector's length matches that axis, without looking at which
    axis of its own the vector lies on. keras-hub's Gemma 3 places the pictures' embeddings at `vision_indices +
    row * seq_len`, a (B, tokens) plus (B, 1) add: at as many rows as image tokens a row (4 rows on the tiny vision
    preset: a batch of 2 preference pairs), every row's pictures went to the wrong positions. Where the bias' axis
    is the one broadcasting gives, keras' own path is kept. Returns whether Keras' function was replaced (once per
    process).
    """
    import tensorflow as tf
    from keras.src.backend.common import dtypes
    from keras.src.backend.tensorflow import numpy as tf_numpy

    original = tf_numpy.add
    if getattr(original, "broadcasts_exactly", False):
        return False

    def add(x1, x2):
        if isinstance(x1, (int, float)) or isinstance(x2, (int, float)):
            return original(x1, x2)
        x1, x2 = tf_numpy.convert_to_tensor(x1), tf_numpy.convert_to_tensor(x2)
        if not _misplaced_as_bias(x1.shape.as_list(), x2.shape.as_list()):
            return original(x1, x2)
        dtype = dtypes.result_type(x1.dtype, x2.dtype)
        return tf.add(tf_numpy.convert_to_tensor(x1, dtype), tf_numpy.convert_to_tensor(x2, dtype))

    add.broadcasts_exactly = True
    tf_numpy.add = add
    return True


def promoted_torch_einsums() -> bool:
    """Keras' PyTorch einsum hands operands of two float dtypes to torch.einsum, which refuses them; make it promote
    them first, as keras' JAX and TensorFlow einsums do (keras.ops' type promotion).

    keras-hub's Gemma 4 audio encoder (Gemma4AudioAttention, keras-hub 0.32) weighs float32 values by attention
    probabilities cast to the compute dtype: on PyTorch in bfloat16, the default on a GPU and on a CPU with bf16
    units, every run with audio stopped there ("expected scalar type BFloat16 but found Float"). Operands of one
    dtype take keras' own path. Returns whether Keras' function was replaced (once per process).
    """
    from keras.src.backend.common import dtypes
    from keras.src.backend.torch import numpy as torch_numpy

    original = torch_numpy.einsum
    if getattr(original, "promotes", False):
        return False

    def einsum(subscripts, *operands, **kwargs):
        operands = [torch_numpy.convert_to_tensor(x) for x in operands]
        found = {x.dtype for x in operands}
        if len(found) > 1 and all(d.is_floating_point for d in found):
            dtype = dtypes.result_type(*(torch_numpy.standardize_dtype(x.dtype) for x in operands))
            operands = [torch_numpy.cast(x, dtype) for x in operands]
        return original(subscripts, *operands, **kwargs)

    einsum.promotes = True
    torch_numpy.einsum = einsum
    return True


def _misplaced_as_bias(first: list, second: list) -> bool:
    """Whether keras' TensorFlow `add` takes `second` for a bias along an axis of `first` that broadcasting does not
    align it with (its condition for tf.nn.bias_add, then the axis broadcasting gives)."""
    kept = [(axis, size) for axis, size in enumerate(second) if size is None or size > 1]
    if len(kept) != 1 or len(first) < 2 or kept[0][1] is None or kept[0][1] not in (first[1], first[-1]):
        return False
    axis, size = kept[0]
    biased = len(first) - 1 if first[-1] == size else 1
    return len(first) - len(second) + axis != biased


def float16_matmuls_kept() -> bool:
    """Whether keras' PyTorch matmul multiplies float16 as float16 on a CPU (keep_float16_matmuls is in)."""
    from keras.src.backend.torch import numpy as torch_numpy

    return bool(getattr(torch_numpy.matmul, "keeps_float16", False))


def lean_torch_ops() -> bool:
    """Keras' per-op host work on PyTorch, trimmed where it computes nothing; the same tensors come out.

    A PyTorch step runs every keras op eagerly, in Python, and keras wraps each torch call in work of its own:
    the decoder layers' steps were host-bound on a GPU (PyTorch at 12.6 ms per decoder layer on an H200 at every
    family's width, BENCHMARKS.md). Three of keras' (3.15) helpers, called several times by every op:

    - convert_to_tensor: a tensor already on keras' device and in the dtype asked is returned as it is (keras
      reaches the same tensor through two `.to` calls, a global lookup and a device comparison); a Python number
      is filled on a GPU (filled_number), where keras copies it from the host and waits for the stream, every
      kernel queued before it included, some 320 times in a gemma-2b step. Under torch.compile, a numpy value
      with a dtype asked is converted as keras does, without the read of its dtype that the compiler cannot trace.
    - any_symbolic_tensors: a tensor, number, string or None is skipped at once, lists, tuples and dicts looked
      into the same way, where keras asks torch's pytree whether each argument is a container.
    - standardize_dtype: kept per dtype (a string, a numpy or a torch dtype); None (floatx, which can change)
      and Python types go to keras each time.

    Every binding of each function in keras' loaded modules is replaced; the bench's `stock` lever keeps keras'
    own (backend.apply_runtime_tweaks). lean_torch.enable reads lean_torch_ops_on for its part. Measured on a CPU,
    where gemma-2b's structure at tiny widths is host-bound: BENCHMARKS.md. Returns whether they were installed
    (once per process).
    """
    import numpy as np
    import torch
    from keras.src.backend.common import keras_tensor, variables
    from keras.src.backend.torch import core

    if lean_torch_ops_on():
        return False
    originals = {
        "convert_to_tensor": core.convert_to_tensor,
        "any_symbolic_tensors": keras_tensor.any_symbolic_tensors,
        "standardize_dtype": variables.standardize_dtype,
    }
    convert, symbolic, standardize = originals.values()
    tensors = (torch.Tensor, torch.nn.Parameter)
    numbers, compiling = (np.ndarray, np.floating), torch.compiler.is_compiling

    def convert_to_tensor(x, dtype=None, sparse=None, ragged=None):
        if type(x) in tensors and not sparse and not ragged:
            if (dtype is None or core.to_torch_dtype(dtype) == x.dtype) and _already_on(x.device, core.get_device()):
                return x  # the tensor itself, which keras' `.to` calls return
        elif isinstance(x, (bool, int, float)) and not sparse and not ragged:
            device = core.get_device()
            if not str(device).startswith("cpu"):
                filled = filled_number(x, dtype, device)
                if filled is not None:
                    return filled
        elif dtype is not None and isinstance(x, numbers) and compiling():
            # keras' path for a numpy value, torch.as_tensor(np.array(x), dtype), less its read of x.dtype, which
            # torch.compile cannot trace (keras-hub's attention casts a numpy scale: lean_torch.compile_blocks)
            return torch.as_tensor(x, dtype=core.to_torch_dtype(dtype), device=core.get_device())
        return convert(x, dtype=dtype, sparse=sparse, ragged=ragged)

    plain = (*tensors, int, float, bool, str, type(None))
    KerasTensor = keras_tensor.KerasTensor

    def holds_symbolic(x) -> bool:
        kind = type(x)
        if kind in plain:
            return False
        if kind in (list, tuple):
            return any(holds_symbolic(item) for item in x)
        if kind is dict:
            return any(holds_symbolic(item) for item in x.values())
        return symbolic((x,))  # keras' own look, for anything else

    def any_symbolic_tensors(args=None, kwargs=None):
        for items in (args or (), kwargs.values() if kwargs else ()):
            for x in items:
                if type(x) not in plain and (isinstance(x, KerasTensor) or holds_symbolic(x)):
                    return True
        return False

    kept: dict = {}

    def standardize_dtype(dtype):
        if isinstance(dtype, (str, np.dtype, torch.dtype)):
            key = (type(dtype), dtype)
            found = kept.get(key)
            if found is None:
                found = kept[key] = standardize(dtype)  # raises, and keeps nothing, for an unknown dtype
            return found
        return standardize(dtype)

    replacements = {"convert_to_tensor": convert_to_tensor, "any_symbolic_tensors": any_symbolic_tensors,
                    "standardize_dtype": standardize_dtype}  # fmt: skip
    for attribute, function in replacements.items():
        function.lean, function.keras_own = True, originals[attribute]
    for name, module in list(sys.modules.items()):
        if not name.startswith("keras"):
            continue
        for attribute, original in originals.items():
            if getattr(module, attribute, None) is original:
                setattr(module, attribute, replacements[attribute])
    _direct_layer_calls()
    return True


def _direct_layer_calls() -> None:
    """keras' Layer.__call__ (3.15), for a layer lean_torch.enable marked (`direct_call`), where it would do nothing
    but call the layer's `call` (_direct_call_taken): that call, at once. keras' __call__ costs about 75 us a layer
    on a CPU (binding the signature, converting arguments, masks, scopes), a decoder block calls a dozen, and
    Gemma 4's and 3n's blocks call their sublayers from keras-hub's own code, where lean_torch cannot call them
    directly. What keras does there is done the same way: the training flag (each call-context argument) resolved
    and kept in the context for the layers after (_resolve_context_arguments); the layer's name scope (a sublayer
    first built inside takes the same variable paths); the autocast scope (reading_variables_as_computed).
    Anything else, and every unmarked layer, goes to keras' own __call__."""
    from keras.src.layers.layer import Layer

    keras_call = Layer.__call__
    if getattr(keras_call, "lean", False):
        return

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and self.__dict__.get("direct_call"):
            x = _as_input(self, args[0])
            if _direct_call_taken(self, x, kwargs):
                _resolve_context_arguments(self, kwargs)
                with self._open_name_scope(), reading_variables_as_computed(self):
                    outputs = self.call(x, **kwargs)
                mask = kwargs.get("mask")
                if mask is not None:  # a mask given (a softmax's): on the outputs, as keras' _set_mask_metadata does
                    self._set_mask_metadata(x, outputs, mask)
                return outputs
        return keras_call(self, *args, **kwargs)

    __call__.lean, __call__.keras_own = True, keras_call
    Layer.__call__ = __call__


_MASKS_DEFAULT_TO_NONE: dict = {}  # per layer class: whether every mask argument of its call defaults to None
_NEEDS = None  # the modules the per-call functions below read, imported once (_needs): they run at every layer call


def _needs():
    """torch, keras' Layer, and the keras and torch modules calls_directly and the direct calls read, imported
    once: an import statement in a function costs a lookup at each call (about a microsecond), and these run
    thousands of times a step."""
    global _NEEDS
    if _NEEDS is None:
        import types

        import torch
        from keras.src import backend
        from keras.src.backend.common import global_state
        from keras.src.backend.torch import core
        from keras.src.dtype_policies import dtype_policy
        from keras.src.layers.layer import Layer
        from torch.nn.modules import module

        plain_policies = (dtype_policy.DTypePolicy, dtype_policy.FloatDTypePolicy)  # keras' own convert_input
        _NEEDS = types.SimpleNamespace(torch=torch, Layer=Layer, global_state=global_state, core=core,
                                       module=module, backend=backend, plain_policies=plain_policies)  # fmt: skip
    return _NEEDS


def _direct_call_taken(layer, x, kwargs: dict) -> bool:
    """Whether keras' Layer.__call__ of `layer` on `x` and `kwargs` would only call `layer.call`: calls_directly
    holds for `x`; every keyword argument is None, a Python scalar or string, or a torch tensor without a
    keras mask that keras would not convert (not floating, or in `x`'s dtype, the layer's input dtype); the layer
    computes no mask of its own (keras' `compute_mask`, or none supported), takes a mask only where it supports
    masks, and defaults no mask argument to other than None (keras passes the inputs' masks, None here, to those).
    keras' input spec check is skipped, as calls_directly says: a shape it would refuse fails in torch instead."""
    needs = _NEEDS or _needs()
    torch, layer_class = needs.torch, needs.Layer
    if not isinstance(x, torch.Tensor):
        return False
    for value in kwargs.values():
        if value is None or type(value) in (bool, int, float, str):
            continue
        if not isinstance(value, torch.Tensor) or getattr(value, "_keras_mask", None) is not None:
            return False
        if value.is_floating_point() and value.dtype != x.dtype:
            return False
    if not calls_directly(layer, x):
        return False
    if layer.supports_masking and type(layer).compute_mask is not layer_class.compute_mask:
        return False
    if not layer.supports_masking and kwargs.get("mask") is not None:
        return False  # keras warns that the mask is lost
    return _masks_default_to_none(layer)


def _masks_default_to_none(layer) -> bool:
    """Whether every mask argument of `layer`'s call defaults to None (or to nothing), once per class."""
    kind = type(layer)
    defaulted = _MASKS_DEFAULT_TO_NONE.get(kind)
    if defaulted is None:
        defaulted = _MASKS_DEFAULT_TO_NONE[kind] = all(
            default is None or default is _EMPTY
            for name, default in _call_parameters(layer).items()
            if name == "mask" or name.endswith("_mask")
        )
    return defaulted


_CALL_PARAMETERS: dict = {}  # per layer class: its call's parameters and their defaults (_call_parameters)
_EMPTY = inspect.Parameter.empty


def _call_parameters(layer) -> dict:
    """{name: default} of `layer`'s call signature (keras' `_call_signature`, made from the class's call in
    Layer.__init__), read once per class into a plain dict: the direct calls read it at every layer call, and
    torch.compile cannot trace a read of the signature's mapping after a dict changed (lean_torch.compile_blocks)."""
    kind = type(layer)
    found = _CALL_PARAMETERS.get(kind)
    if found is None:
        found = _CALL_PARAMETERS[kind] = {name: p.default for name, p in layer._call_signature.parameters.items()}
    return found


def prepare_direct_calls(layers) -> None:
    """What the direct calls of `layers` read once per class, read now: a compiled region that calls them then
    changes no dict of this module (lean_torch.compile_blocks)."""
    for layer in layers:
        _masks_default_to_none(layer)  # and _call_parameters


def _as_input(layer, x):
    """`x` as keras' Layer.__call__ (3.15, its step 1) hands it to `layer`'s call: a floating torch tensor in another
    floating dtype than the layer's input dtype, cast to it where the layer converts its inputs and autocasts
    (keras-hub's float32 softmax, given bfloat16 logits), by keras' own DTypePolicy; anything else as it is, for
    _direct_call_taken to judge."""
    needs = _NEEDS or _needs()
    if (
        not isinstance(x, needs.torch.Tensor)
        or not x.is_floating_point()
        or getattr(x, "_keras_mask", None) is not None
    ):
        return x
    if not (layer._convert_input_args and layer.autocast) or type(layer.dtype_policy) not in needs.plain_policies:
        return x
    dtype = needs.core.to_torch_dtype(layer.input_dtype)
    return x.to(dtype) if dtype.is_floating_point and x.dtype != dtype else x


def _resolve_context_arguments(layer, kwargs: dict) -> None:
    """keras' Layer.__call__ (3.15) steps for each call-context argument (`training`), on `kwargs` in place: the
    value given, else the enclosing call's, else the call signature's default; kept in the call context for the
    layers called after; passed where the call takes it and it is not None, dropped where the call's signature
    does not name it."""
    context = (_NEEDS or _needs()).global_state.get_global_attribute("current_call_ctx")
    parameters = _call_parameters(layer)
    for name in layer._call_context_args:
        if name in kwargs:
            value = kwargs[name] if name in parameters else kwargs.pop(name)
        else:
            value = context.get_value(name)
            if value is None and name in parameters:
                default = parameters[name]
                value = None if default is _EMPTY else default
        context.set_value(name, value)
        if value is not None and layer._call_has_context_arg.get(name, False):
            kwargs[name] = value


def lean_torch_ops_on() -> bool:
    """Whether lean_torch_ops installed its functions in this process."""
    from keras.src.backend.torch import core

    return getattr(core.convert_to_tensor, "lean", False)


def _already_on(device, target) -> bool:
    """Whether a tensor on `device` is on keras' device `target` (get_device's string): where keras' x.to(target)
    returns x itself. Kept per pair; a CUDA target without an index is the current device, read each time."""
    key = (device, target)
    found = _ON.get(key)
    if found is None:
        found = _ON[key] = _placed(device, target)
    if found == "current":
        import torch

        return device.index == torch.cuda.current_device()
    return found


_ON: dict = {}


def _placed(device, target):
    import torch

    target = torch.device(target) if isinstance(target, str) else target
    if target.index is not None:
        return device == target
    if device.type != target.type:
        return False
    if device.type == "cpu":
        return True
    return "current" if device.type == "cuda" else False


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


def rotary_embedding_class():
    """keras-hub's RotaryEmbedding (keras_hub.layers): lean_torch.py recognises its layers by their exact class, whose
    `_compute_cos_sin_embedding(inputs, start_index, positions)` it calls for the tables."""
    from keras_hub.src.layers.modeling.rotary_embedding import RotaryEmbedding

    return RotaryEmbedding


def gemma_decoder_block_class():
    """keras-hub's Gemma 1/2 decoder block class (keras_hub.src.models.gemma.gemma_decoder_block): lean_torch.py
    mirrors its call, so recognises its blocks by this exact class."""
    from keras_hub.src.models.gemma.gemma_decoder_block import GemmaDecoderBlock

    return GemmaDecoderBlock


def gemma3_decoder_block_class():
    """keras-hub's Gemma 3 decoder block class (keras_hub.src.models.gemma3.gemma3_decoder_block): as
    gemma_decoder_block_class."""
    from keras_hub.src.models.gemma3.gemma3_decoder_block import Gemma3DecoderBlock

    return Gemma3DecoderBlock


def gemma3_attention_class():
    """keras-hub's Gemma 3 attention layer class (keras_hub.src.models.gemma3.gemma3_attention): lean_torch.py
    mirrors its call."""
    from keras_hub.src.models.gemma3.gemma3_attention import CachedGemma3Attention

    return CachedGemma3Attention


def gemma_rms_normalization_classes() -> tuple:
    """keras-hub's Gemma (1/2) and Gemma 3 RMSNormalization classes, one code in two modules: lean_torch.py
    mirrors their call."""
    from keras_hub.src.models.gemma.rms_normalization import RMSNormalization
    from keras_hub.src.models.gemma3.gemma3_layers import RMSNormalization as Gemma3RMSNormalization

    return RMSNormalization, Gemma3RMSNormalization


def gemma4_normalization_classes() -> tuple:
    """keras-hub's Gemma 4 RMSNormalization (a scale) and Gemma4VNorm (none): lean_torch.py mirrors their call.
    Empty where keras-hub has no Gemma 4."""
    try:
        from keras_hub.src.models.gemma4.gemma4_layers import Gemma4VNorm, RMSNormalization
    except ImportError:
        return ()
    return RMSNormalization, Gemma4VNorm


def gemma4_decoder_block_class():
    """keras-hub's Gemma 4 text decoder block class (lean_torch.compile_blocks compiles its own call), or None where
    keras-hub has no Gemma 4."""
    try:
        from keras_hub.src.models.gemma4.gemma4_decoder_block import Gemma4TextDecoderBlock
    except ImportError:
        return None
    return Gemma4TextDecoderBlock


def gemma3n_normalization_class():
    """keras-hub's Gemma3nRMSNorm (lean_torch.py mirrors its call), or None where keras-hub has no Gemma 3n."""
    try:
        from keras_hub.src.models.gemma3n.rms_normalization import Gemma3nRMSNorm
    except ImportError:
        return None
    return Gemma3nRMSNorm


def serving_with_vllm() -> bool:
    """Whether keras-hub's Gemma attention would take its vLLM paged-attention route (serving on a TPU), which
    lean_torch.py leaves to keras-hub."""
    from keras_hub.src.vllm.context import get_vllm_context

    context = get_vllm_context()
    return context is not None and context.paged_attention_func is not None


def current_call_value(name: str):
    """The value of a call-context argument (`training`) in the layer call under way, as keras' Layer.__call__
    hands it to the layers called inside; None outside every call."""
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.get_value(name)


def calls_directly(layer, x) -> bool:
    """Whether keras' Layer.__call__ of the built `layer` on the one tensor `x`, inside another layer's call, would
    do nothing but call `layer.call`, in the autocast scope of reading_variables_as_computed (keras 3.15's
    __call__, step by step): `x` needs no conversion (it is in the layer's input dtype) and carries no mask; no
    autocast scope is open already; the layer is not quantized or rematerialised, has no activity regularizer and
    no torch hook; no distribution lays its output out; the call context exists already, another layer's
    (nothing to open or reset). The input spec check is skipped: a built layer has passed it on its first call.
    lean_torch.py calls `layer.call` where this holds; where it does not, `layer(x)` as keras does."""
    needs = _NEEDS or _needs()
    torch, global_state, core, module = needs.torch, needs.global_state, needs.core, needs.module
    return bool(
        layer.built
        and layer._called
        and getattr(layer, "quantization_mode", None) is None
        and not layer._remat_mode
        and layer.activity_regularizer is None
        and layer.input_dtype == layer.compute_dtype
        and isinstance(x, torch.Tensor)
        and x.dtype == core.to_torch_dtype(layer.input_dtype)
        and getattr(x, "_keras_mask", None) is None
        and getattr(global_state.get_global_attribute("current_call_ctx"), "entry_layer", layer) is not layer
        and global_state.get_global_attribute("distribution") is None
        and not (layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks
                 or layer._backward_pre_hooks)
        and not (module._global_forward_hooks or module._global_forward_pre_hooks or module._global_backward_hooks
                 or module._global_backward_pre_hooks)
    )  # fmt: skip


def reading_variables_as_computed(layer):
    """The autocast scope keras' Layer.__call__ (3.15) enters around `layer`'s call: with none open, its compute
    dtype's where its variables are stored in another (a mixed policy: LoRA's float32 factors, read in bfloat16);
    inside an outer layer's scope (a mixed model around the backbone), that one kept where it reads in the layer's
    compute dtype, else cleared or changed as keras does."""
    from keras.src import backend

    current, scope = backend.get_autocast_scope(), None
    if current is not None:  # an outer layer's: kept, cleared or changed, as keras' rule has it
        if not layer.autocast or not backend.is_float_dtype(layer.compute_dtype):
            scope = backend.AutocastScope(None)
        elif current.dtype != layer.compute_dtype:
            scope = backend.AutocastScope(layer.compute_dtype)
    elif layer.compute_dtype != layer.variable_dtype:
        scope = backend.AutocastScope(layer.compute_dtype)
    return scope or contextlib.nullcontext()


def torch_dtype(dtype):
    """The torch dtype of a keras dtype name, as keras' PyTorch backend maps it."""
    return (_NEEDS or _needs()).core.to_torch_dtype(dtype)


def on_keras_device(tensor) -> bool:
    """Whether a torch `tensor` lies on the device keras' PyTorch backend makes new tensors on."""
    return _already_on(tensor.device, (_NEEDS or _needs()).core.get_device())


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
