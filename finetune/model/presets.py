"""Which model a --preset names, and the embedded tiny Gemmas.

A preset is one of: a tiny preset built here, offline (`tiny`, a Gemma 1, and
`tiny-gemma3`, `tiny-gemma4`, `tiny-gemma4-moe`, `tiny-gemma3n`, one of each
newer family, and their picture and audio ones), a local preset directory (made by save_to_preset, or attached
under /kaggle/input), a `kaggle://` handle, a keras-hub preset name such as
gemma_2b_en, gemma3_1b or gemma4_2b, or a transformers checkpoint (a local
directory, or an `hf://ORG/NAME` repository) that keras-hub's converters build
(checkpoints.py). In a Kaggle notebook, a name or handle whose model is
attached is read from /kaggle/input instead of being downloaded. The family
(families.py) of a directory comes from its config.json (a keras-hub class_name
or a transformers model_type), of a name from keras-hub's preset lists, of a
handle from the preset or model it names. Kaggle-hosted ones need credentials,
and hf:// ones a route to the Hub; without them we stop in seconds with
instructions instead of waiting on a download that cannot work.
"""

from __future__ import annotations

import difflib
import json
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from finetune.model import archs, checkpoints, families
from finetune.platform import keras_compat, platforms
from finetune.platform.errors import UserError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY_TOKENIZER = ASSETS / "tiny" / "tokenizer.spm"
TINY_WEIGHTS = ASSETS / "tiny" / "weights.npz"
# A smoke-test model, not an assistant: about 0.4M parameters, Gemma 1 layout,
# briefly pretrained on text generated like the sample (see tools/).
TINY_CONFIG = dict(
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=1,
    hidden_dim=128,
    intermediate_dim=512,
    head_dim=32,
)
# Learning rates a run uses when none is given. Gemma checkpoints take 1e-4,
# the low end of what LoRA users start from (1e-4 to 2e-4), twice the Keras
# tutorial's 5e-5: on the tiny preset and dolly-real-151 (2 epochs, batch 4),
# the held-out loss fell 0.0027 at 5e-5, 0.0058 at 1e-4 and 0.0135 at 2e-4,
# none unstable (gradient norms 0.35-0.44); the tiny model says little of
# where a real Gemma's limit is, so the lower of the two. The tiny model is
# small and barely pretrained, and needs a much larger step to move in a
# one-minute run.
LEARNING_RATE = {"tiny": 1e-2, "pretrained": 1e-4}
LEARNING_RATE_WHY = {
    "tiny": "the tiny presets' default: their small random weights learn fast",
    "pretrained": "the default for a pretrained preset: the low end of LoRA's usual 1e-4 to 2e-4",
}


@dataclass(frozen=True)
class Tiny:
    """A tiny offline preset: a family's backbone at toy size, and a small tokenizer of the family's kind."""

    family: str
    config: dict = field(hash=False)
    """The backbone's keras-hub arguments, but the vocabulary size, which is the tokenizer's."""
    tokenizer: Path
    weights: Path | None = None
    """Shipped base weights; None: drawn from numpy's generator seeded with WEIGHT_SEED, the same on every backend."""
    vision: dict | None = field(default=None, hash=False)
    """The vision encoder's keras-hub arguments (its output width is the decoder's); None: text only."""
    audio: dict | None = field(default=None, hash=False)
    """The audio encoder's keras-hub arguments and its converter's (`converter`); None: no audio."""
    licence: families.Licence = families.APACHE
    """finetune's own: `tiny`'s weights were pretrained by tools/make_tiny_weights.py, the others' are random."""


# The newer families' tiny presets: decoder blocks of width 32, laid out as the family's presets are (norms,
# soft caps, sliding windows of 4 tokens, shorter than an example), so that a test runs each family's code
# paths in seconds. Gemma 3's pattern is fixed at five sliding layers to one global: both of its two slide.
# tiny-gemma4 is laid out as the 2b: sliding and global layers, per-layer inputs, and a last (global) layer
# that borrows the global layer's keys and values before it, with a doubled FFW (transformers' Gemma 4
# requires a global last layer); tiny-gemma4-moe as the 26b_a4b: experts
# beside the dense FFW, and a global layer whose values reuse its keys. tiny-gemma3n's last layer borrows
# keys and values too. Their base weights are random (tiny_backbone).
TINY_GEMMA3 = dict(
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=1,
    hidden_dim=32,
    intermediate_dim=64,
    head_dim=8,
    image_size=None,
    vision_encoder=None,
    use_post_ffw_norm=True,
    use_post_attention_norm=True,
    use_query_key_norm=True,
    use_sliding_window_attention=True,
    sliding_window_size=4,
)
# tiny-gemma3-vision: tiny-gemma3's decoder with Gemma 3's SigLIP-style vision encoder and projector at toy size.
# 32x32 pictures in 4x4 patches (64 patches), average-pooled 4x4 into 4 soft tokens per image, so a record with
# two pictures spends 2 x (4 + 2 markers + 4 newlines) tokens on them and trains at --seq-len 64.
TINY_GEMMA3_VISION_ENCODER = dict(
    image_size=32,
    patch_size=4,
    num_heads=2,
    hidden_dim=16,
    num_layers=2,
    intermediate_dim=32,
    pool_size=4,
)
# Its decoder's windows reach 32 tokens back: tiny-gemma3's 4 would keep the answer from seeing the picture.
TINY_GEMMA3_VISION = dict(TINY_GEMMA3, sliding_window_size=32)
TINY_GEMMA4 = dict(
    num_layers=3,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
    head_dim=8,
    image_size=None,
    sliding_window_size=4,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    global_head_dim=16,
    final_logit_soft_cap=30.0,
    num_kv_shared_layers=1,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=4,
)
# tiny-gemma4-vision: tiny-gemma4's decoder with Gemma 4's vision encoder (keras-hub's Gemma4VisionEncoder: Gemma 4
# blocks over patches with 2D positions, then average pooling and a projection) at toy size. A picture is resized,
# keeping its aspect, to at most 4 soft tokens' worth of 8x8 patches (32x32 for a square one: 16 patches), and
# pooled 2x2 into 4 soft tokens, so a record with two pictures spends 2 x (4 + 2 markers) tokens on them. Its global
# layers let the answer see the picture through tiny-gemma4's sliding windows of 4.
TINY_GEMMA4_VISION_ENCODER = dict(
    image_size=32,
    patch_size=8,
    num_heads=2,
    hidden_dim=16,
    num_layers=2,
    intermediate_dim=32,
    head_dim=8,
    pool_size=2,
    position_embedding_size=16,
)
TINY_GEMMA4_MOE = dict(
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
    head_dim=8,
    image_size=None,
    sliding_window_size=4,
    sliding_window_pattern=2,
    global_head_dim=16,
    final_logit_soft_cap=30.0,
    num_global_key_value_heads=1,
    enable_moe_block=True,
    num_experts=4,
    expert_intermediate_dim=16,
    num_experts_per_token=2,
)
TINY_GEMMA3N = dict(
    text_hidden_size=32, num_hidden_layers=3, pad_token_id=0, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, intermediate_size=[64, 64, 64], hidden_activation="gelu_approximate",
    layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=4,
    rope_theta=1_000_000.0, max_position_embeddings=2048, hidden_size_per_layer_input=4, altup_num_inputs=2,
    laurel_rank=4, activation_sparsity_pattern=[0.95, 0.0, 0.0], num_kv_shared_layers=1, final_logit_soft_cap=30.0,
    altup_coef_clip=120.0,
)  # fmt: skip
# tiny-gemma3n-vision: tiny-gemma3n's decoder with Gemma 3n's MobileNetV5 image encoder at toy size (keras-hub's
# MobileNetV5Backbone: an edge-residual stage and a universal-inverted-residual one, each halving the picture, then
# the multi-scale fusion adapter that Gemma 3n's encoder ends in, pooled to 2x2). A 32x32 picture becomes 4 soft
# tokens, so a record with two pictures spends 2 x (4 + 2 markers + 4 newlines) tokens on them. Its global layer
# lets the answer see the picture through tiny-gemma3n's sliding windows of 4.
TINY_GEMMA3N_VISION_ENCODER = dict(
    stackwise_block_types=[["er"], ["uir"]], stackwise_num_blocks=[1, 1], stackwise_num_filters=[[8], [16]],
    stackwise_strides=[[2], [2]], stackwise_act_layers=[["gelu"], ["gelu"]], stackwise_exp_ratios=[[2.0], [2.0]],
    stackwise_se_ratios=[[0.0], [0.0]], stackwise_dw_kernel_sizes=[[0], [3]],
    stackwise_dw_start_kernel_sizes=[[0], [3]], stackwise_dw_end_kernel_sizes=[[0], [0]],
    stackwise_exp_kernel_sizes=[[3], [0]], stackwise_pw_kernel_sizes=[[1], [0]], stackwise_num_heads=[[0], [0]],
    stackwise_key_dims=[[0], [0]], stackwise_value_dims=[[0], [0]], stackwise_kv_strides=[[0], [0]],
    stackwise_use_cpe=[[False], [False]], stem_size=8, num_features=16, norm_layer="rms_norm", act_layer="gelu",
    use_msfa=True, msfa_output_resolution=2, image_shape=[32, 32, 3],
)  # fmt: skip
# tiny-gemma4-audio: tiny-gemma4's decoder with Gemma 4's audio encoder (keras-hub's Gemma4AudioEncoder: two
# strided convolutions over the log-mel frames, then conformer blocks and a projection) at toy size. Its converter
# makes 16 mel bins, 100 frames a second, of at most a second of 16 kHz sound; the convolutions take 4 frames to a
# soft token, so a clip takes 25 tokens a second (a half-second clip 13), as Gemma 4's do.
TINY_GEMMA4_AUDIO_ENCODER = dict(
    input_feat_size=16, hidden_size=16, num_heads=2, num_layers=1, chunk_size=4, context_left=5, context_right=0,
    conv_kernel_size=3, sscp_conv_channels=(4, 8), output_proj_dims=None,
    converter=dict(num_mels=16, max_audio_length=1),
)  # fmt: skip
# tiny-gemma3n-audio: tiny-gemma3n's decoder with Gemma 3n's audio encoder (keras-hub's Gemma3nAudioEncoder: two
# strided convolutions, then conformer blocks) at toy size. Its converter makes 16 mel bins, 100 frames a second;
# the convolutions take 4 frames to a soft token, and every clip takes a fixed 24 (a second's), the rest of a
# shorter clip's filled with the padding embedding, as Gemma 3n's 188 are.
TINY_GEMMA3N_AUDIO_ENCODER = dict(
    hidden_size=16, input_feat_size=16, sscp_conv_channel_size=[4, 8], sscp_conv_kernel_size=[[3, 3], [3, 3]],
    sscp_conv_stride_size=[[2, 2], [2, 2]], sscp_conv_group_norm_eps=1e-3, num_hidden_layers=1, rms_norm_eps=1e-6,
    gradient_clipping=1e10, residual_weight=0.5, num_attention_heads=2, attention_chunk_size=4,
    num_attention_context_right=0, num_attention_context_left=5, attention_logit_cap=50.0, conv_kernel_size=3,
    reduction_factor=1, tokens=24,
    converter=dict(feature_size=16, sampling_rate=16000, padding_value=0.0, return_attention_mask=True,
                   frame_length_ms=32.0, hop_length_ms=10.0, min_frequency=125.0, max_frequency=7600.0,
                   preemphasis=0.97, preemphasis_htk_flavor=True, fft_overdrive=True, dither=0.0,
                   input_scale_factor=1.0, mel_floor=1e-5, per_bin_mean=None, per_bin_stddev=None,
                   padding_side="right"),
)  # fmt: skip
# Its audio encoder's weights, as built (tests/test_audio.py): `finetune plan` counts them without keras.
TINY_GEMMA4_AUDIO_PARAMS = 7744
# tiny-gemma3n-audio's audio encoder's and multimodal embedder's weights, as built (tests/test_audio.py).
TINY_GEMMA3N_AUDIO_PARAMS = 7864
# Its image encoder's and multimodal embedder's weights, as built (tests/test_images.py): `finetune plan` counts them
# without keras.
TINY_GEMMA3N_VISION_PARAMS = 5008
TINY = {
    "tiny": Tiny("gemma", TINY_CONFIG, TINY_TOKENIZER, TINY_WEIGHTS),
    "tiny-gemma3": Tiny("gemma3", TINY_GEMMA3, TINY_TOKENIZER),
    "tiny-gemma3-vision": Tiny(
        "gemma3", TINY_GEMMA3_VISION, ASSETS / "tiny-gemma3-vision" / "tokenizer.spm", vision=TINY_GEMMA3_VISION_ENCODER
    ),
    "tiny-gemma4": Tiny("gemma4", TINY_GEMMA4, ASSETS / "tiny-gemma4" / "tokenizer.spm"),
    "tiny-gemma4-vision": Tiny(
        "gemma4", TINY_GEMMA4, ASSETS / "tiny-gemma4-vision" / "tokenizer.spm", vision=TINY_GEMMA4_VISION_ENCODER
    ),
    "tiny-gemma4-audio": Tiny(
        "gemma4", TINY_GEMMA4, ASSETS / "tiny-gemma4-audio" / "tokenizer.spm", audio=TINY_GEMMA4_AUDIO_ENCODER
    ),
    "tiny-gemma3n-audio": Tiny(
        "gemma3n", TINY_GEMMA3N, ASSETS / "tiny-gemma3n" / "tokenizer.spm", audio=TINY_GEMMA3N_AUDIO_ENCODER
    ),
    "tiny-gemma4-moe": Tiny("gemma4", TINY_GEMMA4_MOE, ASSETS / "tiny-gemma4" / "tokenizer.spm"),
    "tiny-gemma3n": Tiny("gemma3n", TINY_GEMMA3N, ASSETS / "tiny-gemma3n" / "tokenizer.spm"),
    "tiny-gemma3n-vision": Tiny(
        "gemma3n", TINY_GEMMA3N, ASSETS / "tiny-gemma3n" / "tokenizer.spm", vision=TINY_GEMMA3N_VISION_ENCODER
    ),
}
TINY_NAMES = "a tiny offline preset (" + ", ".join(TINY) + ")"
WEIGHT_SEED = 15
# Gemma 3n's vocabulary sizes go by other names than the other families' vocabulary_size.
_VOCABULARY_KEYS = {"gemma3n": ("text_vocab_size", "vocab_size_per_layer_input")}


@dataclass(frozen=True)
class Source:
    kind: str
    """tiny, local or hub; random for `finetune bench`'s architectures with random weights."""
    handle: str
    """What keras_hub's from_preset is given (or the tiny preset's or bench architecture's name)."""
    family: str
    """A key of families.FAMILIES: gemma (Gemma 1 and 2), gemma3, gemma4 or gemma3n."""
    transformers: bool = False
    """A transformers checkpoint (config.json with a model_type), which keras-hub converts as it loads."""
    random: dict | None = field(default=None, hash=False, compare=False)
    """kind random: the GemmaBackbone config to build with random weights, and `tokenizer`, a .spm file."""

    @property
    def default_learning_rate(self) -> float:
        return default_learning_rate(self)[0]


def default_learning_rate(source: Source) -> tuple[float, str]:
    """(the learning rate a run on `source` takes when none is set, why)."""
    kind = "tiny" if source.kind == "tiny" else "pretrained"
    return LEARNING_RATE[kind], LEARNING_RATE_WHY[kind]


def pretrained(source: Source) -> bool:
    """Whether `source`'s base weights were trained on text: not a tiny preset's (random, or briefly trained on
    generated text) nor a bench architecture's random ones."""
    return source.kind not in ("tiny", "random")


def resolve(preset: str) -> Source:
    """Classify `preset` and check that it can be loaded, without loading it."""
    if preset in TINY:
        return Source("tiny", preset, TINY[preset].family)
    if preset.startswith(checkpoints.PREFIX):
        return _from_hugging_face(preset)
    path = Path(preset).expanduser()
    if path.is_dir():
        return Source("local", str(path), _family_of_directory(path), _is_transformers_directory(path))
    attached = _attached_in_kaggle_notebook(preset)
    if attached is not None:
        return Source("local", str(attached), _family_of_directory(attached))
    if preset.startswith("kaggle://"):
        source = Source("hub", preset, _family_of_handle(preset))
    elif "/" in preset or preset.startswith((".", "~")):
        raise UserError(
            f"preset directory {preset} does not exist; pass a directory made by save_to_preset, "
            f"a preset name such as gemma_2b_en, or {TINY_NAMES}"
        )
    else:
        source = Source("hub", preset, _family_of_name(preset))
    _check_hub_access(source.handle)
    return source


def licence_of(preset: str, family: str) -> families.Licence:
    """The terms the weights of `preset` come under: a tiny preset's own, else those of its family (a key of
    families.FAMILIES, as a run records it): a preset directory or hf:// checkpoint of a family is taken to be
    Google's release of it, or a model built on one, which carries the same terms."""
    if preset in TINY:
        return TINY[preset].licence
    return families.get(family).licence


def family_of(preset: str) -> str:
    """The family a --preset names, without checking that it can be loaded (resolve does)."""
    if preset in TINY:
        return TINY[preset].family
    if preset.startswith(checkpoints.PREFIX):
        return _from_hugging_face(preset).family
    path = Path(preset).expanduser()
    if path.is_dir():
        return _family_of_directory(path)
    if preset.startswith("kaggle://"):
        return _family_of_handle(preset)
    return _family_of_name(preset)


def frameworks_needed(preset: str) -> tuple[str, ...]:
    """The frameworks a run of `preset` needs on every backend: ("tensorflow",) where its family's preprocessor
    needs it (families.Family.needs_tensorflow), else none. Told
    offline, before keras is imported: from the tiny table, a directory's config.json, or the plan's table of
    keras-hub names. Where the family cannot be told without keras-hub's preset lists (another name, a
    kaggle:// handle, a broken directory that resolve() will refuse), TensorFlow is kept: it costs memory, and
    leaving it out would stop the run."""
    path = Path(preset).expanduser()
    if preset in TINY:
        family = TINY[preset].family
    elif path.is_dir():
        try:
            family = _family_of_directory(path)
        except UserError:
            return ("tensorflow",)
    elif (arch := archs.lookup(preset)) is not None:
        family = arch.family
    elif preset.startswith(checkpoints.PREFIX) and (described := _cached_hub_config(preset)) is not None:
        try:
            family = _family_of_config(described, preset)
        except UserError:
            return ("tensorflow",)
    else:
        return ("tensorflow",)
    return ("tensorflow",) if families.get(family).needs_tensorflow else ()


def _attached_in_kaggle_notebook(preset: str) -> Path | None:
    """In a Kaggle notebook, the attached copy of a hub preset, so that nothing is downloaded."""
    if not platforms.in_kaggle_notebook() or not (preset.startswith("kaggle://") or "/" not in preset):
        return None
    attached = platforms.attached_preset(preset)
    if attached is not None:
        print(f"note: using {preset} attached at {attached} instead of downloading it", file=sys.stderr)
    return attached


def _from_hugging_face(handle: str) -> Source:
    """An hf://ORG/NAME repository: a transformers checkpoint or a keras-hub preset, told by its config.json."""
    described = checkpoints.hub_config(handle)
    return Source("hub", handle, _family_of_config(described, handle), checkpoints.is_transformers(described))


def _cached_hub_config(handle: str) -> dict | None:
    try:
        return checkpoints.cached_config(handle)
    except UserError:
        return None


def _directory_config(path: Path) -> dict:
    config = path / "config.json"
    if not config.is_file():
        raise UserError(
            f"{path} is not a keras-hub preset directory (no config.json); make one with save_to_preset, or pass "
            "a transformers checkpoint's directory"
        )
    try:
        described = json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{config} is not valid JSON; re-create the preset with save_to_preset") from None
    if not isinstance(described, dict):
        raise UserError(
            f"{config} must hold a JSON object with a class_name, not a {type(described).__name__}; "
            "re-create the preset with save_to_preset"
        )
    return described


def _is_transformers_directory(path: Path) -> bool:
    return checkpoints.is_transformers(_directory_config(path))


def _family_of_directory(path: Path) -> str:
    described = _directory_config(path)
    if checkpoints.is_transformers(described):
        family = checkpoints.family_of(described, str(path))
        checkpoints.check_directory(path)
        return family
    return _family_of_config(described, str(path))


def _family_of_config(described: dict, path: str) -> str:
    """The family of a config.json: a transformers one's model_type, or a keras-hub one's class_name."""
    if checkpoints.is_transformers(described):
        return checkpoints.family_of(described, path)
    class_name = str(described.get("class_name") or "")
    family = families.of_class_name(class_name)
    if family is not None:
        return family.name
    if "Gemma" in class_name:
        known = ", ".join(f.backbone for f in families.FAMILIES.values())
        raise UserError(
            f"{path} holds a {class_name.split('>')[-1]}, a Gemma finetune does not know; it trains {known}"
        )
    raise UserError(f"{path} holds a {class_name or 'non-Gemma'} model; finetune trains Gemma presets only")


def directory_backbone(path: Path) -> tuple[str, dict]:
    """The family and backbone config ("config" in config.json) of a local preset directory; a transformers
    checkpoint's, as keras-hub's converter maps it (checkpoints.backbone_config)."""
    family = _family_of_directory(path)
    described = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if checkpoints.is_transformers(described):
        return family, checkpoints.backbone_config(described, family)
    config = described.get("config")
    if not isinstance(config, dict):
        raise UserError(f'{path / "config.json"} has no backbone "config" mapping; re-create it with save_to_preset')
    return family, config


def known_names() -> dict[str, str]:
    """keras-hub's preset names -> family, for every family this keras-hub has."""
    return {name: family.name for name, family in families.preset_names().items()}


def _family_of_name(name: str) -> str:
    names = known_names()
    if name.endswith("_assistant") and name in names:
        raise UserError(
            f"{name} is a speculative-decoding draft model, which keras-hub runs only beside its target model; "
            f"fine-tune {name.removesuffix('_assistant')} instead"
        )
    if name in names:
        return names[name]
    close = near_misses(name, [*names, *TINY])
    hint = f"did you mean {', '.join(close)}?" if close else f"e.g. gemma_2b_en, gemma3_1b, gemma4_2b, or {TINY_NAMES}"
    raise UserError(f"unknown preset {name!r}; {hint}")


def near_misses(name: str, known: list[str]) -> list[str]:
    """The known preset names `name` may have meant: those it begins (gemma_2b: gemma_2b_en), then the closest."""
    extended = [known_name for known_name in known if known_name.startswith(name)][:2]
    return list(dict.fromkeys(extended + difflib.get_close_matches(name, known, n=3)))[:4]


def _family_of_handle(handle: str) -> str:
    family = families.of_kaggle_handle(handle)
    if family is None:
        raise UserError(
            f"cannot tell which Gemma family {handle} is (neither its variant nor its model is one keras-hub names); "
            "download it and pass its directory as --preset: its config.json says"
        )
    return family.name


def _check_hub_access(handle: str) -> None:
    if platforms.in_kagglehub_cache(handle):
        return
    if platforms.use_kaggle_secrets():
        print("note: using the Kaggle credentials from this notebook's secrets", file=sys.stderr)
    if not platforms.kaggle_credentials_present():
        raise UserError(
            f"preset {handle} is downloaded from Kaggle, and no Kaggle credentials were found. Set "
            "KAGGLE_USERNAME and KAGGLE_KEY (or write ~/.kaggle/kaggle.json) after accepting the Gemma "
            "license at kaggle.com/models/google/gemma;\nin a Kaggle notebook, attach the model (it is found under /kaggle/input) "
            "or add KAGGLE_USERNAME and KAGGLE_KEY as notebook secrets; or run offline with --preset tiny"
        )
    if not platforms.reachable("www.kaggle.com"):
        raise UserError(
            f"cannot reach kaggle.com to download {handle}; check the network, pass a local preset "
            "directory as --preset, or run offline with --preset tiny"
        )


def preset_sequence_length(source: Source) -> int:
    """The sequence length the preset's own preprocessor has, before a run sets its --seq-len."""
    import inspect

    import keras_hub

    if source.kind == "tiny" or source.transformers:  # no keras-hub preprocessor config: the class default
        cls = families.keras_hub_class(families.get(source.family), "preprocessor")
        return inspect.signature(cls.__init__).parameters["sequence_length"].default
    return keras_hub.models.CausalLMPreprocessor.from_preset(source.handle).sequence_length


# Text-only tokenizers and preprocessors: the tiny presets have no image, audio or video encoders.
_TOKENIZER_ARGS = {"gemma3": dict(has_vision_tokens=False), "gemma4": dict(has_vision_tokens=False,
                   has_video_tokens=False)}  # fmt: skip
_PREPROCESSOR_ARGS = {"gemma3": dict(image_converter=None), "gemma3n": dict(image_converter=None,
                      audio_converter=None), "gemma4": dict(image_converter=None, audio_converter=None,
                      video_converter=None)}  # fmt: skip
# A vision preset's tokenizer has the image tokens; Gemma 4's would also look for video ones, which it lacks.
_VISION_TOKENIZER_ARGS = {"gemma4": dict(has_video_tokens=False)}


def tiny_tokenizer(name: str = "tiny"):
    """The tiny preset's tokenizer, of its family's keras-hub class; with its image tokens where it sees images,
    its audio tokens where it hears."""
    spec = TINY[name]
    if spec.audio is not None and spec.family == "gemma4":
        cls = families.keras_hub_class(families.get(spec.family), "tokenizer")
        return cls(proto=str(spec.tokenizer), has_vision_tokens=False, has_audio_tokens=True, has_video_tokens=False)
    if spec.vision is not None:
        cls = families.keras_hub_class(families.get(spec.family), "tokenizer")
        return cls(proto=str(spec.tokenizer), **_VISION_TOKENIZER_ARGS.get(spec.family, {}))
    return text_tokenizer(spec.family, spec.tokenizer)


def text_tokenizer(family: str, proto: Path):
    """A text-only tokenizer of the family's keras-hub class from a SentencePiece model file."""
    cls = families.keras_hub_class(families.get(family), "tokenizer")
    return cls(proto=str(proto), **_TOKENIZER_ARGS.get(family, {}))


def tiny_preprocessor(name: str, tokenizer, sequence_length: int):
    spec = TINY[name]
    if spec.audio is not None and spec.family == "gemma3n":
        import keras_hub

        cls = families.keras_hub_class(families.get(spec.family), "preprocessor")
        converter = keras_hub.layers.Gemma3nAudioConverter(**spec.audio["converter"])
        # keras-hub counts the pictures' room against the sequence length too: an audio model takes none.
        return cls(tokenizer=tokenizer, sequence_length=sequence_length, image_converter=None,
                   audio_converter=converter, max_images_per_prompt=0, max_audios_per_prompt=1,
                   num_audio_tokens_per_audio=spec.audio["tokens"])  # fmt: skip
    if spec.audio is not None:
        import keras_hub

        cls = families.keras_hub_class(families.get(spec.family), "preprocessor")
        converter = keras_hub.layers.Gemma4AudioConverter(**spec.audio["converter"])
        return cls(tokenizer=tokenizer, sequence_length=sequence_length, image_converter=None, video_converter=None,
                   audio_converter=converter, audio_input_feat_size=spec.audio["input_feat_size"])  # fmt: skip
    if spec.vision is not None:
        cls = families.keras_hub_class(families.get(spec.family), "preprocessor")
        arguments = _vision_preprocessing(spec.family, spec.vision)
        # Built at a length that holds its pictures' room (keras-hub refuses less there), then given the run's, as
        # a real preset's is after loading: a run whose rows cannot hold a picture says so for its data.
        preprocessor = cls(tokenizer=tokenizer, sequence_length=max(sequence_length, 1024), **arguments)
        preprocessor.sequence_length = sequence_length
        return preprocessor
    cls = families.keras_hub_class(families.get(spec.family), "preprocessor")
    return cls(tokenizer=tokenizer, sequence_length=sequence_length, **_PREPROCESSOR_ARGS.get(spec.family, {}))


def _vision_preprocessing(family: str, vision: dict) -> dict:
    """The preprocessor's image arguments for a tiny vision encoder: keras-hub's image converter of the family at
    its size, and its soft tokens per image.

    Gemma 3's converter resizes to the encoder's square and scales pixels to [-1, 1] (SigLIP's mean and deviation
    of 0.5). Gemma 4's keeps the aspect, resizing to at most `tokens` soft tokens' worth of patches, and scales to
    [0, 1] (its encoder maps them to [-1, 1] itself), as transformers' Gemma 4 processor does.
    """
    import keras_hub

    if family == "gemma3n":
        # MobileNetV5 takes pixels in [0, 1], as transformers' Gemma 3n processor rescales them (no normalizing).
        converter = keras_hub.layers.Gemma3nImageConverter(image_size=tuple(vision["image_shape"][:2]), scale=1 / 255)
        # keras-hub counts the audio clips' room against the sequence length too: a picture model takes none.
        return dict(image_converter=converter, num_vision_tokens_per_image=vision["msfa_output_resolution"] ** 2,
                    audio_converter=None, max_audios_per_prompt=0)  # fmt: skip
    size, patch, pool = vision["image_size"], vision["patch_size"], vision["pool_size"]
    tokens = (size // patch // pool) ** 2
    if family == "gemma4":
        converter = keras_hub.layers.Gemma4ImageConverter(
            patch_size=patch, max_soft_tokens=tokens, pooling_kernel_size=pool, scale=1 / 255
        )
        return dict(image_converter=converter, num_vision_tokens_per_image=tokens, audio_converter=None,
                    video_converter=None)  # fmt: skip
    converter = keras_hub.layers.Gemma3ImageConverter(image_size=(size, size), scale=1 / 127.5, offset=-1.0)
    return dict(image_converter=converter, num_vision_tokens_per_image=tokens)


def _vision_encoder(family: str, vision: dict, output_dim: int, dtype):
    import keras_hub

    cls = keras_hub.models.Gemma4VisionEncoder if family == "gemma4" else keras_hub.models.Gemma3VisionEncoder
    return cls(output_dim=output_dim, dtype=dtype, **vision)


def _tokens_per_clip(audio: dict) -> int:
    """The soft tokens of a whole clip: its longest, in frames of 10 ms, 4 to a token."""
    return (int(audio["converter"]["max_audio_length"]) * 100 + 3) // 4


def _gemma3n_audio(spec: Tiny, vocabulary_size: int) -> dict:
    """A tiny Gemma 3n's audio encoder arguments, its soft tokens a clip, and the ids it places clips by; its
    multimodal embedder takes every id from `audio_vocab_offset` up as a clip's own token, past the tokenizer's."""
    import sentencepiece

    pieces = sentencepiece.SentencePieceProcessor(model_file=str(spec.tokenizer))
    encoder = {key: value for key, value in spec.audio.items() if key not in ("converter", "tokens")}
    return dict(audio_encoder_config=encoder, audio_hidden_size=spec.audio["hidden_size"],
                audio_soft_tokens_per_image=spec.audio["tokens"],
                audio_token_id=pieces.piece_to_id("<audio_soft_token>"), audio_vocab_offset=vocabulary_size + 8,
                audio_vocab_size=8)  # fmt: skip


def _gemma3n_vision(spec: Tiny, vocabulary_size: int) -> dict:
    """A tiny Gemma 3n's image encoder arguments: its MobileNetV5 config, its soft tokens, and the ids keras-hub's
    Gemma 3n places pictures by. Its multimodal embedder takes every id from `vision_vocab_offset` up as a picture's
    own token, so that range starts past the tokenizer's, as Gemma 3n's does (262,144 of 262,400)."""
    import sentencepiece

    pieces = sentencepiece.SentencePieceProcessor(model_file=str(spec.tokenizer))
    return dict(vision_encoder_config=dict(spec.vision), vision_hidden_size=spec.vision["num_features"],
                vision_soft_tokens_per_image=spec.vision["msfa_output_resolution"] ** 2,
                image_token_id=pieces.piece_to_id("<image_soft_token>"), vision_vocab_offset=vocabulary_size,
                vision_vocab_size=8)  # fmt: skip


def tiny_config(name: str, vocabulary_size: int) -> dict:
    """The tiny preset's whole backbone config, with the tokenizer's vocabulary size."""
    spec = TINY[name]
    keys = _VOCABULARY_KEYS.get(spec.family, ("vocabulary_size",))
    return dict(spec.config, **{key: vocabulary_size for key in keys})


def tiny_vocabulary_size(name: str = "tiny") -> int:
    """The tiny tokenizer's vocabulary size, read with sentencepiece alone (no keras)."""
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(TINY[name].tokenizer)).get_piece_size()


def tiny_backbone(vocabulary_size: int, dtype=None, name: str = "tiny"):
    """A tiny preset's backbone with its base weights, the same on every backend.

    `tiny` loads its shipped weights (tools/make_tiny_weights.py). The other
    tiny presets draw each matrix from numpy's generator seeded by its path
    (normal, std 0.1) and keep keras' constant start for the vectors and
    scalars (norm scales, per-expert scales): an adapter trained on one backend
    applies on another.
    dtype: a policy, or quantized.policies' map: each quantized kernel is filled from the float weights it
        would have had.
    """
    import numpy as np

    from finetune.model import quantized

    spec = TINY[name]
    cls = families.keras_hub_class(families.get(spec.family), "backbone")
    config = tiny_config(name, vocabulary_size)
    if spec.audio is not None and spec.family == "gemma3n":
        config.update(_gemma3n_audio(spec, vocabulary_size))
    elif spec.audio is not None:
        import keras_hub

        arguments = {key: value for key, value in spec.audio.items() if key != "converter"}
        # The encoder computes in float32 whatever the decoder's precision, as the vision encoders do.
        encoder = keras_hub.models.Gemma4AudioEncoder(output_dim=config["hidden_dim"], **arguments)
        config.update(audio_encoder=encoder, num_audio_tokens_per_clip=_tokens_per_clip(spec.audio))
    if spec.family == "gemma3n" and spec.vision is not None:
        config.update(_gemma3n_vision(spec, vocabulary_size))
    elif spec.vision is not None:
        # The encoder computes in float32 whatever the decoder's precision (keras-hub's choice for bfloat16).
        encoder = _vision_encoder(spec.family, spec.vision, config["hidden_dim"], None)
        config.update(vision_encoder=encoder, image_size=spec.vision["image_size"])
    backbone = cls(dtype=dtype, **config)
    stored = np.load(spec.weights) if spec.weights is not None else None

    def value(path: str, shape) -> np.ndarray | None:
        if stored is not None:
            return stored[path].astype(np.float32)
        if len(shape) < 2:
            return None
        rng = np.random.default_rng([WEIGHT_SEED, zlib.crc32(path.encode())])
        return rng.normal(0.0, 0.1, tuple(shape)).astype(np.float32)

    try:
        compressed = quantized.quantized_layers(backbone)
        for layer in compressed:
            quantized.fill(layer, lambda shape, path=f"{layer.path}/kernel": value(path, shape))
        done = {id(v) for layer in compressed for v in layer.weights}
        paths = families.weight_paths(backbone)
        for weight in backbone.weights:
            start = value(paths[id(weight)], tuple(weight.shape)) if id(weight) not in done else None
            if start is not None:
                weight.assign(start)
    finally:
        if stored is not None:
            stored.close()
    return backbone


def dims(source: Source):
    """The backbone's sizes, read without building it: the layouts are set before the weights exist.

    A hub preset's come from the package's table (archs.py) when it has them, else from the preset's
    config.json, which keras-hub downloads alone.
    """
    from finetune.model import layouts

    try:
        return layouts.Dims.from_backbone_config(backbone_config(source), source.family)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"preset {source.handle} has no usable backbone size {e} in its config.json") from None


def backbone_config(source: Source) -> dict:
    """The preset's backbone config (config.json's "config"), read without building the backbone."""
    from finetune.model import archs

    if source.kind == "tiny":
        return tiny_config(source.handle, tiny_vocabulary_size(source.handle))
    if source.kind == "local":
        return directory_backbone(Path(source.handle))[1]
    if source.handle.startswith(checkpoints.PREFIX):
        described = checkpoints.hub_config(source.handle)
        if checkpoints.is_transformers(described):
            return checkpoints.backbone_config(described, source.family)
        return described.get("config", {})
    parts = source.handle.removeprefix("kaggle://").split("/")
    arch = archs.lookup(parts[3] if len(parts) > 3 else parts[0])
    if arch is not None:
        return arch.config
    return keras_compat.preset_config(source.handle).get("config", {})
