"""lean_torch.py: keras-hub's Gemma on PyTorch with less host work: the same tensors, bit for bit, forward and back."""

import keras
import numpy as np
import pytest
from conftest import BACKEND

from finetune.config import LoraConfig
from finetune.model import attention, builder, families, lean_torch, presets
from finetune.platform import keras_compat

torch_only = pytest.mark.skipif(BACKEND != "torch", reason="lean_torch.py is PyTorch's alone")


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
    took = lean_torch.enable(backbone)
    assert took >= len(families.decoder_blocks(backbone))  # a rotary layer (Gemma 1: and its attention) per block
    assert lean_torch.enable(backbone) == 0  # once
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
    lean_torch.enable(backbone)
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
    first = keras_compat.rotary_embedding_class()(max_wavelength=10_000.0)
    keras_compat.replace_call(first, lean_torch._kept_tables(first))
    with torch.inference_mode():
        first(x)  # its tables made under inference mode (a notebook's generation first)...
    trained = torch.randn(2, 8, 3, 16, requires_grad=True)
    first(trained).sum().backward()  # ...serve a pass that saves them for its backward
    assert torch.equal(trained.grad, torch.func.grad(lambda t: own_call(t).sum())(trained))
    keras_compat.replace_call(layer, lean_torch._kept_tables(layer))
    ours = [layer(x), layer(x, start_index=5), layer(x, positions=torch.arange(3, 11))]
    for a, b in zip(ours, own):
        assert torch.equal(a, b)
    tables = layer.call.__closure__[[c for c in layer.call.__code__.co_freevars].index("tables")].cell_contents
    assert len(tables) == 1  # row length 8 from position 0; the other two calls made theirs anew
    for length in range(9, 9 + 2 * lean_torch.SHAPES_KEPT):
        y = torch.randn(1, length, 2, 16)
        assert torch.equal(layer(y), own_call(y))
    assert len(tables) == lean_torch.SHAPES_KEPT


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
    assert lean_torch.enable(backbone) == 0


# Gemma 2's block at tiny widths: soft caps, the post norms, a sliding window shorter than the rows, 2 key heads.
TINY_GEMMA2 = dict(vocabulary_size=presets.tiny_vocabulary_size(), num_layers=2, num_query_heads=4,
                   num_key_value_heads=2, hidden_dim=32, intermediate_dim=64, head_dim=8, query_head_dim_normalize=False,
                   use_post_ffw_norm=True, use_post_attention_norm=True, attention_logit_soft_cap=50.0,
                   final_logit_soft_cap=30.0, use_sliding_window_attention=True, sliding_window_size=4,
                   tokenizer=str(presets.TINY_TOKENIZER))  # fmt: skip


def _source(arch):
    if arch in presets.TINY:
        return presets.resolve(arch)
    return presets.Source("random", "tiny-gemma2", "gemma", random=TINY_GEMMA2)


def _forward_and_back(lm, inputs):
    """The backbone's output and every LoRA factor's gradient, under training as a step runs it."""
    import torch

    factors = [w for w in lm.backbone.trainable_weights]
    for w in factors:
        w.value.grad = None
    out = lm.backbone(inputs, training=True)
    torch.sum(out.float() ** 2).backward()
    return out.detach().float().clone(), [None if w.value.grad is None else w.value.grad.clone() for w in factors]


@torch_only
@pytest.mark.parametrize("arch", ["tiny", "tiny-gemma2", "tiny-gemma3"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("remat", [False, True])
def test_lean_blocks_train_as_keras_hubs_forward_and_back(monkeypatch, arch, precision, remat):
    """The model `finetune gemma` builds (segment masks, LoRA beside the kernel, remat): the lean blocks' outputs
    and LoRA gradients are keras-hub's call's, bit for bit."""
    _same_as_keras_hub(monkeypatch, arch, precision, remat)


@torch_only
def test_a_float16_base_on_a_cpu_trains_as_keras_hubs_where_keras_keeps_its_matmuls_float16(monkeypatch):
    """A CPU's --precision auto is float16 where it has the units: keras' matmul keeps float16 there
    (keras_compat.keep_float16_matmuls, as a run installs it), so LoRA's torch ops take float16 too."""
    keras_compat.keep_float16_matmuls()
    _same_as_keras_hub(monkeypatch, "tiny", "float16", False)


@torch_only
def test_a_quantized_base_keeps_its_own_calls_under_lean_blocks(monkeypatch):
    """int8 kernels (quantized.py's calls) are left as they are; the blocks around them are lean, and the same."""
    _same_as_keras_hub(monkeypatch, "tiny", "float32", False, quantize="int8")


@torch_only
@pytest.mark.parametrize(
    "arch, precision, remat",
    [("tiny-gemma4", "bfloat16", True), ("tiny-gemma4-moe", "float32", False), ("tiny-gemma3n", "float32", False),
     ("tiny-gemma3n", "bfloat16", True), ("tiny", "float32", True)],
)  # fmt: skip
def test_layers_called_directly_train_as_keras_calls_them_with_lora_dropout(monkeypatch, arch, precision, remat):
    """Gemma 4's and 3n's blocks call their sublayers from keras-hub's code: keras' Layer.__call__ is skipped where
    it would only call the layer's call (keras_compat._direct_layer_calls). The training flag LoRA dropout reads
    reaches every layer as keras hands it: the same masks drawn, the same outputs and gradients, bit for bit."""
    _same_as_keras_hub(monkeypatch, arch, precision, remat, dropout=0.25)


def _same_as_keras_hub(monkeypatch, arch, precision, remat, quantize=None, dropout=0.0):
    import torch

    keras_compat.lean_torch_ops()
    keras.config.set_dtype_policy({"bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}.get(precision, "float32"))
    lora = LoraConfig(rank=2, targets=["query", "value"], dropout=dropout)
    recipe = builder.Recipe(16, precision, quantize, remat, lora=lora)
    lean = builder.build_model(_source(arch), recipe).lm
    with monkeypatch.context() as patched:
        patched.setattr(lean_torch, "enable", lambda backbone: 0)
        lm = builder.build_model(_source(arch), recipe).lm  # keras-hub's calls
    for theirs, ours in zip(lm.backbone.weights, lean.backbone.weights, strict=True):
        ours.assign(theirs)  # the same weights and factors (a random arch draws anew)
    inputs = _inputs(lm.backbone)
    for model in (lm, lean):
        _forward_and_back(model, inputs)  # the first pass builds through keras' __call__ (and counts a dropout pass)
    keras.utils.set_random_seed(3)
    own, own_grads = _forward_and_back(lm, inputs)
    mirrored = families.of_backbone(lean.backbone).name in ("gemma", "gemma3")
    attention_layers = [b.attention for b in families.decoder_blocks(lean.backbone)]
    assert all(getattr(a.call, "lean", False) == mirrored for a in attention_layers)
    assert not any(getattr(b.attention.call, "lean", False) for b in families.decoder_blocks(lm.backbone))
    assert all(layer.direct_call for layer in lean.backbone._flatten_layers())
    norm_classes = (*keras_compat.gemma_rms_normalization_classes(), *keras_compat.gemma4_normalization_classes(),
                    keras_compat.gemma3n_normalization_class())  # fmt: skip
    norms = [layer for layer in lean.backbone._flatten_layers() if type(layer) in norm_classes]
    assert norms and all(not lean_torch._own_call(layer) for layer in norms)  # every family's norms in torch ops
    assert not any(getattr(layer, "direct_call", False) for layer in lm.backbone._flatten_layers())
    keras.utils.set_random_seed(3)
    called, in_torch = [], []
    calls_directly = keras_compat.calls_directly

    def counted(layer, x):
        own_dtype = getattr(x, "dtype", None) == keras_compat.torch_dtype(layer.input_dtype)
        called.append((id(layer), own_dtype, calls_directly(layer, x)))
        return called[-1][-1]

    monkeypatch.setattr(keras_compat, "calls_directly", counted)
    with_lora = builder._with_lora_in_torch
    monkeypatch.setattr(builder, "_with_lora_in_torch", lambda *a: in_torch.append(with_lora(*a)) or in_torch[-1])
    ours, grads = _forward_and_back(lean, inputs)
    # LoRA in torch ops (builder._with_lora_in_torch) on query and value, again in the backward under remat; a
    # quantized layer keeps its own call
    # the LoRA layers whose call is in torch ops (Gemma 3n's are Dense layers: keras' call)
    lora_layers = sum(getattr(layer, "lora_enabled", False) and getattr(layer, "lora_in_torch", False)
                      for layer in lean.backbone._flatten_layers())  # fmt: skip
    adapted = lora_layers * (2 if remat else 1) if quantize is None else 0
    assert len(in_torch) == adapted and all((x is None) == bool(dropout) for x in in_torch)  # dropout: keras' ops
    in_blocks = {id(layer) for block in families.decoder_blocks(lean.backbone) for layer in block._flatten_layers()}
    # a sublayer of a block given its input in its own dtype (not the float32 softmax of a bfloat16 score)
    direct = [ok for layer, own_dtype, ok in called if layer in in_blocks and own_dtype]
    if quantize is None:
        assert len(direct) >= 8 * len(in_blocks) // 10 and all(direct), "every sublayer called directly"
    else:  # the quantized projections through keras' __call__ (quantized_call), the norms directly
        assert any(direct) and not all(direct)
    assert torch.equal(ours, own)
    assert len(grads) == len(own_grads) >= 4 and sum(g is not None for g in grads) >= 4
    for a, b in zip(grads, own_grads):
        assert (a is None and b is None) or torch.equal(a, b)


@torch_only
def test_a_sublayer_keras_would_convert_or_that_has_a_hook_goes_through_keras_call():
    import torch

    keras_compat.lean_torch_ops()
    layer = keras.layers.Dense(3, dtype="mixed_bfloat16")
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    layer(x)
    with keras_compat.calling(layer, True):
        assert not keras_compat.calls_directly(layer, x)  # the call's own context: keras resets it after
    with keras_compat.calling(keras.layers.Identity(), True):  # inside another layer's call
        assert keras_compat.calls_directly(layer, x)  # float32 variables, computed in bfloat16: in keras' scope
        with keras_compat.reading_variables_as_computed(layer):
            assert keras.ops.convert_to_tensor(layer.kernel).dtype == torch.bfloat16
            float32 = keras.layers.Dense(3, dtype="float32")
            float32(torch.ones(2, 4))
            with keras_compat.reading_variables_as_computed(float32):  # the outer scope changed, as keras does
                assert keras.ops.convert_to_tensor(float32.kernel).dtype == torch.float32
        plain = keras.layers.Dense(3)
        plain(torch.ones(2, 4))
        assert keras_compat.calls_directly(plain, torch.ones(2, 4))
        assert not keras_compat.calls_directly(plain, x)  # bfloat16 into a float32 layer: keras converts it
        handle = plain.register_forward_hook(lambda *a: None)
        assert not keras_compat.calls_directly(plain, torch.ones(2, 4))
        handle.remove()
        assert keras_compat.calls_directly(plain, torch.ones(2, 4))
    assert not keras_compat.calls_directly(plain, torch.ones(2, 4))  # outside every call: keras opens one


@torch_only
def test_generation_with_a_cache_gives_what_keras_hub_gives(monkeypatch):
    """A cache's passes go to keras-hub's calls; the prompt's and the tokens' are the same either way."""
    keras_compat.lean_torch_ops()
    real = lean_torch.enable
    monkeypatch.setattr(lean_torch, "enable", lambda backbone: 0)
    recipe = builder.Recipe(16, "float32", lora=LoraConfig(rank=2, targets=["query", "value"]))
    lm = builder.build_model(presets.resolve("tiny"), recipe).lm
    prompt = {"token_ids": np.array([[2, 5, 7, 9, 0, 0, 0, 0, 0, 0]], "int32"),
              "padding_mask": np.array([[1, 1, 1, 1, 0, 0, 0, 0, 0, 0]], "bool")}  # fmt: skip
    own = lm.generate(prompt, stop_token_ids=None)
    assert real(lm.backbone) > 0
    np.testing.assert_array_equal(lm.generate(prompt, stop_token_ids=None)["token_ids"], own["token_ids"])


@torch_only
def test_lora_in_torch_ops_trains_after_a_pass_under_inference_mode():
    """LoRA's scale is made once, outside inference mode: a notebook's generation first, then a training step that
    saves it for its backward."""
    import torch

    keras_compat.lean_torch_ops()
    keras.config.set_dtype_policy("float32")
    recipe = builder.Recipe(16, "float32", None, False, lora=LoraConfig(rank=2, targets=["query", "value"]))
    lm = builder.build_model(_source("tiny"), recipe).lm
    inputs = _inputs(lm.backbone)
    with torch.inference_mode():
        first = lm.backbone(inputs)
    out, grads = _forward_and_back(lm, inputs)
    assert torch.equal(out, first.float()) and all(g.abs().sum() > 0 for g in grads[1::2])  # B's gradients


@torch_only
def test_a_step_collects_the_trainable_weights_and_metrics_once_and_trains_the_same(monkeypatch):
    """keras' PyTorch train_on_batch walked every layer for the trainable weights three times a step, and for the
    metrics three more; a view's step (objective.TrainingView) collects each once from its second step on."""
    import inspect

    from conftest import lora_model, lora_train_losses

    keras_compat.lean_torch_ops()
    keras.config.set_dtype_policy("float32")
    own = inspect.getattr_static(keras.layers.Layer, "trainable_weights")
    walks = []
    monkeypatch.setattr(keras.layers.Layer, "trainable_weights", property(lambda s: walks.append(1) or own.fget(s)))
    ours = lora_train_losses(lora_model()[0], steps=4)
    per_step = len(walks)
    walks.clear()
    monkeypatch.setattr(builder.objective.TrainingView, "train_on_batch", keras.Model.train_on_batch)
    theirs = lora_train_losses(lora_model()[0], steps=4)
    assert ours == theirs
    assert len(walks) - per_step == 3 * 2  # keras: three walks a step; ours: one, from the second of 4 steps on


@torch_only
def test_a_direct_layer_call_resolves_training_and_hands_the_rest_to_keras_as_keras_would():
    """keras_compat._direct_layer_calls against keras' own __call__, on the cases that decide: the training flag
    given, None, inherited or defaulted, and given to a call that takes none; a mask on an input, a layer that
    computes masks, a float argument keras would convert: those go to keras."""
    import torch

    keras_compat.lean_torch_ops()

    class Seen(keras.layers.Layer):
        def call(self, x, scale=None, training=None):
            self.seen = training
            return x * (2.0 if training else 1.0) * (1.0 if scale is None else scale)

    class Defaulted(keras.layers.Layer):
        def call(self, x, training=True):
            self.seen = training
            return x + 1.0

    class Plain(keras.layers.Layer):
        def call(self, x):
            return x - 1.0

    x = torch.ones(2, 3)

    def run(direct, layer_class, outer, **kwargs):
        layer = layer_class()
        layer(x)  # built and called once, through keras
        layer.direct_call = direct
        took = []
        calls = keras_compat.calls_directly
        keras_compat_calls = lambda *a: took.append(calls(*a)) or took[-1]  # noqa: E731
        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(keras_compat, "calls_directly", keras_compat_calls)
            with keras_compat.calling(keras.layers.Identity(), outer):  # inside another layer's call
                out = layer(x, **kwargs)
                after = keras_compat.current_call_value("training")
        return out, getattr(layer, "seen", "-"), after, any(took)

    cases = [(Seen, True, {}), (Seen, False, {}), (Seen, None, {}), (Seen, True, {"training": False}),
             (Seen, True, {"training": None}), (Defaulted, None, {}), (Defaulted, False, {}),
             (Plain, True, {"training": False}), (Seen, True, {"scale": 3.0}), (Seen, True, {"scale": torch.ones(3)})]  # fmt: skip
    for layer_class, outer, kwargs in cases:
        (out, seen, after, direct), (own, own_seen, own_after, _) = (
            run(True, layer_class, outer, **kwargs), run(False, layer_class, outer, **kwargs))  # fmt: skip
        assert torch.equal(out, own) and (seen, after) == (own_seen, own_after), (layer_class, outer, kwargs)
        assert direct, (layer_class, outer, kwargs)
    # where keras would convert an argument, carry a mask or compute one: keras' own call
    outer = keras.layers.Identity()
    masked = x.clone()
    masked._keras_mask = torch.ones(2, 3, dtype=torch.bool)
    for kwargs, first in [({"scale": torch.ones(3, dtype=torch.float64)}, x), ({}, masked)]:
        layer = Seen()
        layer(x)
        with keras_compat.calling(outer, True):
            assert not keras_compat._direct_call_taken(layer, first, kwargs)
            assert keras_compat._direct_call_taken(layer, x, {})
    softmax = keras.layers.Softmax()  # supports masks, computes none of its own: the mask given goes on its output
    scores, allowed = torch.randn(2, 3), torch.tensor([[True, False, True], [True, True, False]])
    softmax(scores, mask=allowed)
    softmax.direct_call = True
    with keras_compat.calling(outer, True):
        assert keras_compat._direct_call_taken(softmax, scores, {"mask": allowed})
        assert torch.equal(softmax(scores, mask=allowed)._keras_mask, allowed)
        seen = Seen()
        seen(x)
        assert keras_compat._direct_call_taken(seen, x, {"scale": 2.0})
        assert not keras_compat._direct_call_taken(seen, x, {"mask": allowed})  # keras would warn it is lost
    masking = keras.layers.Masking(mask_value=0.0)
    zeros = torch.zeros(1, 2, 3)
    masking(zeros)
    masking.direct_call = True
    with keras_compat.calling(outer, True):
        assert not keras_compat._direct_call_taken(masking, zeros, {})
        assert masking(zeros)._keras_mask.tolist() == [[False, False]]  # its own mask, as keras sets it


@torch_only
@pytest.mark.parametrize("layer_dtype", ["float32", "mixed_bfloat16"])
def test_a_direct_call_converts_a_float_input_as_keras_does(layer_dtype):
    """keras-hub's float32 softmax given bfloat16 logits (a bfloat16 Gemma's attention): keras' __call__ casts the
    logits to float32 first; the direct call does the same and gives keras' output and mask, bit for bit, where it
    had gone to keras' own call (whose reads torch.compile could not trace: lean_torch.compile_blocks)."""
    import torch

    keras_compat.lean_torch_ops()
    scores = torch.randn(2, 3, 5).to(torch.bfloat16)
    allowed = torch.tensor([[[1, 1, 0, 1, 0]] * 3, [[1, 0, 1, 1, 1]] * 3], dtype=torch.int32)
    outer = keras.layers.Identity()

    def run(direct):
        softmax = keras.layers.Softmax(dtype=layer_dtype)
        softmax(scores, mask=allowed)
        softmax.direct_call = direct
        with keras_compat.calling(outer, True):
            taken = keras_compat._direct_call_taken(softmax, keras_compat._as_input(softmax, scores), {"mask": allowed})
            return softmax(scores, mask=allowed), taken

    (out, taken), (own, _) = run(True), run(False)
    assert taken and out.dtype == own.dtype and torch.equal(out, own)
    assert torch.equal(out._keras_mask, own._keras_mask)
    assert out.dtype == (torch.float32 if layer_dtype == "float32" else torch.bfloat16)
    softmax = keras.layers.Softmax(dtype=layer_dtype)
    assert keras_compat._as_input(softmax, allowed) is allowed  # integers as they are
    assert keras_compat._as_input(softmax, scores).dtype == out.dtype  # floats in its compute dtype


@torch_only
def test_a_direct_layer_call_takes_only_tensors_and_leaves_structures_to_keras():
    import torch

    keras_compat.lean_torch_ops()
    layer = keras.layers.Identity()
    layer(torch.ones(2))
    with keras_compat.calling(keras.layers.Identity(), True):
        assert keras_compat._direct_call_taken(layer, torch.ones(2), {"other": torch.ones(2), "n": 3})
        for x, kwargs in [({"a": torch.ones(2)}, {"b": {"c": 1}}), (torch.ones(2), {"b": {"c": 1}}),
                          (torch.ones(2), {"b": [torch.ones(2)]}), (np.ones(2, "float32"), {})]:  # fmt: skip
            assert not keras_compat._direct_call_taken(layer, x, kwargs)
