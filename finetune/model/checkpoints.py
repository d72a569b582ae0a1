"""Transformers checkpoints as a --preset: a local directory, or an `hf://ORG/NAME` repository on the Hugging Face Hub.

keras-hub builds a Gemma from a transformers config.json and its safetensors through its own converters
(keras_hub/src/utils/transformers/), told apart from a keras-hub preset by config.json's `model_type` where a
preset has a `class_name`. Here, without keras: which model types it converts to which family, whether a
directory holds what the converter reads, the sizes the plan and the layouts need (the converter's mapping of
the keys finetune reads), and, for `hf://`, the repository's config.json, from the Hugging Face cache or
downloaded alone, failing in seconds offline instead of retrying.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune.platform import platforms
from finetune.platform.errors import UserError

PREFIX = "hf://"
# transformers' model_type -> the family keras-hub's converter builds (its preset_loader.py). Gemma 3n is not
# among them: keras-hub's converter reads only the multimodal gemma3n checkpoint, and ports its image and audio
# encoders' weights unconditionally, which a text run leaves out (families.Family.encoders).
MODEL_TYPES = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
}
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
TOKENIZERS = ("tokenizer.model", "tokenizer.json")
_HELP = "--preset takes a transformers directory (config.json, safetensors, tokenizer) or hf://ORG/NAME"


def is_transformers(described: dict) -> bool:
    """A transformers config.json names its `model_type`; a keras-hub one its `class_name`."""
    return "model_type" in described and "class_name" not in described


def family_of(described: dict, where: str) -> str:
    """The family keras-hub's converter builds from this transformers config; a UserError for another model."""
    model_type = str(described.get("model_type") or "")
    family = MODEL_TYPES.get(model_type)
    if family is not None:
        return family
    if model_type.startswith("gemma3n"):
        raise UserError(
            f"{where} is a transformers Gemma 3n, which finetune cannot train from transformers weights yet "
            "(keras-hub's converter needs its image and audio encoders); pass the keras-hub preset (gemma3n_e2b) "
            "or a `finetune export --format merged` directory"
        )
    known = ", ".join(MODEL_TYPES)
    what = "a Gemma keras-hub does not convert" if "gemma" in model_type else "not a Gemma"
    raise UserError(f"{where} holds a transformers {model_type or 'unnamed'} model, {what}; finetune reads {known}")


def check_directory(path: Path) -> None:
    """Refuse a transformers directory that lacks the weights or tokenizer the converter reads."""
    if not any((path / name).is_file() for name in WEIGHTS):
        found = sorted(p.name for p in path.glob("*.bin")) or sorted(p.name for p in path.glob("*.pt*"))
        why = f"it holds {found[0]}, which keras-hub does not read; " if found else ""
        raise UserError(
            f"{path} has a transformers config.json but no safetensors weights ({' or '.join(WEIGHTS)}); "
            f"{why}save the model with save_pretrained(safe_serialization=True)"
        )
    if not any((path / name).is_file() for name in TOKENIZERS):
        raise UserError(
            f"{path} has no tokenizer ({' or '.join(TOKENIZERS)}); copy the model's tokenizer files beside config.json"
        )


def unigram_tokenizer(path: Path) -> Path | None:
    """tokenizer.model where tokenizer.json is no BPE model: keras-hub's Gemma 4 converter rebuilds the
    SentencePiece model from tokenizer.json's BPE merges, and a unigram one (finetune's hf export of a
    tiny-gemma4 run) has none. None where the converter's way works."""
    model, described = path / "tokenizer.model", path / "tokenizer.json"
    if not model.is_file():
        return None
    try:
        kind = json.loads(described.read_text(encoding="utf-8"))["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError):
        kind = None
    return None if kind == "BPE" else model


def converter_overrides(described: dict, family: str) -> dict:
    """Backbone arguments that correct keras-hub's converter, given to its loader beside the config it maps.

    keras-hub's Gemma4Backbone reads num_global_key_value_heads as "the global layers' values reuse their keys"
    (26b_a4b, 31b); transformers says that with attention_k_eq_v, and also writes num_global_key_value_heads
    where the values are their own (keras-hub's exporter does for every Gemma 4). Its converter takes the count
    alone, so such a checkpoint loaded with the values dropped: logits 1.9 away from the model exported.
    """
    text = described.get("text_config") or described
    if family == "gemma4" and text.get("attention_k_eq_v") is False:
        return {"num_global_key_value_heads": None}
    return {}


# === Sizes, read as keras-hub's converters map them ===


def backbone_config(described: dict, family: str) -> dict:
    """The keras-hub backbone config keys finetune reads (layouts.Dims, layouts' rules, archs), from a
    transformers config, as keras-hub's converter for `family` maps them. The encoders are left out: finetune
    trains the text decoder."""
    text = described.get("text_config") or described
    try:
        config = {
            "vocabulary_size": text["vocab_size"],
            "num_layers": text["num_hidden_layers"],
            "num_query_heads": text["num_attention_heads"],
            "num_key_value_heads": text["num_key_value_heads"],
            "hidden_dim": text["hidden_size"],
            "head_dim": text["head_dim"],
        }
        if family == "gemma":  # keras-hub's Gemma counts both gates in intermediate_dim
            gemma2 = described.get("model_type") == "gemma2"
            return dict(config, intermediate_dim=2 * int(text["intermediate_size"]), use_post_ffw_norm=gemma2,
                        use_post_attention_norm=gemma2, final_logit_soft_cap=text.get("final_logit_softcapping"))  # fmt: skip
        config["intermediate_dim"] = text["intermediate_size"]
        if family == "gemma3":
            return dict(config, use_post_ffw_norm=True, use_post_attention_norm=True, use_query_key_norm=True)
        return dict(config, **_gemma4(text))
    except (KeyError, TypeError) as e:
        raise UserError(f"this transformers config.json lacks {e}, which keras-hub's converter reads") from None


def _gemma4(text: dict) -> dict:
    return {
        "layer_types": text["layer_types"],
        "global_head_dim": text.get("global_head_dim"),
        "num_global_key_value_heads": converter_overrides(text, "gemma4").get(
            "num_global_key_value_heads", text.get("num_global_key_value_heads")
        ),
        "num_kv_shared_layers": text.get("num_kv_shared_layers", 0),
        "use_double_wide_mlp": text.get("use_double_wide_mlp", False),
        "hidden_size_per_layer_input": text.get("hidden_size_per_layer_input") or 0,
        "vocab_size_per_layer_input": text.get("vocab_size_per_layer_input"),
        "final_logit_soft_cap": text.get("final_logit_softcapping"),
        "enable_moe_block": text.get("enable_moe_block", False),
        "num_experts": text.get("num_experts"),
        "expert_intermediate_dim": text.get("moe_intermediate_size") or text.get("expert_intermediate_size"),
        "num_experts_per_token": text.get("top_k_experts") or 8,
    }


# === hf:// repositories ===


def repo_id(handle: str) -> str:
    """ORG/NAME of hf://ORG/NAME; a UserError for another shape."""
    name = handle.removeprefix(PREFIX).strip("/")
    parts = name.split("/")
    if len(parts) != 2 or not all(parts):
        raise UserError(f"{handle} is not a Hugging Face model; write it as hf://ORG/NAME, e.g. hf://google/gemma-2b")
    return name


def cached_config(handle: str) -> dict | None:
    """The repository's config.json from the local Hugging Face cache, without the network; None when absent."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id(handle), "config.json")
    if not isinstance(found, str):
        return None
    return _read_config(Path(found), handle)


def hub_config(handle: str) -> dict:
    """The repository's config.json: cached, else downloaded alone; a UserError in seconds where it cannot be."""
    cached = cached_config(handle)
    if cached is not None:
        platforms.use_hugging_face_cache_only_when_offline()  # keras-hub then reads the cache, not the network
        return cached
    try:
        import huggingface_hub
    except ImportError:
        raise UserError(f"{handle} is on the Hugging Face Hub: pip install huggingface_hub") from None
    token = "set" if os.environ.get("HF_TOKEN") or huggingface_hub.get_token() else "not set"
    if not platforms.reachable("huggingface.co"):
        raise UserError(
            f"cannot reach huggingface.co to download {handle}, and it is not in the Hugging Face cache; check the "
            f"network (HF_TOKEN is {token}: Gemma repositories need it once their license is accepted), "
            "or pass a local transformers directory as --preset, or run offline with --preset tiny"
        )
    try:
        path = huggingface_hub.hf_hub_download(repo_id(handle), "config.json")
    except Exception as e:  # noqa: BLE001 - gated, missing and network errors come in many types
        gated = "Gated" in type(e).__name__ or "401" in str(e) or "403" in str(e)
        why = (
            f"it is gated: accept its license on huggingface.co and set HF_TOKEN (it is {token})"
            if gated
            else f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else 'no detail'}"
        )
        raise UserError(f"could not download {handle}'s config.json from the Hugging Face Hub; {why}") from None
    return _read_config(Path(path), handle)


def _read_config(path: Path, where: str) -> dict:
    try:
        described = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{where}'s config.json is not valid JSON") from None
    if not isinstance(described, dict):
        raise UserError(f"{where}'s config.json holds a {type(described).__name__}, not a JSON object")
    return described
