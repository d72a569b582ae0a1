"""The released Gemma architectures as numbers, so `finetune plan` needs no download.

Each entry is the keras-hub backbone config of a preset (what its config.json
holds under "config"), for the keys that decide a variable's shape. The counts
they give are checked in tests/test_plan.py against the `params` keras-hub
publishes for each preset (gemma_2b_en: 2,506,172,416).

Instruction-tuned presets share their base's architecture: gemma_instruct_2b_en
plans as gemma_2b_en.
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


# The multimodal Gemma 3 presets carry a SigLIP image encoder (27 layers, width 1152) that the
# decoder never uses on text, but from_preset builds and keeps it: it is counted, replicated.
# Its size is keras-hub's published count for the preset less the text backbone's.
ARCHS: dict[str, Arch] = {
    "gemma_2b_en": Arch("gemma", _gemma(18, 8, 1, 2048, 32768, 256)),
    "gemma_7b_en": Arch("gemma", _gemma(28, 16, 16, 3072, 49152, 256)),
    "gemma2_2b_en": Arch("gemma", _gemma(26, 8, 4, 2304, 18432, 256, **_GEMMA2)),
    "gemma2_9b_en": Arch("gemma", _gemma(42, 16, 8, 3584, 28672, 256, **_GEMMA2)),
    "gemma2_27b_en": Arch("gemma", _gemma(46, 32, 16, 4608, 73728, 128, **_GEMMA2)),
    "gemma3_1b": Arch("gemma3", _gemma3(26, 4, 1, 1152, 6912, 256)),
    "gemma3_4b_text": Arch("gemma3", _gemma3(34, 8, 4, 2560, 10240, 256)),
    "gemma3_12b_text": Arch("gemma3", _gemma3(48, 16, 8, 3840, 15360, 256)),
    "gemma3_27b_text": Arch("gemma3", _gemma3(62, 32, 16, 5376, 21504, 128)),
    "gemma3_4b": Arch("gemma3", _gemma3(34, 8, 4, 2560, 10240, 256), vision_params=419_816_304),
    "gemma3_12b": Arch("gemma3", _gemma3(48, 16, 8, 3840, 15360, 256), vision_params=421_290_864),
    "gemma3_27b": Arch("gemma3", _gemma3(62, 32, 16, 5376, 21504, 128), vision_params=423_060_336),
}


def lookup(name: str) -> Arch | None:
    """The architecture of a keras-hub preset name, or None when the table lacks it."""
    return ARCHS.get(name) or ARCHS.get(name.replace("_instruct_", "_"))


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


def parameter_count(config: dict, family: str, vision_params: int = 0) -> int:
    """Every weight of the backbone as from_preset builds it."""
    from finetune import layouts

    dims = layouts.Dims.from_backbone_config(config, family)
    kernels = sum(
        math.prod(dims.shape(rule)) * (1 if rule.group == "embedding" else dims.num_layers)
        for rule in layouts.RULES
        if rule.shape_of
    )
    norms = dims.num_layers * norm_scales_per_layer(config, family) + dims.hidden_dim  # + the final norm
    return kernels + norms + vision_params


def vision_parameter_count(config: dict) -> int:
    """Weights of a Gemma3VisionEncoder from its config: patch convolution, positions, ViT blocks, projection."""
    width, inner = int(config["hidden_dim"]), int(config["intermediate_dim"])
    patch = int(config["patch_size"])
    patches = (int(config["image_size"]) // patch) ** 2
    embedding = patch * patch * 3 * width + width + patches * width
    # Each block: q, k, v and output projections with biases, two layer norms (scale and bias), the MLP.
    block = 4 * (width * width + width) + 2 * 2 * width + 2 * width * inner + inner + width
    # The encoder's final layer norm, the soft-embedding RMS norm, and the projection to the decoder's width.
    head = 2 * width + width + width * int(config["output_dim"])
    return embedding + int(config["num_layers"]) * block + head
