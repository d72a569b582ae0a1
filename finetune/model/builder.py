"""Build the Gemma causal LM, put LoRA on it, compile it.

We use keras-hub's own mechanisms (from_preset, backbone.enable_lora,
save_lora_weights/load_lora_weights) rather than wrapping them. The one thing
keras-hub's backbone.enable_lora lacks is LoRA's alpha; the Keras layers
under it have it, so we set it on each adapted layer after enabling.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from dataclasses import dataclass

import keras
import numpy as np
from keras import ops

from finetune.data import batching
from finetune.model import (
    attention,
    checkpoints,
    experts,
    families,
    layouts,
    lean_torch,
    lora_dropout,
    objective,
    optimizer,
    presets,
    quantized,
    tokens,
)
from finetune.model import remat as rematerialization
from finetune.platform import backend, keras_compat
from finetune.platform.errors import UserError


@dataclass(frozen=True)
class Optimizer:
    """AdamW as compile() sets it up, and the data shards a batch is split over."""

    learning_rate: float
    weight_decay: float
    shards: int = 1
    objective: object = None
    """What the run minimises (its method's: objective.ResponseTokens, pair_view.Objective, ...): an object whose
    view(lm, chunk, shards) is the keras.Model that trains it; None: SFT's response tokens."""


@dataclass(frozen=True)
class Recipe:
    """What build_model makes: the resolved run's model settings, in the model layer's words
    (training/resolve.py's Resolved.recipe)."""

    seq_len: int
    precision: str
    quantize: str | None = None
    remat: bool = False
    lora: object = None
    """The LoRA settings (config.LoraConfig: rank, alpha, targets, dropout, rslora, dora, plus_ratio; see
    enable_lora); None: the base alone."""
    seed: int = 0
    """The numpy seed the LoRA factors, dropout masks and NEFTune noise start from."""
    neftune_alpha: float | None = None
    """NEFTune's noise on the embeddings while training (add_embedding_noise); None: none."""
    optimizer: Optimizer | None = None
    """None: nothing compiled for training (eval, generate, export)."""
    images: bool = False
    """The run's data has pictures (resolve's `images`): a preset whose family leaves its encoders out of a text
    run (Gemma 4) is built with its image encoder and converter, still without its audio encoder."""
    image_tokens: int | None = None
    """A picture's soft tokens (--image-tokens, Gemma 4); None: the preset's own."""
    full: bool = False
    """--full: every weight of the language model trains (train_every_weight); `lora` is None then."""
    keep_base: bool = False
    """With `full`: keep a copy of the base's weights, for a method that scores the base beside the model it trains
    (Method.scores_base; lora_off swaps it in)."""
    added_tokens: tuple = ()
    """--add-tokens: new tokens in the tokenizer, their embedding rows trained beside LoRA (tokens.py)."""


def adapter_recipe(cfg) -> Recipe:
    """The model a finished run's adapter loads onto, nothing compiled: its base as it trained (precision, as
    decided; --quantize), LoRA in its layout, its new tokens, its image encoder where its data had pictures.
    resolve.Resolved.recipe builds on it, and a GRPO reward model (methods/reward.py) is rebuilt by it.

    cfg: config.Config, its precision decided (not auto).
    """
    return Recipe(
        seq_len=cfg.model.seq_len,
        precision=cfg.model.precision,
        quantize=cfg.model.quantize,
        lora=None if cfg.model.full else cfg.lora,
        seed=cfg.train.seed,
        # The data's pictures, as decided (a finished run's config.yaml recorded it): the encoder comes back.
        images=bool(cfg.data.images),
        image_tokens=cfg.data.image_tokens,
        full=cfg.model.full,
        added_tokens=tuple(cfg.model.add_tokens),
    )


@dataclass
class Model:
    """A model build_model made."""

    lm: object
    """The causal LM, preprocessor detached."""
    preprocessor: object
    trainer: object = None
    """compile()'s training view of `lm`; None when the recipe has no optimizer."""
    adapted: int = 0
    """The layers LoRA adapted."""
    added: object = None
    """The new tokens (tokens.Added) where the recipe has some."""

    @property
    def tokenizer(self):
        return self.preprocessor.tokenizer


def build_model(source: presets.Source, recipe: Recipe) -> Model:
    """The one builder: the preset's base (quantized as it loads), LoRA on it, the response-token loss and
    AdamW. Training, `finetune eval`, `generate`, `export` and `bench` all build their model here."""
    lm, preprocessor = build(source, recipe.seq_len, recipe.precision, recipe.quantize, recipe.remat, recipe.images)
    with_image_tokens(source, lm, preprocessor, recipe.image_tokens)
    adapted = 0
    if recipe.lora is not None:
        adapted = enable_lora(lm, recipe.lora, recipe.seed)
    added = tokens.add(lm, preprocessor, recipe.added_tokens)  # after LoRA, which freezes every other layer
    if recipe.full:
        train_every_weight(lm, recipe.keep_base)
    if recipe.neftune_alpha:
        add_embedding_noise(lm, recipe.neftune_alpha, recipe.seed)
    trainer = None
    if recipe.optimizer is not None:
        settings = recipe.optimizer
        plus_ratio = getattr(recipe.lora, "plus_ratio", None)
        trainer = compile(lm, settings.learning_rate, settings.weight_decay, settings.shards, plus_ratio,
                          settings.objective)  # fmt: skip
    return Model(lm, preprocessor, trainer, adapted, added)


def compile_step(model: Model, packed: bool = True) -> tuple[bool, str]:
    """Compile `model`'s train step further (--compile), after its batch size is found (a probe stays eager):
    (whether anything was compiled, what). PyTorch: each decoder block's pass with torch.compile
    (lean_torch.compile_blocks); TensorFlow: XLA, read when the first step makes the train function; JAX: its step
    is compiled by XLA already.

    packed: the rows are packed, so of one length; unpacked rows are cut to eighths of seq_len, as under XLA
    (batching.length_step with compiled), each a graph of its own."""
    name = keras.config.backend()
    if name == "jax":
        return False, "JAX compiles every step already (XLA)"
    if name == "tensorflow":
        model.trainer.jit_compile = True
        return True, "XLA (jit_compile)"
    total = len(families.decoder_blocks(model.lm.backbone))
    if getattr(model.lm.backbone, "lora_dropout_passes", None) is not None:
        # Each mask is drawn from a count read on the host (lora_dropout.dropped): a graph break in every layer.
        return False, f"the {total} decoder blocks stay eager: LoRA dropout draws its masks on the host"
    blocks = lean_torch.compile_blocks(model.lm.backbone)
    if not blocks:
        return False, f"the {total} decoder blocks stay eager: remat and Gemma 3n's blocks take no compiled pass"
    lengths = "" if packed else ("; unpacked rows are cut to eighths of --seq-len, each length compiled once: packed "
                                 "rows (one length) pad less")  # fmt: skip
    return True, f"torch.compile of {blocks} of {total} decoder blocks{lengths}"


def embedding_ratio(embedding_learning_rate: float | None, learning_rate: float) -> float | None:
    """--embedding-lr as a multiple of the run's learning rate (the new rows follow its schedule); None: the same.
    A run's steps take it from train_with's controls (training/train.py), as its schedule and clipping."""
    return None if embedding_learning_rate is None else embedding_learning_rate / learning_rate


def build(source: presets.Source, seq_len: int, precision: str = "float32", quantize: str | None = None,
          remat: bool = False, images: bool = False):  # fmt: skip
    """The causal LM (without preprocessor attached) and its preprocessor, ready for LoRA.

    Its decoder blocks take segment ids where keras-hub takes `padding_mask`
    (attention.py), so packed rows train exactly; one-example rows are unchanged.

    precision: str. A key of backend.POLICIES: the dtype the frozen base is stored and computed in.
    quantize: str. int4 (or int8): the decoder kernels are built quantized and
        filled layer by layer (quantized.py), as QLoRA loads its base; the LoRA
        factors stay in float.
    remat: bool. Recompute each decoder block's activations in the backward
        pass instead of keeping them (remat.py).
    images: bool. The run's data has pictures: see load_base.
    """
    why = families.get(source.family).no_quantize if quantize is not None else None
    if why:
        raise UserError(f"--quantize {quantize} is not for {families.get(source.family).title} yet: {why}")
    lm, preprocessor = load_base(source, seq_len, backend.POLICIES[precision][0], quantize, images)
    attention.enable(lm.backbone)
    lean_torch.enable(lm.backbone)  # PyTorch: less host work per step, the same tensors
    effective_kernels(lm.backbone, families.get(source.family).read_kernels)
    experts.install(lm.backbone, routed_experts()[0])
    for layer in quantized.quantized_layers(lm.backbone):
        beside_the_kernel(layer)  # its kernel dequantized only when its input arrives
    if remat:
        rematerialization.enable(lm.backbone)
    lm.compile(sampler="greedy")  # for generate(): training goes through compile()'s view, not lm
    return lm, preprocessor


def routed_experts() -> tuple[bool, str]:
    """(whether a mixture-of-experts bank computes each token's k experts alone, why), on this process' backend,
    device and distribution (backend.routed_experts_rule, which the plan asks offline)."""
    distribution = keras.distribution.distribution()
    devices = 1 if distribution is None else int(np.prod(distribution.device_mesh.shape))
    return backend.routed_experts_rule(keras.config.backend(), backend.accelerator(), devices)


def load_base(source: presets.Source, seq_len: int, dtype: str | None = None, quantize: str | None = None,
              images: bool = False, image_tokens: int | None = None):  # fmt: skip
    """The preset's causal LM (preprocessor detached) and its preprocessor, as keras-hub builds them.

    No hooks: what `finetune export` merges into and saves.
    dtype: str. The Keras dtype policy of the weights; None takes the global one.
    quantize: str. int4 or int8: the decoder kernels are quantized as they load (quantized.py).
    images: bool. The run's data has pictures: a multimodal preset keeps its image encoder and converter
        (families.Family.left_out). A tiny preset is built as it is either way.
    image_tokens: int. A picture's soft tokens (Gemma 4's --image-tokens): the preprocessor writes that many
        for each picture, and its image converter resizes pictures to that many tokens' patches; None keeps the
        preset's.
    """
    if keras.config.backend() == "tensorflow":
        keras_compat.exact_tensorflow_adds()  # keras-hub's Gemma 3 places pictures with an add keras misreads
    with keras_compat.collections_of_new_objects_only():  # a quantized build deletes every float kernel
        lm, preprocessor = _load_base(source, seq_len, dtype, quantize, images)
    keras_compat.gemma3n_clip_padding(lm.backbone)  # a clip's tail as transformers' model reads it
    with_image_tokens(source, lm, preprocessor, image_tokens)
    return lm, preprocessor


def with_image_tokens(source: presets.Source, lm, preprocessor, tokens: int | None) -> None:
    """A picture's soft tokens (--image-tokens) in the preprocessor and its image converter; None keeps the
    preset's. build_model and load_base (export's merged base) both set them here."""
    if tokens is not None:
        families.get(source.family).check_image_tokens(tokens)
        pooled_as_encoded(preprocessor, lm.backbone, tokens)


def _load_base(source: presets.Source, seq_len: int, dtype: str | None, quantize: str | None, images: bool):
    policy = dtype or keras.config.dtype_policy().name
    if quantize is not None:
        rules = layouts.RULES if source.kind == "random" else layouts.rules_for(presets.dims(source))
        policy = quantized.policies(policy, quantize, rules)
    family = families.get(source.family)
    cls = families.keras_hub_class(family)
    if source.kind == "random":
        return _random_base(source, seq_len, policy, quantize)
    if source.kind == "tiny":
        tokenizer = presets.tiny_tokenizer(source.handle)
        backbone = presets.tiny_backbone(tokenizer.vocabulary_size(), dtype=policy, name=source.handle)
        quantized.weights_only(backbone)
        preprocessor = presets.tiny_preprocessor(source.handle, tokenizer, seq_len)
        return cls(backbone=backbone, preprocessor=None), preprocessor
    try:
        with zeros_until_loaded():
            if source.transformers:
                lm = _from_transformers(cls, family, source, policy, quantize, images)
            else:
                lm = _from_preset(cls, family, source.handle, policy, quantize, images)
    except (OSError, ValueError) as e:
        raise UserError(f"could not load preset {source.handle}: {str(e).splitlines()[0]}") from None
    except KeyError as e:  # a converter's weight name the safetensors lack
        raise UserError(f"could not load preset {source.handle}: its weights lack {e}") from None
    preprocessor, lm.preprocessor = lm.preprocessor, None
    preprocessor.sequence_length = seq_len
    return lm, preprocessor


def _random_base(source: presets.Source, seq_len: int, policy, quantize: str | None):
    """`finetune bench`'s model: a Gemma architecture of the source's family with random weights (quantized ones
    filled at random layer by layer, so the float base never exists), and a text preprocessor of the bench's
    tokenizer. The preprocessor is Gemma's (sentencepiece alone) for every family: on text it prepares what
    Gemma 3's and 4's would, and theirs need TensorFlow, which a GPU machine for JAX or PyTorch may lack."""
    import keras_hub

    config = dict(source.random)
    tokenizer = keras_hub.models.GemmaTokenizer(proto=config.pop("tokenizer"))
    family = families.get(source.family)
    backbone = families.keras_hub_class(family, "backbone")(dtype=policy, **config)
    if quantize is not None:
        quantized.weights_only(backbone)
        quantized.fill_random(backbone)
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=seq_len)
    return families.keras_hub_class(family)(backbone=backbone, preprocessor=None), preprocessor


# A variable of at least this many float values starts as zeros in zeros_until_loaded(): the decoder's kernels
# and the embedding, not the norm scales or a random seed's state.
_LARGE = 1 << 16


def zeros_until_loaded():
    """Build a base whose large float variables start as zeros, because a preset's weights replace them next
    (keras_compat.large_variables_start_as_zeros says what keras' draw cost). The bench's random base keeps
    keras' draws: it has no weights to load."""
    return keras_compat.large_variables_start_as_zeros(_LARGE)


def load_tokenizer(source: presets.Source):
    """The preset's tokenizer alone: what `finetune data` counts tokens with, without building the model."""
    if source.kind == "tiny":
        return presets.tiny_tokenizer(source.handle)
    cls = families.keras_hub_class(families.get(source.family), "tokenizer")
    try:
        if source.transformers:
            return _transformers_tokenizer(source)
        return cls.from_preset(source.handle)
    except (OSError, ValueError) as e:
        raise UserError(f"could not load the tokenizer of {source.handle}: {str(e).splitlines()[0]}") from None


def load_preprocessor(source: presets.Source, seq_len: int):
    """The preset's preprocessor with its image and audio converters, without the model: what `finetune data`
    writes a record's pictures and clips as the preset's soft tokens with. A transformers checkpoint's is made
    with its model (_from_transformers): a UserError here."""
    if source.kind == "tiny":
        return presets.tiny_preprocessor(source.handle, presets.tiny_tokenizer(source.handle), seq_len)
    if source.transformers or source.kind == "random":
        raise UserError(f"{source.handle}'s preprocessor is made with its model")
    cls = families.keras_hub_class(families.get(source.family))
    try:
        return cls.preprocessor_cls.from_preset(source.handle, sequence_length=seq_len)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"could not load the preprocessor of {source.handle}: {str(e).splitlines()[0]}") from None


def _from_preset(cls, family, handle: str, dtype, quantize: str | None, images: bool):
    """The preset's causal LM as keras-hub's from_preset builds it, without the encoders the run does not feed,
    and quantized as it loads.

    A multimodal preset (Gemma 4, 3n) is built for text without its image and
    audio encoders: their inputs would have to be fed to every step. The
    backbone is built from the preset's config with them left out and takes the
    preset's weights (the encoders' are not read), and the preprocessor goes
    without its converters; its text logits are the full model's
    (tests/test_families.py). A run on pictures keeps Gemma 4's image encoder
    and converter (family.left_out). With `quantize`, each decoder kernel is
    quantized as keras reads it from the weights file (quantized.py).
    """
    encoders, converters = family.left_out(images)
    if not encoders and quantize is None:
        return cls.from_preset(handle, dtype=dtype)
    loader = keras_compat.preset_loader(handle)
    loader.config["config"].update(encoders)
    backbone = loader.load_backbone(cls.backbone_cls, load_weights=quantize is None, dtype=dtype)
    if quantize is not None:
        quantized.weights_only(backbone)
        quantized.load_while_quantizing(backbone)
        keras_compat.load_backbone_weights(loader, backbone)
    preprocessor = cls.preprocessor_cls.from_preset(handle, **dict.fromkeys(converters))
    pooled_as_encoded(preprocessor, backbone)
    return cls(backbone=backbone, preprocessor=preprocessor)


def pooled_as_encoded(preprocessor, backbone, tokens: int | None = None) -> None:
    """Make a Gemma 4 image converter resize pictures to the patches its vision encoder pools into the
    preprocessor's soft tokens; with `tokens`, that many soft tokens a picture (--image-tokens) in both.

    keras-hub 0.32's Gemma4ImageConverter.get_config saves its patch size alone, so a saved preset's converter
    comes back with Gemma 4's 280 soft tokens pooled 3x3, whatever its encoder pools: a picture of another
    preset (tiny-gemma4-vision saved, or its merged export) would be cut into patches its encoder cannot place.
    The real presets' sizes are those defaults, and keep them.
    """
    converter = getattr(preprocessor, "image_converter", None)
    encoder = getattr(backbone, "vision_encoder", None)
    if converter is None or encoder is None or not hasattr(converter, "pooling_kernel_size"):
        return
    if tokens is not None:
        preprocessor.num_vision_tokens_per_image = tokens
    tokens, pool = preprocessor.num_vision_tokens_per_image, encoder.pool_size
    if (converter.max_soft_tokens, converter.pooling_kernel_size) != (tokens, pool):
        config = dict(converter.get_config(), max_soft_tokens=tokens, pooling_kernel_size=pool)
        preprocessor.image_converter = type(converter).from_config(config)


def _from_transformers(cls, family, source: presets.Source, dtype, quantize: str | None, images: bool):
    """A transformers checkpoint's causal LM, converted by keras-hub as it loads (checkpoints.py), without the
    encoders the run does not feed.

    keras-hub's loader lets keyword arguments override the config its converter maps, so the encoders a run
    leaves out (family.left_out) are never built, and its converter ports no weights to them; a run on pictures
    keeps Gemma 4's vision tower, which the converter ports. The preprocessor is made from the tokenizer, and
    for pictures the image converter keras-hub maps from processor_config.json: a transformers checkpoint has
    no keras-hub preprocessor config, and load_base sets its sequence length.
    """
    if quantize is not None:
        raise UserError(
            f"--quantize {quantize} quantizes a keras-hub preset's weights as they load, and {source.handle} is a "
            "transformers checkpoint, converted as it loads; train it in float, or save it once as a keras-hub "
            "preset (keras_hub.models.CausalLM.from_preset(...).save_to_preset(DIR)) and pass DIR"
        )
    loader = keras_compat.preset_loader(source.handle)
    encoders, converters = family.left_out(images)
    overrides = {**encoders, **checkpoints.converter_overrides(loader.config, family.name)}
    backbone = loader.load_backbone(cls.backbone_cls, load_weights=True, dtype=dtype, **overrides)
    tokenizer = _transformers_tokenizer(source)
    kept = {}
    if "image_converter" in family.converters and "image_converter" not in converters:
        converter = loader.load_image_converter(cls.preprocessor_cls.image_converter_cls)  # None: no vision_config
        if converter is not None:  # keras-hub's preprocessor would take Gemma 4's 280 soft tokens, whatever it says
            kept = dict(image_converter=converter, num_vision_tokens_per_image=converter.max_soft_tokens)
    preprocessor = cls.preprocessor_cls(tokenizer=tokenizer, **dict.fromkeys(converters), **kept)
    return cls(backbone=backbone, preprocessor=preprocessor)


def _transformers_tokenizer(source: presets.Source):
    """keras-hub's converter's tokenizer, or, where it cannot read tokenizer.json, one from tokenizer.model."""
    from pathlib import Path

    proto = checkpoints.unigram_tokenizer(Path(source.handle)) if source.kind == "local" else None
    if proto is not None and source.family == "gemma4":
        return presets.text_tokenizer(source.family, proto)
    cls = families.keras_hub_class(families.get(source.family), "tokenizer")
    return cls.from_preset(source.handle)


def input_names(lm) -> tuple[str, ...]:
    """What a batch must feed `lm` (batching.inputs makes each): token ids, padding mask, maybe positions, and
    for a model with a vision encoder its image and audio inputs (batching.MEDIA).

    The backbone's inputs, which every view feeds: keras-hub's Gemma 3n causal LM declares picture and clip indices
    and masks that its backbone never reads (it places the batch's pictures and clips by their order in the whole
    batch). Without them among the names, batching lays the media out in that order (images.in_batch_order)."""
    names = tuple(tensor.name for tensor in keras.tree.flatten(lm.backbone.inputs))
    fed = ("token_ids", "padding_mask", "position_ids", *batching.MEDIA)
    others = [name for name in names if name not in fed]
    if others:
        raise UserError(
            f"this preset's model also takes {', '.join(others)}; finetune trains on text, and needs a text-only model"
        )
    return names


def lora_weight_names(layer) -> tuple[str, ...]:
    """The LoRA weights an adapted layer holds, in the order adapter.lora.h5 keeps them: a dense layer's A and B
    (keras-hub's names) and DoRA's magnitude beside them, or an expert bank's A and B of each projection."""
    if experts.is_bank(layer):
        return experts.FACTORS
    dora = ("lora_magnitude",) if getattr(layer, "lora_magnitude", None) is not None else ()
    return ("lora_kernel_a", "lora_kernel_b", *dora)


def load_lora_weights(backbone, path) -> None:
    """Each adapted layer's LoRA weights (lora_weight_names) from a .lora.h5 at `path`, as keras-hub's
    load_lora_weights reads them (lora/<layer index>/<name>), DoRA's magnitudes and the experts' factors too,
    which keras-hub's reader does not know. Raises OSError, KeyError or ValueError on a file that does not fit."""
    layers = [layer for layer in backbone._flatten_layers(include_self=False) if layer.weights]
    store = keras_compat.h5_store(path, mode="r")
    try:
        if int(store.get("lora")["rank"][()]) != backbone._lora_rank:
            raise ValueError(f"its LoRA rank is {int(store.get('lora')['rank'][()])}, not {backbone._lora_rank}")
        for index in backbone._lora_enabled_layers:
            entry = store.get(f"lora/{index}")
            for name in lora_weight_names(layers[index]):
                getattr(layers[index], name).assign(entry[name])
    finally:
        store.close()


def adaptable_layer_names(backbone) -> set[str]:
    """Layers whose LoRA factors keras-hub can save and load.

    backbone.save_lora_weights writes `lora_kernel_a/b`, which only dense layers
    have. The token embedding has enable_lora too, but its factors are named
    `lora_embeddings_a/b`, and saving them fails after the whole training.
    """
    dense = (keras.layers.Dense, keras.layers.EinsumDense)
    return {
        layer.name
        for layer in backbone._flatten_layers(include_self=False)
        if isinstance(layer, dense) and hasattr(layer, "enable_lora")
    }


def enable_lora(lm, lora, seed: int = 0) -> int:
    """LoRA on the named layers, everything else frozen; returns the count of adapted layers.

    lora: the LoRA settings, an object with rank, alpha, targets, dropout, rslora and dora, and
        scale() (config.LoraConfig). targets are LoRA target names (query, value, ...: the same for
        every family, families.TARGETS), PEFT's names for them, all-linear, or the family's own layer names.
    seed: int. The LoRA factors (and the dropout masks) start from this numpy seed, not from the
        backend's own generator, so every backend trains the same model.
    """
    backbone = lm.backbone
    names = lora_layer_names(backbone, lora.targets)
    for message in families.expert_conflicts(lora.targets, lora.dora, lora.dropout):
        raise UserError(message)  # as the run's config refused it (config.LoraConfig.conflicts)
    choices = ", ".join(adaptable_targets(backbone))
    _adapter_dtype(backbone, names)
    lora_on_the_decoder(backbone, lora.rank, names)
    adapted = [layer for layer in backbone._flatten_layers(include_self=False) if getattr(layer, "lora_enabled", False)]
    # A name shared with a non-dense layer enables that one too; refuse now rather than at save time.
    unsavable = [layer.name for layer in adapted if not hasattr(layer, "lora_kernel_a") and not experts.is_bank(layer)]
    if unsavable:
        raise UserError(
            f"layer {unsavable[0]!r} cannot be adapted (keras-hub saves LoRA of dense layers only); choose from {choices}"
        )
    for layer in adapted:
        # The layer scales its update by lora_alpha / lora_rank: keras' own call (JAX) and ours (beside_the_kernel)
        # then both scale by alpha / rank, or alpha / sqrt(rank) with rslora.
        layer.lora_alpha = lora.scale() * lora.rank
    initialise_lora(adapted, seed)
    read = [layer.name for layer in adapted if getattr(layer, "kernel_read_directly", False)]
    if lora.dropout and read:
        raise UserError(
            f"--lora-dropout on layer {read[0]!r}: this model's blocks multiply by its kernel themselves (keras-hub's "
            "Gemma 4 FFW), so dropout of its input cannot act; drop --lora-dropout or target the attention layers"
        )
    if lora.dropout:
        lora_dropout.enable(backbone, adapted, lora.dropout, seed)
    for layer in adapted:
        if experts.is_bank(layer):
            continue  # its call, LoRA included, is experts.install's
        if lora.dora and quantized.policy_of(layer).quantization_mode is not None:
            raise UserError(
                f"DoRA needs a float kernel, and layer {layer.name} is quantized; drop --dora or --quantize"
            )
        with keras_compat.adding_variables(layer):
            if lora.dora:
                # Read as float32 in the layer's call too: autocast to a bfloat16 compute dtype, m / |W| was 1 only
                # to bfloat16's rounding, and a fresh DoRA adapter moved a bfloat16 run off its base.
                layer.lora_magnitude = layer.add_weight(
                    name="lora_magnitude",
                    shape=magnitude_shape(layer),
                    initializer="zeros",
                    dtype="float32",
                    autocast=False,
                )
                layer.lora_magnitude.assign(keras.ops.convert_to_numpy(_column_norm(layer, with_update=False)))
        beside_the_kernel(layer, own_call=bool(lora.dora or lora.dropout))
    return len(adapted)


def effective_kernels(backbone, names: tuple) -> int:
    """Make the `kernel` of the decoder's layers named `names` the one their block should multiply by.

    keras-hub's Gemma 4 blocks compute their FFW as x @ layer.kernel rather than calling the layer, so neither a
    quantized layer's call (its kernel comes without its scales) nor ours (beside_the_kernel: DoRA) would act.
    Each such layer's class becomes a subclass whose `kernel` is the effective kernel: the float kernel, or the
    quantized one dequantized as its call would; plus s A B under LoRA; under DoRA scaled per output to
    m / |W + s A B| (the norm held constant, as _with_lora), which x @ kernel makes exactly PEFT's DoRA output.
    Returns how many layers were changed.
    """
    if not names:
        return 0
    inside = {id(layer) for encoder in encoders(backbone) for layer in encoder._flatten_layers()}
    changed = 0
    for block in families.decoder_blocks(backbone):
        for layer in block._flatten_layers(include_self=False):
            if layer.name in names and id(layer) not in inside and hasattr(layer, "_kernel"):
                layer.__class__ = _read_directly(type(layer))
                changed += 1
    return changed


@functools.cache
def _read_directly(cls):
    return type(f"ReadDirectly{cls.__name__}", (cls,), {"kernel": property(_effective_kernel),
                                                         "kernel_read_directly": True})  # fmt: skip


def _effective_kernel(layer):
    mode = getattr(layer, "quantization_mode", None)
    if mode in quantized.MODES:
        stored, dequantize = quantized.stored_and_dequantize(layer)
        kernel = dequantize(*(ops.convert_to_tensor(w) for w in stored))
    elif not getattr(layer, "lora_enabled", False):
        return layer._kernel  # the variable, as keras' own property gives it (export merges into it)
    else:
        kernel = ops.cast(layer._kernel, layer.compute_dtype)
    if not getattr(layer, "lora_enabled", False):
        return kernel
    compute = layer.compute_dtype
    update = ops.matmul(ops.cast(layer.lora_kernel_a, compute), ops.cast(layer.lora_kernel_b, compute))
    kernel = ops.add(kernel, ops.cast(layer.lora_alpha / layer.lora_rank, compute) * update)
    if getattr(layer, "lora_magnitude", None) is None:
        return kernel
    norm = ops.stop_gradient(_column_norm(layer, with_update=True))
    return ops.multiply(kernel, ops.cast(ops.divide(layer.lora_magnitude, norm), compute))


def encoders(backbone) -> list:
    """The backbone's image and audio encoders it has (Gemma 3 and 4 with pictures, 3n), beside its text decoder."""
    found = (getattr(backbone, name, None) for name in ("vision_encoder", "audio_encoder"))
    return [encoder for encoder in found if encoder is not None]


def lora_on_the_decoder(backbone, rank: int, names: list[str]) -> None:
    """keras-hub's backbone.enable_lora on the layers of these names outside the image and audio encoders, and
    our LoRA on the expert banks among them (experts.enable_lora).

    keras-hub matches layer names across the whole backbone, and Gemma 4's vision encoder is made of Gemma 4
    blocks whose layers bear the decoder's names (query, value, ffw_gating...): `--target query` would adapt the
    encoder too. Its own bookkeeping (which layers are adapted, the rank) is what save_lora_weights and
    load_lora_weights index by, so it is kept: the backbone enables no layer, then each chosen one is enabled
    and counted as it would have.
    """
    inside = {id(layer) for encoder in encoders(backbone) for layer in encoder._flatten_layers()}
    backbone.enable_lora(rank, target_layer_names=[])  # freezes every layer, and counts none
    with_weights = [layer for layer in backbone._flatten_layers(include_self=False) if layer.weights]
    for index, layer in enumerate(with_weights):
        if layer.name not in names or id(layer) in inside:
            continue
        if hasattr(layer, "enable_lora"):
            layer.trainable = True
            layer.enable_lora(rank)
            backbone._lora_enabled_layers.append(index)
        elif experts.is_bank(layer):
            experts.enable_lora(layer, rank)
            backbone._lora_enabled_layers.append(index)


def beside_the_kernel(layer, own_call: bool = False) -> bool:
    """Give `layer` our own call: its kernel's projection, then its LoRA beside it, x W + s (x A) B.

    Keras merges the factors into the kernel each call, W + s A B: a kernel-sized
    float32 sum and cast per layer and step, and in the backward a kernel-sized
    gradient (x^T dy, one full matmul per adapted layer) that only A and B need
    in their rank-r form. Beside the kernel, the factors take two thin matmuls
    in the compute dtype, as PEFT does under autocast; the layer's weights, what
    it saves and what export merges are unchanged. Measured at gemma-2b dims
    on an Intel Xeon with AMX: PyTorch 96 to 106 tokens/s, TensorFlow 68 to 76.

    A quantized layer's projection dequantizes its kernel only when its input
    (or gradient) arrives (quantized.lean_projection), on every backend and
    whether or not LoRA adapts it. A float layer keeps Keras' call on JAX (not
    measured to pay there: its one run with this also had a slower loss) and
    where the equation's kernel's last axis is not the output's last, unless
    `own_call`: LoRA dropout and DoRA are ours to compute, so they take our call
    on every backend. Returns whether the call was replaced. The LoRA part
    follows the layer's `lora_enabled` when it is called, so this can come
    before enable_lora.
    """
    from keras.layers import Dense, EinsumDense

    project = quantized.lean_projection(layer)
    down = None
    ours = own_call or keras.config.backend() != "jax"
    if isinstance(layer, EinsumDense):
        operands, out = layer.equation.split("->")
        _, kernel = operands.split(",")
        if kernel[-1] == out[-1] and "." not in layer.equation:
            rank_axis = next(c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in layer.equation)
            down = f"{operands[: operands.index(',')]},{kernel[:-1]}{rank_axis}->{out[:-1]}{rank_axis}"
        if project is None and down is not None and ours:
            project = functools.partial(_einsum, layer.equation, weight=lambda: layer._kernel)
    elif isinstance(layer, Dense) and getattr(layer, "quantization_mode", None) is None:
        down = "matmul"
        if ours:
            project = functools.partial(_einsum, "matmul", weight=lambda: layer._kernel)
    if project is None:
        if own_call:
            raise UserError(f"LoRA dropout and DoRA are not built for layer {layer.name} ({type(layer).__name__})")
        return False

    def call(inputs, training=None):
        if layer.lora_enabled and getattr(layer, "lora_in_torch", False) and down not in (None, "matmul"):
            x = _with_lora_in_torch(layer, down, inputs, training)
            if x is not None:
                return x
        x = project(inputs)
        if layer.lora_enabled:
            if down is None:
                raise ValueError(f"{layer.name}: LoRA beside a kernel of equation {layer.equation} is not built")
            x = _with_lora(layer, (down, project), inputs, x, training)
        if layer.bias is not None:
            x = ops.add(x, layer.bias)
        if layer.activation is not None:
            x = layer.activation(x)
        return x

    keras_compat.replace_call(layer, call)
    return True


def _with_lora_in_torch(layer, down: str, inputs, training):
    """The call above, x W + s (x A) B with the bias, in the torch ops keras' ops call, for a float layer whose
    input, kernel and compute dtype agree (keras then casts nothing; float16 on a CPU where keras' matmul keeps it,
    keras_compat.keep_float16_matmuls), with no DoRA, no activation and no dropout while training; an
    EinsumDense's (lean_torch marks no other). None where any of that does not hold: the call takes keras' ops. PyTorch with lean ops on
    (lean_torch.enable marks the layers: `lora_in_torch`): keras' op wrappers cost more host time a LoRA layer
    than its five kernels on a GPU. Bit for bit keras' (tests/test_lean_torch.py)."""
    import torch

    compute = keras_compat.torch_dtype(layer.compute_dtype)
    if (
        type(inputs) is not torch.Tensor
        or inputs.dtype != compute
        or inputs.device.type == "meta"
        or (compute == torch.float16 and inputs.device.type == "cpu" and not keras_compat.float16_matmuls_kept())
        or getattr(layer, "lora_magnitude", None) is not None
        or (training and getattr(layer, "lora_dropout", 0.0))
        or getattr(layer, "quantization_mode", None) is not None
        or layer.activation not in (None, keras.activations.linear)  # linear gives its input back
    ):
        return None
    kernel = ops.convert_to_tensor(layer._kernel)  # each variable as keras' ops read it, in its autocast scope
    if kernel.dtype != compute:
        return None
    a, b = (ops.convert_to_tensor(v).to(compute) for v in (layer.lora_kernel_a, layer.lora_kernel_b))
    projected, low = torch.einsum(layer.equation, inputs, kernel), torch.einsum(down, inputs, a)
    x = torch.add(projected, _lora_scale(layer, inputs.device) * torch.matmul(low, b))
    return x if layer.bias is None else torch.add(x, ops.convert_to_tensor(layer.bias))


def _lora_scale(layer, device):
    """s = alpha / rank as keras' cast makes it (on keras' device, in the compute dtype), made once for each
    `device` the inputs come on, outside inference mode, so that a step after a generation can save it for its
    backward."""
    import torch

    key = (layer.lora_alpha, layer.lora_rank, layer.compute_dtype, device)
    kept = getattr(layer, "_lora_scale_kept", None)
    if kept is None or kept[0] != key:
        with torch.inference_mode(False), torch.no_grad():
            kept = (key, ops.cast(layer.lora_alpha / layer.lora_rank, layer.compute_dtype))
        layer._lora_scale_kept = kept
    return kept[1]


def _with_lora(layer, projections: tuple, inputs, projected, training):
    """The layer's output `projected` (x W) with its LoRA update: + s (x A) B, with dropout on the x of x A while
    training (PEFT's lora_dropout), and under DoRA as PEFT's DoraLinearLayer computes it:
    m / |W + s A B| (x W + s (x A) B), the column norm held constant (detached), as the DoRA paper's section 4.3
    suggests. With dropout, PEFT's DoRA keeps x W undropped: x W + (m / |.| - 1) x' W + m / |.| s (x' A) B."""
    down, project = projections  # x -> x A's einsum, and x -> x W
    compute = layer.compute_dtype
    dropout = getattr(layer, "lora_dropout", 0.0)
    x = inputs
    if dropout and training:
        x = lora_dropout.dropped(inputs, dropout, layer.lora_dropout_seed)
    low = _einsum(down, x, weight=lambda: ops.cast(layer.lora_kernel_a, compute))
    update = ops.matmul(low, ops.cast(layer.lora_kernel_b, compute))
    update = ops.cast(layer.lora_alpha / layer.lora_rank, compute) * update
    if getattr(layer, "lora_magnitude", None) is None:
        return ops.add(projected, update)
    norm = ops.stop_gradient(_column_norm(layer, with_update=True))
    ratio = ops.cast(ops.divide(layer.lora_magnitude, norm), compute)
    if x is inputs:
        return ops.multiply(ratio, ops.add(projected, update))
    dropped = project(x)
    return ops.add(projected, ops.add(ops.multiply(ratio - 1, dropped), ops.multiply(ratio, update)))


def reduced_axes(layer) -> tuple[int, ...]:
    """The kernel's axes an output sums over (its input side): DoRA's column norm is taken over them."""
    equation = getattr(layer, "equation", None)
    if equation is None:  # Dense: (in, out)
        return (0,)
    operands, out = equation.split("->")
    kernel = operands.split(",")[1]
    kept = [c for c in kernel if c in out]
    if "".join(kept) != out[len(out) - len(kept) :]:
        raise UserError(
            f"DoRA is not built for layer {layer.name}: its kernel's outputs are not its output's last axes"
        )
    return tuple(i for i, c in enumerate(kernel) if c not in out)


def magnitude_shape(layer) -> tuple[int, ...]:
    """DoRA's magnitudes of `layer`, one per output: its kernel's shape without the axes its outputs sum over."""
    axes = reduced_axes(layer)
    return tuple(int(d) for i, d in enumerate(layer._kernel.shape) if i not in axes)


def _column_norm(layer, with_update: bool):
    """|W + s A B| per output, in float32, as PEFT's get_weight_norm (the L2 norm of each output's row)."""
    weight = ops.cast(layer._kernel, "float32")
    if with_update:
        scale = layer.lora_alpha / layer.lora_rank
        # In float32 whatever the policy: under bfloat16 keras autocasts the factors, and TensorFlow refused to add
        # the bfloat16 product to the float32 kernel (AddV2), so DoRA did not train on TensorFlow in bfloat16.
        factors = [ops.cast(ops.convert_to_tensor(k), "float32") for k in (layer.lora_kernel_a, layer.lora_kernel_b)]
        weight = weight + scale * ops.matmul(*factors)
    return ops.sqrt(ops.sum(ops.square(weight), axis=reduced_axes(layer)))


def add_embedding_noise(lm, alpha: float, seed: int = 0) -> None:
    """NEFTune: uniform noise in [-1, 1] times alpha / sqrt(L d) on the embeddings entering the first decoder
    block while training, L a row's non-padding tokens and d the width, as the NEFTune authors' code scales it per
    example; padding positions get none. Eval and generation see none.

    transformers' neftune_post_forward_hook adds its noise to the embedding layer's output, and transformers'
    Gemma embedding layers multiply by sqrt(d) inside, so it enters the first block at that size (divided by the
    padded length, where we take L). keras-hub's Gemma, Gemma 3 and 4 multiply by sqrt(d) after token_embedding,
    so the noise is drawn sqrt(d) smaller there: added at full size it entered the block sqrt(d) times
    transformers' (11x on the tiny preset, 45x on gemma-2b). Gemma 3n's embed_tokens scales inside, as
    transformers' does.
    """
    backbone = lm.backbone
    if hasattr(backbone, "language_model"):  # Gemma 3n
        layer, scaled_after = backbone.language_model.embed_tokens, False
    else:
        layer, scaled_after = backbone.token_embedding, True
    own = layer.call
    with keras_compat.adding_variables(layer):
        layer.neftune_seed = keras.random.SeedGenerator(seed)

    def call(inputs, training=None, **kwargs):
        x = own(inputs, **kwargs)
        if kwargs.get("reverse") or not training or not alpha:
            return x
        real = ops.cast(ops.not_equal(inputs, 0), x.dtype)[..., None]  # batching pads rows with id 0 (<pad>)
        tokens = ops.maximum(ops.sum(real, axis=-2, keepdims=True), 1)
        width = ops.cast(ops.shape(x)[-1], x.dtype)
        size = ops.cast(alpha, x.dtype) / ops.sqrt(tokens * width)
        if scaled_after:
            size = size / ops.sqrt(width)
        noise = keras.random.uniform(ops.shape(x), -1.0, 1.0, dtype=x.dtype, seed=layer.neftune_seed)
        return ops.add(x, noise * size * real)

    keras_compat.replace_call(layer, call, takes_training=True)


def _einsum(equation: str, inputs, weight):
    """inputs times weight(): an einsum, or a matmul where `equation` says so."""
    if equation == "matmul":
        return ops.matmul(inputs, weight())
    return ops.einsum(equation, inputs, weight())


def adaptable_targets(backbone) -> list[str]:
    """The LoRA target names this backbone has layers for (families.TARGETS, in order)."""
    family = families.of_backbone(backbone)
    available = adaptable_layer_names(backbone)
    return [t for t in families.TARGETS if family.layer_of(t) in available]


def lora_layer_names(backbone, targets: list[str]) -> list[str]:
    """The keras-hub layer names `targets` adapt on this backbone; a UserError for one it cannot."""
    family = families.of_backbone(backbone)
    banks = {bank.name for bank in experts.banks(backbone)}
    available = adaptable_layer_names(backbone) | banks
    adaptable = adaptable_targets(backbone)
    choices = ", ".join(adaptable + ([families.EXPERTS] if banks else []))
    names = []
    for target in families.spelled_out(targets, adaptable):
        if target == families.EXPERTS and not banks:
            raise UserError(family.without_experts("this model"))
        name = family.layer_of(target)
        why = family.frozen_reason(name)
        if why is not None:
            raise UserError(f"{family.title}'s {target!r} layers stay frozen: {why}; LoRA adapts {choices}")
        if name not in available:
            if name in {layer.name for layer in backbone._flatten_layers(include_self=False)}:
                raise UserError(
                    f"layer {target!r} cannot be adapted (keras-hub saves LoRA of dense layers only); "
                    f"choose from {choices}"
                )
            raise UserError(f"no layer named {target!r} to adapt in this model; choose from {choices}")
        if name not in names:
            names.append(name)
    return names


def _adapter_dtype(backbone, targets) -> None:
    """Give the layers LoRA adapts the global (adapter) policy's variable dtype for their factors.

    keras' enable_lora makes the factors in the layer's variable dtype. A base
    stored in bfloat16 would make them bfloat16, and AdamW's small updates
    round away in bf16; with the layer's policy made mixed (same compute dtype)
    the factors are float32 and the kernel keeps its stored dtype.
    """
    adapter = keras.config.dtype_policy()
    for layer in backbone._flatten_layers(include_self=False):
        if layer.name not in targets or not hasattr(layer, "enable_lora"):
            continue
        current = quantized.policy_of(layer)
        if current.variable_dtype == adapter.variable_dtype or current.compute_dtype != adapter.compute_dtype:
            continue
        if current.quantization_mode is None:
            layer.dtype_policy = adapter.name
        else:  # int4/128_from_bfloat16 -> int4/128_from_mixed_bfloat16
            layer.dtype_policy = f"{current.name.split('_from_')[0]}_from_{adapter.name}"


def initialise_lora(layers, seed: int) -> None:
    """Keras' own LoRA init (A: He uniform, B: zeros), drawn from one seeded numpy generator.

    Each backend's generator gives other numbers for the same seed, so the same
    recipe ended one tiny epoch at eval loss 0.27 on JAX, 0.32 on PyTorch and
    0.26 on TensorFlow. Drawn here, the three start from the same adapter.
    """
    rng = np.random.default_rng(seed)
    for layer in layers:
        if experts.is_bank(layer):
            experts.initialise(layer, rng)
            continue
        shape = tuple(layer.lora_kernel_a.shape)
        limit = math.sqrt(6.0 / _fan_in(shape))
        layer.lora_kernel_a.assign(rng.uniform(-limit, limit, shape).astype("float32"))
        layer.lora_kernel_b.assign(np.zeros(tuple(layer.lora_kernel_b.shape), "float32"))


def _fan_in(shape) -> int:
    """Keras' fan-in of a kernel: the second-last axis times the receptive field before it."""
    if len(shape) == 1:
        return shape[0]
    return shape[-2] * math.prod(shape[:-2])


def compile(lm, learning_rate: float, weight_decay: float, shards: int = 1, plus_ratio: float | None = None,
            objective_=None):  # fmt: skip
    """The model that trains `lm`: a TrainingView with AdamW, without decay on biases and norm scales.

    Its loss is the mean over the weighted (response) tokens of each step,
    computed at those positions only (objective.py), with the weights that
    batching.TrainOrder gives; Keras' default reduction would divide by every
    position, padding included. Under a float16 policy Keras wraps the
    optimizer in loss scaling. A run sets its own schedule, clipping and
    accumulation once it knows its steps (train_with).

    shards: int. Data shards a batch is split over (batching.targets lays out the loss positions per shard).
    plus_ratio: float. LoRA+: the B factors and DoRA's magnitudes learn at this many times the A factors' rate.
    objective_: the method's objective (Optimizer.objective), whose view trains; None: SFT's response tokens.
    """
    view = (objective_ or objective.ResponseTokens()).view(lm, chunk_for(lm), shards)
    return train_with(view, optimizer.Controls(learning_rate, weight_decay, max_grad_norm=None, plus_ratio=plus_ratio))


def train_with(view, controls: optimizer.Controls):
    """`view` (a TrainingView) compiled again with the optimizer `controls` make: new, unbuilt state."""
    weighted = view.step_metrics()  # a preference view's TRL metrics, weighted as the loss weighs its pairs
    view.compile(optimizer=optimizer.adamw(controls), loss=objective.TokenShare(), weighted_metrics=weighted)
    return view


def objective_view(lm, objective_, shards: int = 1):
    """The view of `lm` that `objective_` (a method's objective) trains with, uncompiled: for scoring.
    shards: the data shards a batch is split over, as the run's trainer has them (compile)."""
    return objective_.view(lm, chunk_for(lm), shards)


def train_every_weight(lm, base: bool = False) -> None:
    """--full: every weight of the language model trains, as keras-hub builds it (trainable); its image and audio
    encoders stay frozen, as under LoRA (the plan counts none of their gradients).

    base: bool. Keep a host copy of the weights as they are now, the base's, for lora_off (keep_base).
    """
    lm.backbone.trainable = True
    if tokens.rows(lm.backbone) is not None:
        # --add-tokens froze the base's matrix beside its new rows (tokens.install), and on TensorFlow the layer's
        # trainable flag does not thaw a variable frozen by hand: a --full run there left the matrix untrained.
        tokens.token_embedding(lm.backbone).embeddings.trainable = True
    for encoder in encoders(lm.backbone):
        encoder.trainable = False
    if base:
        keep_base(lm)


_BASES = weakref.WeakKeyDictionary()
"""lm -> (its trainable variables, their base values): what keep_base kept for lora_off."""


def keep_base(lm) -> None:
    """Keep `lm`'s trainable weights as they are now as the base lora_off swaps in: a --full model's before it
    trains, or before a finished run's trained weights load (`finetune eval` of a DPO run scores its reference)."""
    variables = list(lm.backbone.trainable_variables)
    _BASES[lm] = (variables, [np.array(v.numpy()) for v in variables])


@contextlib.contextmanager
def lora_off(lm):
    """`lm` as its base for a while: every adapted layer's LoRA (and DoRA) switched off, as PEFT's
    disable_adapter(), and new tokens' rows (--add-tokens) as they started; the factors stay as they are. A call
    traced before keeps what it traced: score with a view made inside.

    A --full model (train_every_weight, keep_base) has no LoRA to switch off: its base's weights are swapped in,
    and its own put back after."""
    if lm in _BASES:
        variables, base = _BASES[lm]
        trained = [np.array(v.numpy()) for v in variables]
        for variable, value in zip(variables, base, strict=True):
            variable.assign(value)
        try:
            yield lm
        finally:
            for variable, value in zip(variables, trained, strict=True):
                variable.assign(value)
        return
    layers = [layer for layer in lm.backbone._flatten_layers(include_self=False)
              if getattr(layer, "lora_enabled", False)]  # fmt: skip
    for layer in layers:
        layer.lora_enabled = False
    try:
        with tokens.at_start(lm.backbone):  # --add-tokens: the new rows as they started, the base's
            yield lm
    finally:
        for layer in layers:
            layer.lora_enabled = True


def scorer(lm, rows: int, shards: int = 1) -> keras.Model:
    """A view of `lm` (the same layers and weights) whose evaluate() gives the mean loss and accuracy over every
    weighted token (scoring.metrics).

    rows: int. Rows of each held-out batch (batching.Batches' batch_size).

    Kept off the training step, where a second pass over the logits for
    accuracy cost 6-15% of the step time (cpu-small, vocabulary 4096).
    """
    view = objective.ScoringView(lm, chunk_for(lm), shards, rows, dtype=keras.config.dtype_policy())
    mean = keras.metrics.MeanMetricWrapper  # sum(value * weight) / sum(weight), over every batch
    view.compile(
        loss={"loss": objective.WeightedMean(), "correct": None},  # PyTorch's evaluate() wants a loss
        weighted_metrics={
            "loss": [mean(objective.output_itself, name="token_loss")],
            "correct": [mean(objective.output_itself, name="token_accuracy")],
        },
    )
    return view


def chunk_for(lm) -> int:
    """Positions the loss projects at once, from the vocabulary size (backend.loss_chunk)."""
    kernel, _ = objective.logit_projection(lm.backbone)
    return backend.loss_chunk(int(kernel.shape[0]))


def trainable_parameters(lm) -> int:
    return int(sum(math.prod(v.shape) for v in lm.trainable_weights))
