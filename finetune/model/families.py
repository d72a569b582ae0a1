"""What finetune knows of each Gemma family, in one place.

A family is one keras-hub backbone class and everything finetune needs to
train it: its CausalLM, tokenizer and preprocessor classes, how a preset's
config.json names it, which of its layers LoRA may adapt (and which stay
frozen, and why), its chat turns, and the transformers class the hf and peft
exports load into.

- gemma: Gemma 1 and Gemma 2 (GemmaBackbone).
- gemma3: Gemma 3, from 270m to the multimodal 27b (Gemma3Backbone).
- gemma4: Gemma 4, dense (2b, 4b, 31b) and mixture-of-experts (26b_a4b) (Gemma4Backbone).
- gemma3n: Gemma 3n, e2b and e4b (Gemma3nBackbone).

LoRA targets are named the same way for every family (query, key, value,
attention_output, ffw_gating, ffw_gating_2, ffw_linear); a family whose
keras-hub layers are named otherwise (Gemma 3n's q_proj, ...) maps them here,
and takes its own names too. `experts` names a mixture-of-experts bank's
three projections (Gemma 4's 26b_a4b), which are tensors, not linear layers.
Pure Python: nothing here imports keras.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.platform.errors import UserError

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""A mixture-of-experts bank's tensors LoRA adapts (model/experts.py): keras-hub's Gemma4MoEBlock's names."""
EXPERT_FACTORS = tuple(f"lora_{projection}_{side}" for projection in EXPERT_PROJECTIONS for side in "ab")
"""A bank's LoRA weights, in the order adapter.lora.h5 keeps them: A and B of gate, up and down. Named lora_* so
that the base's fingerprint (adapter.fingerprint) leaves them out, as it does keras' lora_kernel_a and _b. Here,
without keras, for what reads an adapter before a backend is chosen (training/adapter.py)."""

IMAGE_TOKENS = (70, 140, 280, 560, 1120)
"""The soft-token budgets Gemma 4 lets a picture take (--image-tokens): keras-hub's presets take 280."""
TARGETS = ("query", "key", "value", "attention_output", "ffw_gating", "ffw_gating_2", "ffw_linear")
_SAME = {name: name for name in TARGETS}
ALL_LINEAR = "all-linear"
"""The target that stands for every linear layer kind of the decoder blocks (PEFT's target_modules="all-linear")."""
EXPERTS = "experts"
"""The target that puts LoRA on a mixture-of-experts bank: each expert's gate, up and down projections (experts.py).
Not one of all-linear's, as PEFT's all-linear leaves out transformers' experts, which are parameters, not Linears."""
# PEFT's target_parameters for transformers' Gemma 4 experts: its gate and up projections are one fused tensor.
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
# PEFT's module names for the same layers (transformers' Gemma), taken as targets in every family.
PEFT_NAMES = dict(q_proj="query", k_proj="key", v_proj="value", o_proj="attention_output", gate_proj="ffw_gating",
                  up_proj="ffw_gating_2", down_proj="ffw_linear")  # fmt: skip


def spelled_out(targets, adaptable) -> list[str]:
    """`targets` in our names, each once, in order: PEFT's names as ours, all-linear as each of `adaptable` (the
    TARGETS the model has layers for), PEFT's target_parameters of the experts (both of them) as experts; a
    family's own layer names stay as they are."""
    given = [target for target in targets if target in EXPERT_PARAMETERS]
    if given and set(given) != set(EXPERT_PARAMETERS):
        raise UserError(
            f"--target {given[0]}: finetune adapts an expert's gate, up and down projections together; pass "
            f"--target {EXPERTS} (or both of {' and '.join(EXPERT_PARAMETERS)})"
        )
    names = []
    for target in targets:
        if target in EXPERT_PARAMETERS:
            names.append(EXPERTS)
        else:
            names += list(adaptable) if target == ALL_LINEAR else [PEFT_NAMES.get(target, target)]
    return list(dict.fromkeys(names))


def expert_conflicts(targets, dora: bool, dropout: float):
    """What LoRA on the experts rules out: DoRA and LoRA dropout, which the experts' LoRA does not compute (PEFT's
    target_parameters take neither). The run's config refuses them (config.LoraConfig.conflicts), and the builder."""
    if EXPERTS not in spelled_out(targets, ()):
        return
    if dora:
        yield (f"--dora with --target {EXPERTS}: DoRA is not built for the experts; drop --dora, or target the "
               "linear layers alone")  # fmt: skip
    if dropout:
        yield (f"--lora-dropout with --target {EXPERTS}: LoRA dropout is not built for the experts (nor in PEFT's "
               "target_parameters); drop --lora-dropout")  # fmt: skip


@dataclass(frozen=True)
class Licence:
    """The terms a model's weights come under, as `finetune publish` passes them on to a model built on them."""

    name: str
    """What people call it: Gemma Terms of Use, Apache License 2.0."""
    spdx: str
    """The Hugging Face Hub's `license:` id for a model card: gemma, apache-2.0."""
    link: str
    """Where the terms are read in full."""
    redistribution: bool = True
    """Whether a model built on these weights may be given to others; publish refuses one whose terms say no."""
    notice: str = ""
    """What the terms ask a redistributed copy to say, put in its model card."""


# Gemma 1, 2, 3 and 3n come under Google's Gemma Terms of Use, which let a fine-tuned model be shared if it carries
# their use restrictions and this notice (section 3.1); Gemma 4 came out under Apache 2.0 (April 2026).
GEMMA_TERMS = Licence(
    "Gemma Terms of Use", "gemma", "https://ai.google.dev/gemma/terms",
    notice="Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms. "
    "Its use restrictions (the Gemma Prohibited Use Policy, ai.google.dev/gemma/prohibited_use_policy) apply to "
    "this model too.",
)  # fmt: skip
APACHE = Licence("Apache License 2.0", "apache-2.0", "https://www.apache.org/licenses/LICENSE-2.0")


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    backbone: str
    """keras-hub's backbone class name, as config.json's class_name ends."""
    causal_lm: str
    tokenizer: str
    preprocessor: str
    layers: dict = field(hash=False)
    """LoRA target name -> the keras-hub layer name it adapts."""
    frozen: dict = field(hash=False, default_factory=dict)
    """keras-hub layer name (or prefix, ending in _) -> why LoRA never adapts it."""
    chat_template: str = "gemma-chat"
    transformers: str | None = None
    """transformers' causal LM class for `finetune export --format hf/peft`; None: not exported there."""
    kaggle_models: tuple = ()
    """Kaggle model slugs (kaggle://keras/<slug>/keras/<variant>/<version>) whose presets are this family."""
    encoders: dict = field(hash=False, default_factory=dict)
    """Backbone config keys of the image and audio encoders a text run leaves out (set to None)."""
    converters: tuple = ()
    """The preprocessor's image, audio and video converters, left out with them."""
    seeing: tuple = ()
    """Of `encoders` and `converters`, the image encoder's and converter's keys that a run whose data has pictures
    keeps (Gemma 4's); empty where pictures are refused or the preset keeps its encoder anyway (Gemma 3)."""
    image_tokens: tuple = ()
    """The soft-token budgets a picture may take (--image-tokens; Gemma 4's IMAGE_TOKENS); empty where the image
    encoder fixes its count (Gemma 3's 256) or pictures are refused."""
    no_quantize: str | None = None
    """Why --quantize (int4 or int8) would compute wrong on this family; None where it works."""
    read_kernels: tuple = ()
    """Layers whose kernel the family's decoder block reads and multiplies by itself rather than calling the layer
    (keras-hub's Gemma 4 FFW): their `kernel` is made the effective one, dequantized, LoRA and DoRA merged
    (builder.effective_kernels), and LoRA dropout, which acts on a layer's input, is refused on them."""
    without_images: str | None = None
    """Why this family's model may be built without the vision encoder its preset has, said where pictures are
    refused; None where the only reason is a preset without one."""
    needs_tensorflow: bool = True
    """Whether keras-hub's preprocessor of this family needs TensorFlow on every backend. keras-hub 0.32's Gemma 3,
    3n and 4 preprocessors assert it when they are made, and prepare text and images with tf ops; Gemma 1 and 2's
    tokenize through the sentencepiece package alone. A process on JAX or PyTorch keeps TensorFlow for them only
    (backend.leave_out_other_frameworks)."""
    numbered_encoders: tuple = ()
    """The backbone's encoders (attribute names) whose layers keras names by its process-wide counters
    (keras-hub's MobileNetV5: conv2d_9 in a second build): their weights are known by their place in the encoder
    instead (weight_paths)."""
    licence: Licence = GEMMA_TERMS
    """The terms Google released the family's weights under, which a model fine-tuned from them carries."""
    float16_overflows: str | None = None
    """Why float16 computes this family wrong (its activations pass float16's largest value, 65,504), said where
    --precision auto picks float32 instead and where --precision float16 is given; None where float16 is safe."""
    experts: str | None = None
    """The keras-hub layer name of the mixture-of-experts bank `--target experts` adapts, in the presets that have
    one (Gemma 4's 26b_a4b); None where the family has none."""

    def layer_of(self, target: str) -> str:
        """The keras-hub layer name a LoRA target names (a family's own names are taken as they are)."""
        if target == EXPERTS and self.experts:
            return self.experts
        target = PEFT_NAMES.get(target, target)
        return self.layers.get(target, target)

    def without_experts(self, model: str) -> str:
        """Why `--target experts` finds nothing to adapt in `model`, a preset of this family without a bank."""
        if self.experts is None:
            return f"--target {EXPERTS}: {self.title} has no mixture-of-experts layers; LoRA adapts its linear layers"
        return (f"--target {EXPERTS}: {model} has no mixture-of-experts layers (a dense {self.title}); "
                f"{self.title}'s experts are in its mixture-of-experts presets (26b_a4b)")  # fmt: skip

    def left_out(self, images: bool) -> tuple[dict, tuple]:
        """(the backbone config keys set to None, the preprocessor's converters set to None) of a build for a run
        with pictures or without: a run on pictures keeps the image encoder and its converter (`seeing`), never
        the audio encoder, whose inputs finetune does not feed."""
        kept = self.seeing if images else ()
        encoders = {key: value for key, value in self.encoders.items() if key not in kept}
        return encoders, tuple(name for name in self.converters if name not in kept)

    def check_image_tokens(self, tokens: int | None) -> None:
        """Refuse an --image-tokens budget this family's pictures cannot take (None: the preset's own)."""
        if tokens is None:
            return
        if not self.image_tokens:
            raise UserError(f"--image-tokens {tokens}: {self.title}'s pictures take the soft tokens its image "
                            "encoder makes, and only Gemma 4 lets a run choose them; leave --image-tokens out")  # fmt: skip
        if tokens not in self.image_tokens:
            raise UserError(f"--image-tokens {tokens}: {self.title} takes one of "
                            f"{', '.join(map(str, self.image_tokens))}")  # fmt: skip

    def frozen_reason(self, layer: str) -> str | None:
        for name, why in self.frozen.items():
            if layer == name or (name.endswith("_") and layer.startswith(name)):
                return why
        return None


_PER_LAYER = "a per-layer embedding projection, kept as pretrained"
# transformers #45242, unsloth #5230: Gemma 3 fine-tuned in float16 on a T4 "trains" and learns nothing. A clamp
# saturates without a NaN, so the run's NaN stop never fires.
_CLAMPED = (
    "{title}'s activations pass float16's largest value, 65,504, and keras-hub clamps them there "
    "(gemma{n}_decoder_block.py) without a NaN, so a float16 run can train on wrong values without stopping"
)
FAMILIES = {
    "gemma": Family(
        "gemma", "Gemma 1 and 2", "GemmaBackbone", "GemmaCausalLM", "GemmaTokenizer", "GemmaCausalLMPreprocessor",
        _SAME, transformers="GemmaForCausalLM", kaggle_models=("gemma", "gemma2", "codegemma"),
        needs_tensorflow=False,
    ),
    "gemma3": Family(
        "gemma3", "Gemma 3", "Gemma3Backbone", "Gemma3CausalLM", "Gemma3Tokenizer", "Gemma3CausalLMPreprocessor",
        _SAME, transformers="Gemma3ForCausalLM", kaggle_models=("gemma3",),
        float16_overflows=_CLAMPED.format(title="Gemma 3", n="3"),
    ),
    "gemma4": Family(
        "gemma4", "Gemma 4", "Gemma4Backbone", "Gemma4CausalLM", "Gemma4Tokenizer", "Gemma4CausalLMPreprocessor",
        _SAME,
        frozen={
            "proj": "the mixture-of-experts router, which picks each token's experts",
            "per_layer_input_gate": _PER_LAYER,
            "per_layer_up_proj": _PER_LAYER,
            "per_layer_model_projection": _PER_LAYER,
        },
        chat_template="gemma4-chat", transformers="Gemma4ForCausalLM", kaggle_models=("gemma4",), licence=APACHE,
        encoders=dict(vision_encoder=None, audio_encoder=None),
        converters=("image_converter", "audio_converter", "video_converter"),
        seeing=("vision_encoder", "image_converter"), image_tokens=IMAGE_TOKENS,
        without_images="a run on text builds Gemma 4 without its image encoder; a run on pictures keeps it",
        read_kernels=("ffw_gating", "ffw_gating_2", "ffw_linear"),
        float16_overflows=_CLAMPED.format(title="Gemma 4", n="4"), experts="moe_expert_bank",
    ),
    "gemma3n": Family(
        "gemma3n", "Gemma 3n", "Gemma3nBackbone", "Gemma3nCausalLM", "Gemma3nTokenizer", "Gemma3nCausalLMPreprocessor",
        dict(query="q_proj", key="k_proj", value="v_proj", attention_output="o_proj", ffw_gating="gate_proj",
             ffw_gating_2="up_proj", ffw_linear="down_proj"),
        frozen={
            "per_layer_input_gate": _PER_LAYER,
            "per_layer_projection": _PER_LAYER,
            "per_layer_model_projection": _PER_LAYER,
            "linear_left": "a Laurel block, kept as pretrained",
            "linear_right": "a Laurel block, kept as pretrained",
            "correction_coefs": "an AltUp block, kept as pretrained",
            "prediction_coefs": "an AltUp block, kept as pretrained",
            "modality_router": "an AltUp block, kept as pretrained",
            "altup_projection_": "an AltUp projection, kept as pretrained",
            "altup_unembed_projection_": "an AltUp projection, kept as pretrained",
        },
        transformers="Gemma3nForCausalLM", kaggle_models=("gemma-3n", "gemma3n"), numbered_encoders=("vision_encoder",),
        encoders=dict(vision_encoder_config=None, audio_encoder_config=None),
        converters=("image_converter", "audio_converter"),
        seeing=("vision_encoder_config", "image_converter"),
        without_images="a run on text builds Gemma 3n without its image encoder; a run on pictures keeps it",
        float16_overflows=(
            "Gemma 3n's activations pass float16's largest value, 65,504, and keras-hub does not clamp them: a "
            "float16 run computes infinities and NaNs"
        ),
    ),
}  # fmt: skip


def get(name: str) -> Family:
    return FAMILIES[name]


def of_class_name(class_name: str) -> Family | None:
    """The family whose backbone, task, tokenizer or preprocessor a config.json `class_name` names."""
    short = str(class_name).split(">")[-1].split(".")[-1]
    for family in FAMILIES.values():
        if short in (family.backbone, family.causal_lm, family.tokenizer, family.preprocessor):
            return family
    return None


def of_backbone(backbone) -> Family:
    found = of_class_name(type(backbone).__name__)
    if found is None:
        raise UserError(f"finetune trains Gemma backbones, not a {type(backbone).__name__}")
    return found


def keras_hub_class(family: Family, kind: str = "causal_lm"):
    """keras_hub.models.<the family's class>, or a UserError naming the keras-hub release that has it."""
    import keras_hub

    name = getattr(family, kind)
    found = getattr(keras_hub.models, name, None)
    if found is None:
        raise UserError(
            f"{family.title} needs a keras-hub with {name} (this one, {keras_hub.__version__}, has none); "
            "pip install -U keras-hub"
        )
    return found


def preset_names() -> dict[str, Family]:
    """keras-hub's preset names of every family this keras-hub has."""
    import keras_hub

    names = {}
    for family in FAMILIES.values():
        cls = getattr(keras_hub.models, family.causal_lm, None)
        if cls is not None:
            names.update({name: family for name in cls.presets if name not in names})
    return names


def of_kaggle_handle(handle: str) -> Family | None:
    """kaggle://keras/<model>/keras/<variant>/<version>: by the variant's keras-hub name, else by the model."""
    parts = handle.removeprefix("kaggle://").split("/")
    if len(parts) > 3 and parts[3] in (names := preset_names()):
        return names[parts[3]]
    model = parts[1] if len(parts) > 1 else ""
    return next((f for f in FAMILIES.values() if model in f.kaggle_models), None)


def decoder_blocks(backbone) -> list:
    """The backbone's decoder blocks: Gemma 3n keeps them in its text model."""
    blocks = getattr(backbone, "transformer_layers", None)
    if blocks is None:
        blocks = backbone.language_model.transformer_layers
    return list(blocks)


def weight_paths(backbone) -> dict[int, str]:
    """id(weight) -> a name for each of the backbone's weights that is the same in every build of it: its path,
    or for an encoder named by keras' counters (Family.numbered_encoders) `<encoder>/<its index there>`. What
    tells a base apart (adapter.fingerprint) and seeds a tiny preset's random weights (presets.tiny_backbone)."""
    paths = {id(weight): weight.path for weight in backbone.weights}
    family = of_class_name(type(backbone).__name__)
    for name in family.numbered_encoders if family is not None else ():
        encoder = getattr(backbone, name, None)
        for index, weight in enumerate(encoder.weights if encoder is not None else ()):
            paths[id(weight)] = f"{name}/{index}"
    return paths
