"""Guards for keras_compat: each keras or keras-hub internal it uses is still there and still does what it relies on.

When one fails after an upgrade, the test's name says which internal moved; keras_compat.WRITTEN_AGAINST says
which versions the module was written for.
"""

import inspect

import keras
import numpy as np
import pytest
from conftest import BACKEND

from finetune.model import families, presets
from finetune.platform import keras_compat


def test_the_versions_it_was_written_against_are_named():
    assert set(keras_compat.WRITTEN_AGAINST) == {"keras", "keras-hub"}
    # A newer major version is a rewrite of the internals, not an upgrade: re-check every entry by hand.
    assert keras.__version__.split(".")[0] == keras_compat.WRITTEN_AGAINST["keras"].split(".")[0]


def test_h5_store_reads_what_keras_hub_saves_a_lora_adapter_as(tmp_path):
    backbone = presets.tiny_backbone(presets.tiny_vocabulary_size())
    backbone.enable_lora(2)
    path = tmp_path / "a.lora.h5"
    backbone.save_lora_weights(str(path))
    store = keras_compat.h5_store(path)
    try:
        assert store.has_path("lora") and int(store.get("lora")["rank"][()]) == 2
    finally:
        store.close()


def test_the_preset_loader_builds_a_backbone_without_weights_and_loads_them_after(tmp_path):
    backbone = presets.tiny_backbone(presets.tiny_vocabulary_size())
    backbone.save_to_preset(str(tmp_path))
    loader = keras_compat.preset_loader(str(tmp_path))
    assert loader.config["config"]["num_layers"] == backbone.num_layers  # editable before the build
    assert "load_weights" in inspect.signature(loader.load_backbone).parameters
    empty = loader.load_backbone(type(backbone), load_weights=False, dtype=None)
    keras_compat.load_backbone_weights(loader, empty)
    for ours, theirs in zip(empty.weights, backbone.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours), keras.ops.convert_to_numpy(theirs))
    assert keras_compat.preset_config(str(tmp_path))["config"]["hidden_dim"] == backbone.hidden_dim


def test_the_transformers_exporters_are_where_export_reads_them():
    exporter = keras_compat.transformers_exporter()
    assert callable(exporter.export_backbone) and callable(exporter.export_generation_config)
    gemma, backbone = keras_compat.transformers_gemma_exporter(), presets.tiny_backbone(presets.tiny_vocabulary_size())
    assert gemma.get_gemma_config(backbone)["num_hidden_layers"] == presets.TINY_CONFIG["num_layers"]
    assert "model.embed_tokens.weight" in gemma.get_gemma_weights_map(backbone)


@pytest.mark.skipif(BACKEND != "torch", reason="keras' PyTorch matmul only")
def test_float16_matmuls_stay_float16_on_a_cpu():
    import torch

    keras_compat.keep_float16_matmuls()
    assert keras_compat.keep_float16_matmuls() is False  # once per process
    x = torch.ones((2, 3), dtype=torch.float16)
    assert keras.ops.matmul(x, torch.ones((3, 2), dtype=torch.float16)).dtype == torch.float16


@pytest.mark.skipif(BACKEND != "torch", reason="keras' PyTorch einsum only")
def test_einsums_of_two_float_dtypes_promote_on_pytorch_as_on_the_other_backends():
    """keras-hub's Gemma 4 audio attention weighs float32 values by bfloat16 probabilities (test_audio trains it)."""
    import numpy as np
    import torch

    keras_compat.promoted_torch_einsums()
    assert keras_compat.promoted_torch_einsums() is False  # once per process
    probs = torch.full((2, 3), 0.5, dtype=torch.bfloat16)
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    mixed = keras.ops.einsum("wc,ch->wh", probs, values)
    assert mixed.dtype == torch.float32
    np.testing.assert_allclose(mixed.numpy(), 0.5 * values.numpy().sum(0, keepdims=True).repeat(2, 0))
    ints = torch.ones((2, 2), dtype=torch.int8)
    assert keras.ops.einsum("ij,jk->ik", ints, ints).dtype == torch.int32  # keras' own path


@pytest.mark.skipif(BACKEND != "torch", reason="keras' PyTorch convert_to_tensor only")
@pytest.mark.parametrize(
    "number", [True, 0, 3, -(2**31) - 1, 2**40, 0.1, -2.5, float(np.float64(1e-3)), np.float64(7.5)]
)
@pytest.mark.parametrize("dtype", [None, "bool", "int32", "int64", "float32", "bfloat16", "float16"])
def test_a_python_number_filled_on_the_device_is_what_keras_copies_there(number, dtype):
    """The fill (keras_compat.filled_number) gives keras' own tensor, value and dtype, for every number and dtype;
    a float into an integer dtype is left to keras."""
    import torch
    from keras.src.backend.torch import core

    filled = keras_compat.filled_number(number, dtype, "cpu")
    if filled is None:
        out_of_range = dtype == "int32" and not -(2**31) <= number < 2**31
        assert (isinstance(number, float) and dtype in ("bool", "int32", "int64")) or out_of_range
        return
    copied = core.convert_to_tensor(number, dtype=dtype)  # keras' function, or the patch's on a CPU (keras')
    assert filled.dtype == copied.dtype and filled.shape == copied.shape == torch.Size([])
    assert torch.equal(filled, copied), (filled, copied)


@pytest.mark.skipif(BACKEND != "torch", reason="keras' PyTorch backend only")
def test_lean_ops_replace_every_binding_of_keras_functions_and_fill_numbers_on_an_accelerator(monkeypatch):
    import sys

    import torch
    from keras.src.backend.common import keras_tensor, variables
    from keras.src.backend.torch import core

    keras_compat.lean_torch_ops()
    assert keras_compat.lean_torch_ops() is False and keras_compat.lean_torch_ops_on()  # once per process
    for name, modules in {
        "convert_to_tensor": ("keras.src.backend", "keras.src.backend.torch.numpy", "keras.src.backend.torch.nn"),
        "any_symbolic_tensors": ("keras.src.backend", "keras.src.ops.numpy", "keras.src.ops.operation"),
        "standardize_dtype": ("keras.src.backend", "keras.src.backend.torch.core", "keras.src.backend.torch.numpy"),
    }.items():
        patched = getattr(core if name == "convert_to_tensor" else keras_tensor if name[0] == "a" else variables, name)
        assert patched.lean, name
        for module in modules:
            assert getattr(sys.modules[module], name) is patched, (name, module)  # every binding of keras' function
    patched = core.convert_to_tensor
    # On a CPU, keras' own copy; on another device, a fill there (the meta device stands in for a GPU here).
    x = torch.ones((2,), dtype=torch.bfloat16)
    assert keras.ops.multiply(x, 0.5).tolist() == [0.5, 0.5]
    assert str(patched(0.5).device) == "cpu"
    monkeypatch.setattr(core, "get_device", lambda: "meta")
    on_device = patched(0.5, dtype="bfloat16")
    assert on_device.device.type == "meta" and on_device.dtype == torch.bfloat16
    assert patched(True).dtype == torch.bool and patched(2**40).dtype == torch.int64
    assert patched(2.5, dtype="int32").device.type == "meta"  # left to keras, which copies to the same device
    assert patched(x).device.type == "meta"  # a tensor elsewhere is moved, as keras moves it


@pytest.mark.skipif(BACKEND != "torch", reason="keras' PyTorch backend only")
@pytest.mark.parametrize("dtype", [None, "bfloat16", "float32", "int32", "torch.float16"])
def test_lean_convert_to_tensor_returns_what_keras_returns(dtype):
    """A tensor on keras' device in the dtype asked comes back as the same object, as keras' `.to` calls give it;
    any other, converted as keras converts it."""
    import torch
    from keras.src.backend.torch import core

    keras_compat.lean_torch_ops()
    own = core.convert_to_tensor.keras_own
    dtype = getattr(torch, dtype.split(".")[1]) if dtype and dtype.startswith("torch.") else dtype
    for x in (torch.ones((2, 3)), torch.ones(3, dtype=torch.bfloat16), torch.nn.Parameter(torch.zeros(2)),
              torch.arange(4), np.ones(3), [1.0, 2.0], 3):  # fmt: skip
        ours, theirs = core.convert_to_tensor(x, dtype=dtype), own(x, dtype=dtype)
        assert ours.dtype == theirs.dtype and ours.device == theirs.device and torch.equal(ours, theirs)
        if isinstance(x, torch.Tensor):
            assert (ours is x) == (theirs is x)


@pytest.mark.skipif(BACKEND != "torch", reason="keras' PyTorch backend only")
def test_lean_any_symbolic_tensors_answers_as_keras_for_every_kind_of_argument():
    import collections

    import torch
    from keras.src.backend.common import keras_tensor

    keras_compat.lean_torch_ops()
    symbolic = keras.KerasTensor((2, 3))
    pair = collections.namedtuple("pair", "a b")
    cases = [
        ((), None), ((torch.ones(2), 1, 2.5, True, None, "x"), None), ((symbolic,), None),
        (([torch.ones(2), (1, symbolic)],), None), (({"a": [symbolic]},), None), (({"a": torch.ones(1)},), None),
        ((pair(1, symbolic),), None), ((pair(1, 2),), None), ((), {"mask": symbolic}), ((1,), {"mask": None}),
        ((np.ones(2), keras.Variable(np.ones(2))), None), (([[], ()],), None),
    ]  # fmt: skip
    ours = keras_tensor.any_symbolic_tensors
    assert ours.lean
    theirs = ours.keras_own
    for args, kwargs in cases:
        assert ours(args, kwargs) == theirs(args, kwargs), (args, kwargs)
    assert [ours(a, k) for a, k in cases].count(True) == 5


@pytest.mark.skipif(BACKEND != "torch", reason="keras' PyTorch backend only")
def test_lean_standardize_dtype_keeps_keras_answer_and_its_errors_and_follows_floatx():
    import torch
    from keras.src.backend.common import variables

    keras_compat.lean_torch_ops()
    ours = variables.standardize_dtype
    theirs = ours.keras_own
    for dtype in ("float32", "bfloat16", "int", "int32", np.dtype("float16"), np.float32, torch.bfloat16,
                  torch.int64, float, int, bool, "float32"):  # fmt: skip
        assert ours(dtype) == theirs(dtype), dtype
    with pytest.raises(ValueError, match="Invalid dtype"):
        ours("float31")
    with pytest.raises(ValueError, match="Invalid dtype"):
        ours("float31")  # still raised: an error is not kept
    previous = keras.config.floatx()
    try:
        keras.config.set_floatx("float16")
        assert ours(None) == "float16"
    finally:
        keras.config.set_floatx(previous)
    assert ours(None) == previous


def test_the_seed_is_set_without_touching_tensorflows_on_another_backend(monkeypatch):
    import sys

    tf = sys.modules.get("tensorflow")
    if BACKEND == "tensorflow" or tf is None:
        pytest.skip("TensorFlow's own backend sets its seed; this process has no TensorFlow")
    calls = []
    monkeypatch.setattr(tf.random, "set_seed", lambda seed: calls.append(seed))
    keras_compat.set_seed_leaving_tensorflow_alone(3)
    assert calls == [] and tf.random.set_seed is not None
    assert np.random.get_state()[1][0] == np.random.RandomState(3).get_state()[1][0]  # keras' own seeding ran


def test_large_variables_start_as_zeros_and_the_class_is_restored_after():
    before = keras.Variable.__dict__.get("_initialize_with_initializer")
    with keras_compat.large_variables_start_as_zeros(at_least=100):
        large = keras.Variable(keras.initializers.RandomNormal()((20, 10)))
        drawn = keras.layers.Dense(200)
        drawn.build((None, 10))
        small = keras.layers.Dense(2)
        small.build((None, 3))
    assert keras.Variable.__dict__.get("_initialize_with_initializer") is before
    assert np.any(keras.ops.convert_to_numpy(large) != 0)  # a value given is kept: only initializers are replaced
    assert not np.any(keras.ops.convert_to_numpy(drawn.kernel))
    assert np.any(keras.ops.convert_to_numpy(small.kernel))


def test_a_replaced_call_is_what_keras_calls_on_a_float_and_a_quantized_layer():
    for quantize in (None, "int8"):
        layer = keras.layers.Dense(4)
        layer.build((None, 3))
        if quantize:
            layer.quantize(quantize)
        keras_compat.replace_call(layer, lambda inputs, training=None: keras.ops.zeros((1, 7)))
        assert tuple(layer(np.ones((1, 3), "float32")).shape) == (1, 7), quantize


@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma3", "tiny-gemma3n", "tiny-gemma4"])
def test_every_familys_decoder_blocks_compute_their_mask_where_attention_replaces_it(preset):
    family = presets.TINY[preset].family
    backbone = presets.tiny_backbone(presets.tiny_vocabulary_size(preset), name=preset)
    for block in families.decoder_blocks(backbone):
        assert "padding_mask" in inspect.signature(block._compute_attention_mask).parameters, family
    seen = []
    for block in families.decoder_blocks(backbone):
        original = block._compute_attention_mask
        keras_compat.replace_attention_mask(block, lambda *a, o=original, **k: seen.append(1) or o(*a, **k))
    inputs = {t.name: np.ones((1, 6), "int32") for t in keras.tree.flatten(backbone.inputs)}
    inputs["position_ids"] = np.arange(6, dtype="int32")[None]
    backbone({k: v for k, v in inputs.items() if k in {t.name for t in keras.tree.flatten(backbone.inputs)}})
    assert len(seen) >= len(families.decoder_blocks(backbone)), f"{preset}: keras-hub no longer calls the mask"


def test_the_gemma_attention_class_is_what_gemma_1_blocks_hold():
    backbone = presets.tiny_backbone(presets.tiny_vocabulary_size("tiny"), name="tiny")
    assert all(type(b.attention) is keras_compat.gemma_attention_class() for b in families.decoder_blocks(backbone))


def test_a_symbolic_inputs_dtype_can_be_widened():
    tensor = keras.Input((4,), dtype="bool", name="padding_mask")
    assert keras_compat.widen_input_dtype(tensor, "int32") and tensor.dtype == "int32"


def test_a_layers_loading_can_be_replaced_and_keras_load_weights_calls_it(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    path = tmp_path / "m.weights.h5"
    model.save_weights(str(path))
    seen = []
    keras_compat.replace_loading(model.layers[0], lambda store: seen.append(np.asarray(store["0"]).shape))
    model.load_weights(str(path))
    assert seen == [(3, 2)]


def test_keras_int8_layers_quantize_inputs_through_the_attribute_weights_only_drops():
    layer = keras.layers.Dense(4)
    layer.build((None, 3))
    layer.quantize("int8")
    assert getattr(layer, "inputs_quantizer", None) is not None
    keras_compat.drop_inputs_quantizer(layer)
    assert layer.inputs_quantizer is None
    layer(np.ones((1, 3), "float32"))  # still computes


def test_a_replaced_call_can_take_the_training_flag_the_layers_own_call_lacks():
    layer = keras.layers.Embedding(10, 4)
    layer.build((None, 3))
    seen = []
    keras_compat.replace_call(layer, lambda inputs, training=None: seen.append(training) or inputs, takes_training=True)
    tokens = np.zeros((1, 3), "int32")
    layer(tokens, training=True), layer(tokens)
    assert seen == [True, None]


def test_a_layer_called_outside_every_call_reads_the_training_flag_of_the_context_entered():
    seen = []

    class Reads(keras.layers.Layer):
        def call(self, inputs, training=None):
            seen.append(training)
            return inputs

    inner, outer = Reads(), keras.layers.Identity()
    x = np.ones((1, 2), "float32")
    inner(x)
    with keras_compat.calling(outer, training=True):
        inner(x)
        inner(x)  # the context outlives each inner call
    inner(x)
    assert seen == [None, True, True, None]


def test_a_built_layer_takes_new_variables_and_seeds_only_while_unlocked():
    layer = keras.layers.Dense(3)
    layer.build((None, 2))
    with pytest.raises(ValueError):
        layer.add_weight(name="late", shape=(3,))
    with keras_compat.adding_variables(layer):
        layer.late = layer.add_weight(name="late", shape=(3,))
        layer.seed = keras.random.SeedGenerator(1)
    assert [v.path for v in layer.trainable_weights][-1].endswith("late")
    assert any(v is layer.seed.state for v in layer.non_trainable_variables)


def test_the_learning_rate_ratio_steps_and_decays_the_chosen_variables_faster():
    """AdamW through both private hooks (step and decay): the chosen variable moves as at ratio * learning rate."""
    values = {}
    for ratio, rate in ((None, 0.1), (None, 0.3), (3.0, 0.1)):
        variables = [keras.Variable(np.ones(2, "float32"), name=n) for n in ("a", "b")]
        optimizer = keras.optimizers.AdamW(learning_rate=rate, weight_decay=0.5)
        if ratio:
            keras_compat.learning_rate_ratio(optimizer, lambda v: v.name == "b", ratio)
        optimizer.apply([keras.ops.convert_to_tensor([0.5, -1.0])] * 2, variables)
        values[(ratio, rate)] = [keras.ops.convert_to_numpy(v) for v in variables]
    np.testing.assert_allclose(values[(3.0, 0.1)][0], values[(None, 0.1)][0], rtol=1e-6)
    np.testing.assert_allclose(values[(3.0, 0.1)][1], values[(None, 0.3)][1], rtol=1e-6)
    assert not np.allclose(values[(None, 0.1)][1], values[(None, 0.3)][1])


def test_keras_collects_garbage_when_a_layer_deletes_a_variable_and_the_build_scans_new_objects_only(monkeypatch):
    """collections_of_new_objects_only exists because Layer.__delattr__ runs gc.collect() per deleted variable."""
    import gc

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(gc.get_freeze_count()) or 0)
    monkeypatch.setattr(keras_compat, "FULL_COLLECTION_FIRST", True)  # as a user's process has it
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    with keras_compat.collections_of_new_objects_only():
        del layer._kernel  # what a quantized build does to each float kernel
    assert len(calls) == 2 and calls[1] > 0  # its own collection before freezing, then keras' over the rest
    assert gc.get_freeze_count() == 0  # unfrozen on the way out
    # A user's process has it on: only this suite turns it off (conftest), so read it where no conftest ran.
    import subprocess
    import sys

    read = "from finetune.platform import keras_compat; print(keras_compat.FULL_COLLECTION_FIRST)"
    assert subprocess.run([sys.executable, "-c", read], capture_output=True, text=True).stdout.strip() == "True"
    # The suite's setting: keras' collection alone, over the objects made inside.
    monkeypatch.setattr(keras_compat, "FULL_COLLECTION_FIRST", False)
    calls.clear()
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    with keras_compat.collections_of_new_objects_only():
        del layer._kernel
    assert len(calls) == 1 and calls[0] > 0 and gc.get_freeze_count() == 0


@pytest.mark.skipif(BACKEND != "tensorflow", reason="keras' TensorFlow add only")
@pytest.mark.parametrize(
    "first, second",
    [((4, 4), (4, 1)), ((2, 3, 3), (3, 1)), ((3, 3), (3, 1)), ((4, 4), (1, 4)), ((2, 5, 4), (4,)), ((2, 4, 5), (1, 4, 1)),
     ((2, 3, 4), (2, 1, 1)), ((3, 2), (3, 1))],
)  # fmt: skip
def test_tensorflow_adds_broadcast_as_numpy_does(first, second):
    """keras' own add took a (4, 1) beside a (4, 4) for a bias along the last axis (keras-hub's Gemma 3 then put a
    batch of 4 rows' pictures at the wrong positions); biases along the last axis or axis 1 keep its fused path."""
    keras_compat.exact_tensorflow_adds()
    rng = np.random.default_rng(0)
    for dtype in ("int32", "float32"):
        a = rng.integers(0, 100, first).astype(dtype)
        b = rng.integers(0, 100, second).astype(dtype)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras.ops.add(a, b)), a + b)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras.ops.add(b, a)), a + b)
    assert keras.ops.add(2, 3) == 5
    assert not keras_compat.exact_tensorflow_adds()  # once a process
