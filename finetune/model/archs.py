"""The released Gemma architectures as numbers, so `finetune plan` needs no download.

Each entry is the keras-hub backbone config of a preset (what its config.json
holds under "config"), for the keys that decide a variable's shape. The counts
they give are checked in tests/test_plan.py against the `params` keras-hub
publishes for each preset (gemma_2b_en: 2,506,172,416).

Instruction-tuned presets share their base's architecture: gemma_instruct_2b_en
plans as gemma_2b_en.

Gemma 4 and Gemma 3n presets carry image and audio encoders that finetune does
not load (it trains the text decoder: model.py): they are counted apart, in
`encoder_params`, so that the total is keras-hub's. Gemma 3n's published
counts are exact, and both presets leave the same 983,438,688 weights beside
their text decoders (the encoders are the same), which checks the text
count. keras-hub publishes Gemma 4's rounded (5.1B, 7.9B, 26B, 31B): its
encoders here were counted by building keras-hub's Gemma4VisionEncoder and
Gemma4AudioEncoder, for 2b and 4b from transformers' default Gemma 4 vision
and audio configs, for 26b_a4b and 31b from a 1152-wide, 27-layer vision
encoder (an estimate: their configs are not in keras-hub's source).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_GEMMA2 = dict(use_post_attention_norm=True, use_post_ffw_norm=True)
_GEMMA3 = dict(use_post_attention_norm=True, use_post_ffw_norm=True, use_query_key_norm=True)


@dataclass(frozen=True)
class Arch:
    family: str
    """gemma (Gemma 1 and 2: GemmaBackbone) or gemma3 (Gemma3Backbone)."""
    config: dict = field(hash=False)
    """The backbone config's shape-deciding keys, as keras-hub names them."""
    vision_params: int = 0
    """Weights of the image encoder of a multimodal Gemma 3 preset; 0 for text-only ones."""
    vision: dict | None = field(default=None, hash=False)
    """That encoder's keras-hub config (Gemma3VisionEncoder's arguments), for the plan's image counts."""
    encoder_params: int = 0
    """Weights of a Gemma 4 or 3n preset's image and audio encoders, which a text run does not load."""


def _gemma(layers, heads, kv_heads, hidden, intermediate, head_dim, **extra) -> dict:
    return dict(
        vocabulary_size=extra.pop("vocabulary_size", 256000),
        num_layers=layers,
        num_query_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
        head_dim=head_dim,
        **extra,
    )


def _gemma3(layers, heads, kv_heads, hidden, intermediate, head_dim) -> dict:
    return _gemma(layers, heads, kv_heads, hidden, intermediate, head_dim, vocabulary_size=262144, **_GEMMA3)


def _gemma4(layers, heads, kv_heads, hidden, intermediate, window, **extra) -> dict:
    return dict(
        vocabulary_size=262144, num_layers=layers, num_query_heads=heads, num_key_value_heads=kv_heads,
        hidden_dim=hidden, intermediate_dim=intermediate, head_dim=256, global_head_dim=512,
        sliding_window_size=window, sliding_window_pattern=extra.pop("pattern", 6), final_logit_soft_cap=30.0,
        **extra,
    )  # fmt: skip


def _gemma3n(layers, intermediate, kv_shared) -> dict:
    return dict(
        text_vocab_size=262400, text_hidden_size=2048, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, intermediate_size=[intermediate] * layers,
        vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, altup_num_inputs=4, laurel_rank=64,
        num_kv_shared_layers=kv_shared, sliding_window=512,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * (layers // 5),
    )  # fmt: skip


def _siglip(output_dim: int) -> dict:
    """Gemma 3's SigLIP image encoder as its 4b-and-up presets configure keras-hub's Gemma3VisionEncoder: 896x896
    pictures in 14x14 patches (4,096), 27 blocks of width 1152, average-pooled 4x4 into 256 soft tokens. It is
    float32 whatever the decoder's dtype: keras-hub turns bfloat16 into float32 for it, and saves it so."""
    return dict(image_size=896, patch_size=14, num_heads=16, hidden_dim=1152, num_layers=27, intermediate_dim=4304,
                output_dim=output_dim, pool_size=4, dtype="float32")  # fmt: skip


# keras-hub's Gemma3CausalLMPreprocessor takes up to this many pictures a prompt (its max_images_per_prompt). A
# run feeds every row as many image slots as the data's most pictured record holds, the unused ones blank
# (methods/prepare.py).
MAX_IMAGES = 2
_PLE = dict(hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144)
# The multimodal Gemma 3 presets carry a SigLIP image encoder (27 layers, width 1152) that the
# decoder never uses on text, but from_preset builds and keeps it: it is counted, replicated.
# Its size is keras-hub's published count for the preset less the text backbone's.
ARCHS: dict[str, Arch] = {
    "gemma_2b_en": Arch("gemma", _gemma(18, 8, 1, 2048, 32768, 256)),
    "gemma_7b_en": Arch("gemma", _gemma(28, 16, 16, 3072, 49152, 256)),
    "gemma2_2b_en": Arch("gemma", _gemma(26, 8, 4, 2304, 18432, 256, **_GEMMA2)),
    "gemma2_9b_en": Arch("gemma", _gemma(42, 16, 8, 3584, 28672, 256, **_GEMMA2)),
    "gemma2_27b_en": Arch("gemma", _gemma(46, 32, 16, 4608, 73728, 128, **_GEMMA2)),
    "gemma3_270m": Arch("gemma3", _gemma3(18, 4, 1, 640, 2048, 256)),
    "gemma3_1b": Arch("gemma3", _gemma3(26, 4, 1, 1152, 6912, 256)),
    "gemma3_4b_text": Arch("gemma3", _gemma3(34, 8, 4, 2560, 10240, 256)),
    "gemma3_12b_text": Arch("gemma3", _gemma3(48, 16, 8, 3840, 15360, 256)),
    "gemma3_27b_text": Arch("gemma3", _gemma3(62, 32, 16, 5376, 21504, 128)),
    "gemma3_4b": Arch("gemma3", _gemma3(34, 8, 4, 2560, 10240, 256), vision_params=419_816_304, vision=_siglip(2560)),
    "gemma3_12b": Arch("gemma3", _gemma3(48, 16, 8, 3840, 15360, 256), vision_params=421_290_864, vision=_siglip(3840)),
    "gemma3_27b": Arch(
        "gemma3", _gemma3(62, 32, 16, 5376, 21504, 128), vision_params=423_060_336, vision=_siglip(5376)
    ),
    "gemma4_2b": Arch(
        "gemma4",
        _gemma4(35, 8, 1, 1536, 6144, 512, pattern=5, num_kv_shared_layers=20, use_double_wide_mlp=True, **_PLE),
        encoder_params=168_544_704 + 307_184_384,  # vision, audio
    ),
    "gemma4_4b": Arch(
        "gemma4",
        _gemma4(42, 8, 2, 2560, 10240, 512, num_kv_shared_layers=18, **_PLE),
        encoder_params=169_331_136 + 308_757_248,
    ),
    "gemma4_26b_a4b": Arch(
        "gemma4",
        _gemma4(
            30,
            16,
            8,
            2816,
            2112,
            1024,
            num_global_key_value_heads=2,
            enable_moe_block=True,
            num_experts=128,
            expert_intermediate_dim=704,
            num_experts_per_token=8,
        ),
        encoder_params=572_794_416,
    ),  # fmt: skip
    "gemma4_31b": Arch(
        "gemma4", _gemma4(60, 32, 16, 5376, 21504, 1024, num_global_key_value_heads=4), encoder_params=575_743_536
    ),
    "gemma3n_e2b": Arch("gemma3n", _gemma3n(30, 8192, 10), encoder_params=983_438_688),
    "gemma3n_e4b": Arch("gemma3n", _gemma3n(35, 16384, 15), encoder_params=983_438_688),
}


def lookup(name: str) -> Arch | None:
    """The architecture of a keras-hub preset name, or None when the table lacks it."""
    base = name.replace("_instruct_", "_").removesuffix("_it")  # gemma3n_e2b_it plans as gemma3n_e2b
    return ARCHS.get(name) or ARCHS.get(base)


def norm_scales_per_layer(config: dict, family: str) -> int:
    """Weights of a decoder block's RMS norms: pre-attention and pre-FFW always, the rest by flag."""
    hidden = int(config["hidden_dim"])
    count = 2 * hidden
    count += hidden if config.get("use_post_attention_norm") else 0
    count += hidden if config.get("use_post_ffw_norm") else 0
    # Gemma3Backbone normalises queries and keys per head unless told not to.
    if family == "gemma3" and config.get("use_query_key_norm", True):
        count += 2 * int(config["head_dim"])
    return count


def small_weights(config: dict, family: str) -> int:
    """Weights no layout rule covers: norm scales, Gemma 4's layer scalars and per-expert scales."""
    from finetune.model import layouts

    if family == "gemma3n":
        hidden, head = int(config["text_hidden_size"]), int(config["head_dim"])
        per_layer = 8 * hidden + 2 * head  # seven norms and AltUp's output scale; the query and key norms
        return int(config["num_hidden_layers"]) * per_layer + hidden + int(config["hidden_size_per_layer_input"])
    hidden = int(config["hidden_dim"])
    if family != "gemma4":
        return int(config["num_layers"]) * norm_scales_per_layer(config, family) + hidden
    per_layer_input = int(config.get("hidden_size_per_layer_input") or 0)
    total = hidden + per_layer_input  # the final norm, the per-layer projection's norm
    for index in range(int(config["num_layers"])):
        block = layouts.gemma4_block(config, index)
        total += 4 * hidden + 1 + block["head_dim"] * (2 if block["owns_kv"] else 1)  # norms, layer scalar, q/k norms
        if config.get("enable_moe_block"):
            total += 4 * hidden + int(config["num_experts"])  # three norms, the router's scale, per-expert scales
        total += hidden if per_layer_input else 0
    return total


def parameter_count(config: dict, family: str, vision_params: int = 0) -> int:
    """Every weight of the backbone as from_preset builds it (for Gemma 4 and 3n: the text decoder)."""
    from finetune.model import layouts

    dims = layouts.Dims.from_backbone_config(config, family)
    kernels = sum(
        math.prod(dims.shape(rule)) * dims.copies(rule) for rule in layouts.rules_for(dims) if dims.shape(rule)
    )
    return kernels + small_weights(config, family) + vision_params


def vision_parameter_count(config: dict) -> int:
    """Weights of a Gemma3VisionEncoder from its config: patch convolution, positions, ViT blocks, projection."""
    width, inner = int(config["hidden_dim"]), int(config["intermediate_dim"])
    patch = int(config["patch_size"])
    embedding = patch * patch * 3 * width + width + patches_per_image(config) * width
    # Each block: q, k, v and output projections with biases, two layer norms (scale and bias), the MLP.
    block = 4 * (width * width + width) + 2 * 2 * width + 2 * width * inner + inner + width
    # The encoder's final layer norm, the soft-embedding RMS norm, and the projection to the decoder's width.
    head = 2 * width + width + width * int(config["output_dim"])
    return embedding + int(config["num_layers"]) * block + head


def patches_per_image(vision: dict) -> int:
    """The encoder's sequence for one picture: its square patches (4,096 for Gemma 3's 896x896 in 14x14)."""
    return (int(vision["image_size"]) // int(vision["patch_size"])) ** 2


def tokens_per_image(vision: dict) -> int:
    """Soft tokens a picture becomes in the decoder's sequence: its patches, average-pooled (keras-hub's
    Gemma3VisionEncoder.num_vision_tokens_per_image; 256 for Gemma 3)."""
    return patches_per_image(vision) // int(vision.get("pool_size", 14)) ** 2
