"""Build the Gemma causal LM, put LoRA on it, compile it.

We use keras-hub's own mechanisms (from_preset, backbone.enable_lora,
save_lora_weights/load_lora_weights) rather than wrapping them. The one thing
keras-hub's backbone.enable_lora lacks is LoRA's alpha; the Keras layers
under it have it, so we set it on each adapted layer after enabling.
"""

from __future__ import annotations

import math

import keras
import numpy as np

from finetune import attention, families, presets
from finetune.errors import UserError


def build(source: presets.Source, seq_len: int, quantize: str | None = None):
    """The causal LM (without preprocessor attached) and its preprocessor.

    Its decoder blocks take segment ids where keras-hub takes `padding_mask`
    (attention.py), so packed rows train exactly; one-example rows are unchanged.

    quantize: str. int4: the frozen base weights are quantized here,
        before LoRA is enabled, as QLoRA does; the LoRA factors stay in float.
    """
    why = families.get(source.family).no_int4 if quantize is not None else None
    if why:
        raise UserError(f"--quantize {quantize} is not for {families.get(source.family).title} yet: {why}")
    lm, preprocessor = load_base(source, seq_len)
    attention.enable(lm.backbone)
    if quantize is not None:
        lm.backbone.quantize(quantize)  # the backbone, not lm: quantize() locks the model it is called on
    return lm, preprocessor


def load_base(source: presets.Source, seq_len: int):
    """The preset's causal LM (preprocessor detached) and its preprocessor, as keras-hub builds them.

    No hooks and no quantization: what `finetune export` merges into and saves.
    """
    policy = keras.config.dtype_policy().name
    family = families.get(source.family)
    cls = families.keras_hub_class(family)
    if source.kind == "tiny":
        tokenizer = presets.tiny_tokenizer(source.handle)
        backbone = presets.tiny_backbone(tokenizer.vocabulary_size(), dtype=policy, name=source.handle)
        preprocessor = presets.tiny_preprocessor(source.handle, tokenizer, seq_len)
        return cls(backbone=backbone, preprocessor=None), preprocessor
    try:
        lm = (
            text_decoder(cls, family, source.handle, policy)
            if family.encoders
            else cls.from_preset(source.handle, dtype=policy)
        )
    except (OSError, ValueError) as e:
        raise UserError(f"could not load preset {source.handle}: {str(e).splitlines()[0]}") from e
    preprocessor = lm.preprocessor
    preprocessor.sequence_length = seq_len
    lm.preprocessor = None
    return lm, preprocessor


def text_decoder(cls, family, handle: str, dtype: str):
    """A multimodal preset's causal LM without its image and audio encoders (Gemma 4, 3n).

    finetune trains on text, and the encoders' inputs would have to be fed to
    every step: the backbone is built from the preset's config with them left
    out and takes the preset's weights (the encoders' are not read), and the
    preprocessor goes without its converters. Its text logits are the full
    model's (tests/test_families.py).
    """
    from keras_hub.src.utils.preset_utils import get_preset_loader

    loader = get_preset_loader(handle)
    loader.config["config"].update(family.encoders)
    backbone = loader.load_backbone(cls.backbone_cls, load_weights=True, dtype=dtype)
    preprocessor = cls.preprocessor_cls.from_preset(handle, **dict.fromkeys(family.converters))
    return cls(backbone=backbone, preprocessor=preprocessor)


def input_names(lm) -> tuple[str, ...]:
    """What a batch must feed `lm` (batching.model_inputs makes each): token ids, padding mask, maybe positions."""
    names = tuple(tensor.name for tensor in keras.tree.flatten(lm.inputs))
    others = [name for name in names if name not in ("token_ids", "padding_mask", "position_ids")]
    if others:
        raise UserError(
            f"this preset's model also takes {', '.join(others)}; finetune trains on text, and needs a text-only model"
        )
    return names


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


def enable_lora(lm, rank: int, alpha: float | None, targets: list[str], seed: int = 0) -> int:
    """LoRA on the named layers, everything else frozen; returns the count of adapted layers.

    targets: list of str. LoRA target names (query, value, ...: the same for
        every family, families.TARGETS) or the family's own layer names.
    seed: int. The LoRA factors start from this numpy seed, not from the
        backend's own generator, so every backend trains the same model.
    """
    backbone = lm.backbone
    names = lora_layer_names(backbone, targets)
    choices = ", ".join(adaptable_targets(backbone))
    backbone.enable_lora(rank, target_layer_names=names)
    adapted = [layer for layer in backbone._flatten_layers(include_self=False) if getattr(layer, "lora_enabled", False)]
    # A name shared with a non-dense layer enables that one too; refuse now rather than at save time.
    unsavable = [layer.name for layer in adapted if not hasattr(layer, "lora_kernel_a")]
    if unsavable:
        raise UserError(
            f"layer {unsavable[0]!r} cannot be adapted (keras-hub saves LoRA of dense layers only); choose from {choices}"
        )
    if alpha is not None:
        for layer in adapted:
            layer.lora_alpha = alpha  # the layer scales its LoRA update by lora_alpha / lora_rank
    initialise_lora(adapted, seed)
    return len(adapted)


def adaptable_targets(backbone) -> list[str]:
    """The LoRA target names this backbone has layers for (families.TARGETS, in order)."""
    family = families.of_backbone(backbone)
    available = adaptable_layer_names(backbone)
    return [t for t in families.TARGETS if family.layer_of(t) in available]


def lora_layer_names(backbone, targets: list[str]) -> list[str]:
    """The keras-hub layer names `targets` adapt on this backbone; a UserError for one it cannot."""
    family = families.of_backbone(backbone)
    available = adaptable_layer_names(backbone)
    choices = ", ".join(adaptable_targets(backbone))
    names = []
    for target in targets:
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


def initialise_lora(layers, seed: int) -> None:
    """Keras' own LoRA init (A: He uniform, B: zeros), drawn from one seeded numpy generator.

    Each backend's generator gives other numbers for the same seed, so the same
    recipe ended one tiny epoch at eval loss 0.27 on JAX, 0.32 on PyTorch and
    0.26 on TensorFlow. Drawn here, the three start from the same adapter.
    """
    rng = np.random.default_rng(seed)
    for layer in layers:
        shape = tuple(layer.lora_kernel_a.shape)
        limit = math.sqrt(6.0 / _fan_in(shape))
        layer.lora_kernel_a.assign(rng.uniform(-limit, limit, shape).astype("float32"))
        layer.lora_kernel_b.assign(np.zeros(tuple(layer.lora_kernel_b.shape), "float32"))


def _fan_in(shape) -> int:
    """Keras' fan-in of a kernel: the second-last axis times the receptive field before it."""
    if len(shape) == 1:
        return shape[0]
    return shape[-2] * math.prod(shape[:-2])


def compile(lm, learning_rate: float, weight_decay: float) -> None:
    """AdamW without decay on biases and norm scales, as in the Keras tutorial.

    The loss is averaged over the weighted (response) tokens of each batch:
    Keras' default reduction would divide by every position, padding included.
    Training computes nothing else: metrics live on the evaluator below.
    """
    optimizer = keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=weight_decay)
    optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
    lm.compile(optimizer=optimizer, loss=token_loss(), weighted_metrics=[], sampler="greedy")


def evaluator(lm) -> keras.Model:
    """A view of `lm` (the same layers and weights) compiled with exact per-token metrics.

    Weighted metrics accumulate sum(weight * value) / sum(weight) over every
    batch, so evaluate() returns the average over all held-out response
    tokens. Kept off the training model, where a second log-softmax over the
    vocabulary cost 6-15% of the step time (cpu-small, vocabulary 4096).
    """
    view = keras.Model(lm.inputs, lm.outputs, name="evaluator")
    view.compile(
        loss=token_loss(),
        weighted_metrics=[
            keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="token_loss"),
            keras.metrics.SparseCategoricalAccuracy(name="token_accuracy"),
        ],
    )
    return view


def token_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight")


def trainable_parameters(lm) -> int:
    return int(sum(math.prod(v.shape) for v in lm.trainable_weights))
