import keras
import numpy as np
import pytest

from finetune.config import LoraConfig
from finetune.data import batching
from finetune.model import builder, families, presets
from finetune.platform import backend
from finetune.platform.errors import UserError

TINY = presets.Source("tiny", "tiny", "gemma")


def build(rank=2, alpha=None, targets=("query", "value"), **variant):
    backend.set_seed(0)
    lm, preprocessor = builder.build(TINY, seq_len=32)
    builder.enable_lora(lm, LoraConfig(rank=rank, alpha=alpha, targets=list(targets), **variant))
    return lm, preprocessor


def a_batch(preprocessor, n=4):
    pairs = [(f"Instruction:\nSay {i}.\n\nResponse:\n", f"{i} {i} {i}.") for i in range(n)]
    examples, _ = batching.tokenize(pairs, preprocessor.tokenizer, seq_len=32)
    return batching.TrainOrder(batching.pad(examples, 32), batch_size=n, seed=0).batch(0)


def logits(lm, x):
    tokens = {"token_ids": x["token_ids"], "padding_mask": x["padding_mask"]}
    return keras.ops.convert_to_numpy(lm(tokens, training=False))


def test_tiny_base_weights_are_the_same_on_every_build():
    first, _ = builder.build(TINY, seq_len=32)
    second, _ = builder.build(TINY, seq_len=32)
    for a, b in zip(first.backbone.weights, second.backbone.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


def test_only_lora_factors_train():
    lm, _ = build(rank=2)
    names = {v.path.split("/")[-1] for v in lm.trainable_weights}
    assert names == {"lora_kernel_a", "lora_kernel_b"}
    # Keras factors an einsum kernel of shape (heads, hidden, head_dim) into
    # A (heads, hidden, rank) and B (rank, head_dim): query has 4 heads, value 1.
    query, value = 4 * 128 * 2 + 2 * 32, 1 * 128 * 2 + 2 * 32
    assert builder.trainable_parameters(lm) == 2 * (query + value)


def test_alpha_sets_the_layer_scale_and_targets_are_checked():
    lm, _ = build(rank=2, alpha=8.0, targets=("query",))
    adapted = [layer for layer in lm.backbone._flatten_layers() if getattr(layer, "lora_enabled", False)]
    assert [layer.name for layer in adapted] == ["query", "query"]
    assert all(layer.lora_alpha == 8.0 for layer in adapted)
    fresh, _ = builder.build(TINY, seq_len=32)
    with pytest.raises(UserError, match="no layer named 'qkv'"):
        builder.enable_lora(fresh, LoraConfig(rank=2, targets=["qkv"]))


def test_adapter_save_then_load_gives_identical_logits(tmp_path):
    lm, preprocessor = build(rank=2, alpha=4.0)
    trainer = builder.compile(lm, learning_rate=1e-2, weight_decay=0.0)
    x, y, w = a_batch(preprocessor)
    for _ in range(3):
        trainer.train_on_batch(x, y, sample_weight=w)
    path = str(tmp_path / "adapter.lora.h5")
    lm.backbone.save_lora_weights(path)

    base, _ = build(rank=2, alpha=4.0)
    assert not np.allclose(logits(base, x), logits(lm, x), atol=1e-4)  # training moved the adapter
    base.backbone.load_lora_weights(path)
    np.testing.assert_allclose(logits(base, x), logits(lm, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zeros_from", [None, 1], ids=["large-floats-zeroed", "every-float-zeroed"])
def test_local_preset_directory_resolves_and_loads(tmp_path, monkeypatch, zeros_from):
    """every-float-zeroed: each float variable starts as zeros (model.zeros_until_loaded), so one the preset's weights
    missed would show in the logits."""
    if zeros_from is not None:
        monkeypatch.setattr(builder, "_LARGE", zeros_from)
    lm, preprocessor = builder.build(TINY, seq_len=32)
    lm.preprocessor = preprocessor
    lm.save_to_preset(str(tmp_path / "tiny-preset"))
    source = presets.resolve(str(tmp_path / "tiny-preset"))
    assert (source.kind, source.family) == ("local", "gemma")
    loaded, loaded_preprocessor = builder.build(source, seq_len=32)
    x, _, _ = a_batch(preprocessor)
    lm.preprocessor = None
    np.testing.assert_allclose(logits(loaded, x), logits(lm, x), rtol=1e-5, atol=1e-5)
    assert loaded_preprocessor.tokenizer.vocabulary_size() == preprocessor.tokenizer.vocabulary_size()


def test_a_local_preset_loads_quantized_as_keras_quantizes_it(tmp_path, monkeypatch):
    """--quantize int4 on a saved preset: each decoder kernel quantized as it loads, equal to keras' quantize().

    Every float variable of the loaded base starts as zeros (model.zeros_until_loaded), so one the load missed
    would show."""
    monkeypatch.setattr(builder, "_LARGE", 1)
    before = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy("float32")
        lm, preprocessor = builder.build(TINY, seq_len=32)
        lm.preprocessor = preprocessor
        lm.save_to_preset(str(tmp_path / "tiny-preset"))
        source = presets.resolve(str(tmp_path / "tiny-preset"))
        loaded, _ = builder.load_base(source, 32, "float32", "int4")
        embedding = keras.ops.convert_to_numpy(lm.backbone.token_embedding.embeddings)
        lm.backbone.quantize("int4")
    finally:
        keras.config.set_dtype_policy(before)
    expected = {v.path: keras.ops.convert_to_numpy(v) for v in lm.backbone.weights}
    decoder = [v for v in loaded.backbone.weights if v.path.startswith("decoder_block")]
    assert {v.path.rsplit("/", 1)[-1] for v in decoder} >= {"kernel", "kernel_scale"}
    for variable in decoder:
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), expected[variable.path], variable.path)
    assert loaded.backbone.token_embedding.embeddings.dtype == "float32"  # the output projection stays float
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded.backbone.token_embedding.embeddings), embedding)


@pytest.mark.parametrize(
    "targets", [("query", "value"), ("query", "key", "value", "attention_output", "ffw_gating", "ffw_linear")]
)
def test_lora_beside_the_kernel_gives_keras_merged_output(targets):
    """The adapted layers' own call (x W + s (x A) B) against Keras' merged kernel (x (W + s A B)), with B
    nonzero, float32: the same logits to rounding."""
    from conftest import float32_policy

    with float32_policy():
        lm, preprocessor = build(rank=2, alpha=3.0, targets=targets)
        adapted = [layer for layer in lm.backbone._flatten_layers() if getattr(layer, "lora_enabled", False)]
        rng = np.random.default_rng(0)
        for layer in adapted:
            b = layer.lora_kernel_b
            b.assign(rng.normal(0, 0.5, tuple(b.shape)).astype("float32"))
        if keras.config.backend() == "jax":
            assert adapted and not any("call" in vars(layer) for layer in adapted)  # Keras' own call on JAX
            return
        assert adapted and all("call" in vars(layer) for layer in adapted)  # every one is applied beside
        x, _, _ = a_batch(preprocessor)
        beside = logits(lm, x)
        for layer in adapted:
            del layer.call  # back to Keras' own call, which merges
        merged = logits(lm, x)
    np.testing.assert_allclose(beside, merged, rtol=1e-4, atol=1e-4)


def test_a_base_to_be_loaded_starts_its_large_floats_as_zeros_and_keras_draws_again_after():
    with builder.zeros_until_loaded():
        big = keras.layers.Dense(512, dtype="float16")
        big.build((None, 256))  # 131,072 kernel values: large
        norm = keras.layers.LayerNormalization(dtype="float32")
        norm.build((None, 256))
    assert not np.any(keras.ops.convert_to_numpy(big.kernel))
    assert np.all(keras.ops.convert_to_numpy(norm.gamma) == 1)  # small: its own initializer
    after = keras.layers.Dense(512, dtype="float32")
    after.build((None, 256))
    assert np.any(keras.ops.convert_to_numpy(after.kernel))  # keras' own initializer again


# === LoRA's variants: all-linear, dropout, rsLoRA, DoRA, LoRA+, NEFTune ===


def adapted_layers(lm):
    return [layer for layer in lm.backbone._flatten_layers() if getattr(layer, "lora_enabled", False)]


def random_b(lm, seed=0):
    """B off zero, as after training, so that the update (and DoRA's norm) is not the base's."""
    rng = np.random.default_rng(seed)
    for layer in adapted_layers(lm):
        layer.lora_kernel_b.assign(rng.normal(0, 0.5, tuple(layer.lora_kernel_b.shape)).astype("float32"))


def test_all_linear_adapts_the_seven_kinds_and_peft_names_are_ours():
    lm, _ = build(targets=("all-linear",))
    kinds = {layer.name for layer in adapted_layers(lm)}
    assert kinds == {"query", "key", "value", "attention_output", "ffw_gating", "ffw_gating_2", "ffw_linear"}
    assert len(adapted_layers(lm)) == 7 * lm.backbone.num_layers
    peft, _ = build(targets=("q_proj", "v_proj", "down_proj"))
    assert {layer.name for layer in adapted_layers(peft)} == {"query", "value", "ffw_linear"}


def test_rslora_scales_the_update_by_alpha_over_the_root_of_the_rank():
    lm, _ = build(rank=4, alpha=8.0, rslora=True)
    assert all(layer.lora_alpha / layer.lora_rank == pytest.approx(4.0) for layer in adapted_layers(lm))
    assert LoraConfig(rank=4, alpha=8.0).scale() == 2.0 and LoraConfig(rank=4, alpha=8.0, rslora=True).scale() == 4.0


def test_lora_dropout_changes_training_and_leaves_inference_alone():
    from conftest import float32_policy

    with float32_policy():
        plain, preprocessor = build()
        dropped, _ = build(dropout=0.5)
        random_b(plain), random_b(dropped)
        x, y, w = a_batch(preprocessor)
        tokens = {"token_ids": x["token_ids"], "padding_mask": x["padding_mask"]}
        # no dropout; beside the kernel against keras' merged call on JAX: float32 sums in another order
        np.testing.assert_allclose(logits(dropped, x), logits(plain, x), rtol=1e-4, atol=1e-4)
        training = keras.ops.convert_to_numpy(dropped(tokens, training=True))
        assert np.abs(training - logits(plain, x)).max() > 1e-3  # dropout while training
        losses = []
        for lm in (plain, dropped):
            trainer = builder.compile(lm, learning_rate=1e-2, weight_decay=0.0)
            losses.append([float(trainer.train_on_batch(x, y, sample_weight=w)) for _ in range(2)])
    assert losses[0] != pytest.approx(losses[1], rel=1e-4)


def test_dora_computes_peft_s_weight_decomposed_update():
    """m (W + s A B) / |W + s A B|, each output's norm over the kernel's input axes (PEFT's dim=1 of (out, in)),
    against numpy, on query (heads, hidden, head_dim) and ffw_linear (in, out); at the start, the base itself."""
    from conftest import float32_policy

    with float32_policy():
        base, preprocessor = build()
        lm, _ = build(rank=2, alpha=4.0, targets=("query", "ffw_linear"), dora=True)
        x, _, _ = a_batch(preprocessor)
        np.testing.assert_allclose(logits(lm, x), logits(base, x), rtol=1e-5, atol=1e-5)  # m = |W| and B = 0
        random_b(lm)
        rng = np.random.default_rng(1)
        for layer in adapted_layers(lm)[:2]:
            magnitude = keras.ops.convert_to_numpy(layer.lora_magnitude)
            layer.lora_magnitude.assign(magnitude * rng.uniform(0.5, 1.5, magnitude.shape).astype("float32"))
            kernel, a, b, m = (keras.ops.convert_to_numpy(v) for v in
                               (layer._kernel, layer.lora_kernel_a, layer.lora_kernel_b, layer.lora_magnitude))  # fmt: skip
            merged = kernel + 2.0 * np.matmul(a, b)
            axes = builder.reduced_axes(layer)
            expected_weight = merged * np.expand_dims(m / np.sqrt((merged**2).sum(axis=axes)), axes)
            inputs = rng.normal(size=(2, 3, kernel.shape[-2] if layer.name == "ffw_linear" else kernel.shape[1]))
            inputs = inputs.astype("float32")
            equation = "matmul" if layer.name == "ffw_linear" else layer.equation
            expected = np.matmul(inputs, expected_weight) if equation == "matmul" else np.einsum(
                equation, inputs, expected_weight)  # fmt: skip
            got = keras.ops.convert_to_numpy(layer(inputs))
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=layer.name)
    names = {v.path.split("/")[-1] for v in lm.trainable_weights}
    assert names == {"lora_kernel_a", "lora_kernel_b", "lora_magnitude"}  # checkpointed with A and B


def test_a_fresh_dora_adapter_is_its_base_bit_for_bit_in_bfloat16():
    """m starts at |W| and B at zero, so m / |W + s A B| is 1 and a fresh DoRA layer gives its base's output. The
    magnitude was read autocast to bfloat16 in the layer's call, so the ratio was 1 only to bfloat16's rounding: a
    fresh adapter scored 9.1034 where its base scored 9.1039."""
    keras.config.set_dtype_policy(backend.POLICIES["bfloat16"][1])  # the adapter's, as a run sets it
    backend.set_seed(0)
    lm, preprocessor = builder.build(TINY, seq_len=32, precision="bfloat16")
    builder.enable_lora(lm, LoraConfig(rank=2, targets=["query", "value", "ffw_linear"], dora=True))
    assert {layer.compute_dtype for layer in adapted_layers(lm)} == {"bfloat16"}
    x, _, _ = a_batch(preprocessor)
    fresh = logits(lm, x)
    with builder.lora_off(lm):
        base = logits(lm, x)
    np.testing.assert_array_equal(fresh, base)
    assert {v.dtype for layer in adapted_layers(lm) for v in [layer.lora_magnitude]} == {"float32"}


def test_lora_plus_steps_b_at_ratio_times_the_learning_rate():
    """One AdamW step with --lora-plus-ratio 4 moves A as lr does and B as 4 * lr does, weight decay included."""
    from conftest import float32_policy

    def one_step(learning_rate, ratio=None):
        with float32_policy():
            lm, preprocessor = build()
            random_b(lm)
            trainer = builder.compile(lm, learning_rate, weight_decay=0.1, plus_ratio=ratio)
            trainer.train_on_batch(*a_batch(preprocessor))
        return {v.path: keras.ops.convert_to_numpy(v) for v in lm.trainable_weights}

    plus, slow, fast = one_step(1e-3, 4.0), one_step(1e-3), one_step(4e-3)
    assert plus.keys() == slow.keys()
    for path, value in plus.items():
        expected = fast[path] if path.endswith("lora_kernel_b") else slow[path]
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7, err_msg=path)
    assert any(not np.allclose(fast[p], slow[p]) for p in plus)  # the two learning rates do differ


def peft_loraplus_rates(ratio: float) -> dict:
    """Our variable name -> the learning rates (over lr) PEFT's create_loraplus_optimizer gives its parameters of that
    kind, on a toy transformers Gemma with LoRA and DoRA on every linear layer."""
    import peft
    import torch
    import transformers
    from peft.optimizers import create_loraplus_optimizer

    config = transformers.GemmaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=2, target_modules="all-linear", use_dora=True)
    model = peft.get_peft_model(transformers.GemmaForCausalLM(config), lora)
    optimizer = create_loraplus_optimizer(model, torch.optim.AdamW, lr=1.0, loraplus_lr_ratio=ratio)
    names = {id(p): n for n, p in model.named_parameters()}
    ours = {"lora_A": "lora_kernel_a", "lora_B": "lora_kernel_b", "lora_magnitude_vector": "lora_magnitude"}
    rates = {}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            kind = next(v for k, v in ours.items() if f".{k}." in names[id(parameter)])
            rates.setdefault(kind, set()).add(group["lr"])
    return rates


def test_lora_plus_gives_each_dora_variable_peft_s_learning_rate():
    """PEFT's LoRA+ steps B and DoRA's magnitudes (its vectors) at ratio * lr and A at lr; one AdamW step of ours
    moves each variable as a plain step at the rate PEFT gives its kind does."""
    from conftest import float32_policy

    ratio, learning_rate = 4.0, 1e-3
    expected = peft_loraplus_rates(ratio)
    assert expected == {"lora_kernel_a": {1.0}, "lora_kernel_b": {ratio}, "lora_magnitude": {ratio}}

    def one_step(rate, plus=None):
        with float32_policy():
            lm, preprocessor = build(targets=("query", "ffw_linear"), dora=True)
            random_b(lm)
            trainer = builder.compile(lm, rate, weight_decay=0.1, plus_ratio=plus)
            trainer.train_on_batch(*a_batch(preprocessor))
        return {v.path: keras.ops.convert_to_numpy(v) for v in lm.trainable_weights}

    plus, slow, fast = one_step(learning_rate, ratio), one_step(learning_rate), one_step(learning_rate * ratio)
    assert {p.rsplit("/", 1)[-1] for p in plus} == set(expected)
    for path, value in plus.items():
        assert not np.allclose(fast[path], slow[path], rtol=1e-5, atol=1e-7), path  # the two rates tell apart
        (rate,) = expected[path.rsplit("/", 1)[-1]]
        np.testing.assert_allclose(value, fast[path] if rate == ratio else slow[path], rtol=1e-5, atol=1e-7,
                                   err_msg=f"{path} should step at {rate} * lr, as PEFT's LoRA+ steps it")  # fmt: skip


def first_block_inputs(lm, tokens, training: bool) -> np.ndarray:
    """The hidden states entering lm's first decoder block when it runs on `tokens` (0 is padding); Gemma 3n's
    block takes its AltUp streams, the first of which is the embeddings."""
    backbone = lm.backbone
    block = families.decoder_blocks(backbone)[0]
    own, seen = block.call, []

    def call(x, *args, **kwargs):
        seen.append(keras.ops.convert_to_numpy(x[0][0] if isinstance(x, (tuple, list)) else x))
        return own(x, *args, **kwargs)

    inputs = {"token_ids": tokens, "padding_mask": (tokens != 0).astype("int32")}
    if "position_ids" in [t.name for t in backbone.inputs]:  # Gemma 4
        inputs["position_ids"] = np.broadcast_to(np.arange(tokens.shape[1], dtype="int32"), tokens.shape)
    block.call = call
    try:
        lm(inputs, training=training)
    finally:
        block.call = own
    return seen[0]


def transformers_block_inputs(embeddings: np.ndarray, tokens, alpha: float) -> tuple:
    """The hidden states entering the first decoder layer of a transformers Gemma whose token embeddings are
    `embeddings`, in eval and then in training with transformers' NEFTune hook (activate_neftune) at `alpha`."""
    import torch
    import transformers
    from transformers.integrations.neftune import activate_neftune

    vocab, width = embeddings.shape
    config = transformers.GemmaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=8, num_hidden_layers=1,
                                      num_attention_heads=1, num_key_value_heads=1, head_dim=8)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GemmaModel(config)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.from_numpy(embeddings))
    activate_neftune(model, alpha)
    seen = []
    model.layers[0].register_forward_pre_hook(lambda layer, args: seen.append(args[0].detach().numpy().copy()))
    ids = torch.from_numpy(tokens).long()
    with torch.no_grad():
        model.eval()
        model(input_ids=ids)
        model.train()
        model(input_ids=ids)
    return seen[0], seen[1]


def test_neftune_noise_is_transformers_size_where_it_enters_the_first_block():
    """On rows without padding (transformers divides by the padded length, we by each row's real tokens), the noise
    on the hidden states entering the first block has the standard deviation of transformers' hook's on the same
    embeddings and alpha: alpha / sqrt(3 L d), before and after Gemma's sqrt(d) scale alike."""
    from conftest import float32_policy

    alpha = 5.0
    with float32_policy():
        lm, _ = build()
        tokens = np.random.default_rng(0).integers(1, 811, size=(16, 32)).astype("int32")
        clean = first_block_inputs(lm, tokens, training=False)
        builder.add_embedding_noise(lm, alpha=alpha, seed=0)
        noisy = first_block_inputs(lm, tokens, training=True)
        embeddings = keras.ops.convert_to_numpy(lm.backbone.token_embedding.embeddings)
    their_clean, their_noisy = transformers_block_inputs(embeddings, tokens, alpha)
    np.testing.assert_allclose(clean, their_clean, rtol=1e-5, atol=1e-5)  # the same embeddings, scaled alike
    ours, theirs = (noisy - clean).std(), (their_noisy - their_clean).std()
    expected = alpha / np.sqrt(3 * tokens.shape[1] * embeddings.shape[1])  # a uniform's std: its half-width / sqrt 3
    assert theirs == pytest.approx(expected, rel=0.02)  # 65536 draws: the std's sampling error is about 0.3%
    assert ours == pytest.approx(theirs, rel=0.02), f"finetune's noise std {ours:.3g}, transformers' {theirs:.3g}"


def test_neftune_adds_bounded_noise_to_real_tokens_while_training_only():
    from conftest import float32_policy

    with float32_policy():
        lm, _ = build()
        tokens = np.array([[2, 50, 61, 72, 0, 0], [2, 50, 61, 72, 83, 94]], dtype="int32")
        clean = first_block_inputs(lm, tokens, training=False)
        builder.add_embedding_noise(lm, alpha=5.0, seed=0)
        noisy = first_block_inputs(lm, tokens, training=True)
        np.testing.assert_array_equal(first_block_inputs(lm, tokens, training=False), clean)  # eval: none
    noise, width = noisy - clean, clean.shape[-1]
    assert not np.any(noise[0, 4:])  # padding takes none
    for row, real in ((0, 4), (1, 6)):
        bound = 5.0 / np.sqrt(real * width)  # alpha / sqrt(non-padding tokens * width)
        assert np.abs(noise[row, :real]).max() <= bound * (1 + 1e-5)
        assert np.abs(noise[row, :real]).max() > 0.9 * bound  # uniform over the whole interval
        assert abs(noise[row, :real].mean()) < 0.1 * bound


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-gemma4", "tiny-gemma3n"])
def test_neftune_noise_entering_the_first_block_is_the_same_size_in_every_family(preset):
    """alpha / sqrt(3 L d), transformers' size: keras-hub scales the embeddings by sqrt(d) after token_embedding in
    Gemma 3 and 4, and inside embed_tokens in Gemma 3n, as transformers does in all of them."""
    from conftest import float32_policy

    with float32_policy():
        backend.set_seed(0)
        lm, _ = builder.build(presets.Source("tiny", preset, presets.TINY[preset].family), seq_len=32)
        tokens = np.random.default_rng(0).integers(1, 100, size=(8, 32)).astype("int32")
        clean = first_block_inputs(lm, tokens, training=False)
        builder.add_embedding_noise(lm, alpha=5.0, seed=0)
        noise = first_block_inputs(lm, tokens, training=True) - clean
    expected = 5.0 / np.sqrt(3 * tokens.shape[1] * noise.shape[-1])  # 8192 draws: the std's error is about 0.7%
    assert noise.std() == pytest.approx(expected, rel=0.04)
