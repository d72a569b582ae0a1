"""Gemma 3n and Gemma 4 as GGUF: finetune's transformers export, converted by the rules of llama.cpp's converter.

llama.cpp's convert_hf_to_gguf.py writes these families from a transformers
checkpoint (its Gemma3NModel and Gemma4Model); this applies its rules to
finetune's own transformers export of the merged model
(export.write_transformers, whose layout tests/test_families.py checks
against transformers), so the names, layouts and metadata are the ones
llama.cpp's loader reads:

- Names: gguf's own map for the architecture (gguf.get_tensor_name_map),
  from transformers' names. Gemma 3n stacks its AltUp projections into one
  tensor each; Gemma 4 keeps its experts fused (ffn_gate_up_exps,
  ffn_down_exps), its router's scale as ffn_gate_inp.scale and the experts'
  as ffn_down_exps.scale, and adds rope_freqs, which turns off the rotation
  of the dimensions its global layers leave unrotated.
- Values: as transformers holds them; these families' norms multiply by the
  stored weight, as llama.cpp's do, so nothing is shifted.
- Types: vectors, norms, routers and AltUp's coefficients f32, as the
  converter keeps them; other matrices as --dtype (f16 where a q8_0 row is
  not whole blocks, as the converter falls back).
- Metadata: the converter's keys, per layer where the layers differ (Gemma
  4's feed-forward widths, key/value heads, sliding pattern; Gemma 3n's
  activation sparsity).

The vocabulary is written as llamacpp.py writes Gemma's (SentencePiece pieces
with their scores), not as the converter's Gemma 4 "gemma4" BPE-with-merges
form, which needs the tokenizer's merges that a SentencePiece model does not
list; llama.cpp tokenizes by the scores the same way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

ARCHITECTURES = ("gemma3n", "gemma4")
_CONTEXT = 131072  # the converter's context length when the config names none (keras-hub keeps no maximum)
_FLOAT_TENSORS = ("ffn_gate_inp", "altup_correct_coef", "altup_predict_coef")  # kept f32 by the converter
_ALTUP = {"altup_projections": "model.altup_projections.weight",
          "altup_unembed_projections": "model.altup_unembed_projections.weight"}  # fmt: skip


def tensors(weights: dict, config: dict, arch: str) -> dict:
    """{GGUF tensor name: float32 array} from transformers' `weights` of a Gemma 3n or 4 text model."""
    import gguf
    import numpy as np

    model_arch = {"gemma3n": gguf.MODEL_ARCH.GEMMA3N, "gemma4": gguf.MODEL_ARCH.GEMMA4}[arch]
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    out, stacked = {}, {key: {} for key in _ALTUP}
    if arch == "gemma4":
        out["rope_freqs.weight"] = _rope_freqs(config)
    for name, value in weights.items():
        value = np.asarray(value, dtype=np.float32).reshape(np.shape(value) or (1,))
        parts = name.split(".")
        if arch == "gemma3n" and len(parts) > 2 and parts[1] in _ALTUP:
            stacked[parts[1]][int(parts[2])] = value
            continue
        block = next((int(p) for p in parts if p.isdecimal()), None)
        if arch == "gemma4" and name.endswith("router.scale"):
            out[f"blk.{block}.ffn_gate_inp.scale"] = value
            continue
        if arch == "gemma4" and name.endswith("router.per_expert_scale"):
            out[f"blk.{block}.ffn_down_exps.scale"] = value
            continue
        if name.endswith(("_scale", "layer_scalar", "per_dim_scale")) or (
            ".experts." in name and not name.endswith(".weight")
        ):
            name += ".weight"  # bare parameters, named as the map knows them
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"llama.cpp's {arch} map has no name for {name}")
        out[mapped] = value
    for key, parts in stacked.items():
        if parts:
            out[names.get_name(_ALTUP[key], try_suffixes=(".weight",))] = np.stack([parts[i] for i in sorted(parts)])
    return out


def _rope_freqs(config: dict):
    """Gemma 4's global layers rotate the first partial_rotary_factor of each half of a head, with frequencies
    as for the whole head ("proportional"); llama.cpp rotates every pair and divides the angle of the rest by
    1e30, so that they stay put."""
    import numpy as np

    head_dim = config["global_head_dim"]
    factor = config["rope_parameters"]["full_attention"].get("partial_rotary_factor", 1.0)
    rotated = int(head_dim * factor / 2)
    return np.array([1.0] * rotated + [1e30] * (head_dim // 2 - rotated), dtype=np.float32)


def tensor_type(name: str, value, dtype: str):
    """The GGML type llama.cpp's converter gives this tensor under --outtype `dtype`."""
    import gguf

    from finetune.exports import llamacpp

    kept = any(f".{key}." in f".{name}" for key in _FLOAT_TENSORS)
    if value.ndim < 2 or kept or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    return llamacpp.tensor_type(value, dtype)


def write(path: Path, exported: Path, arch: str, tokenizer, dtype: str = "f16", about=None) -> None:
    """Write model.gguf from the transformers export in `exported` (config.json, model.safetensors) of a Gemma
    3n or 4 text decoder, with `tokenizer`'s vocabulary; `about`: llamacpp.About, its name and chat template."""
    import gguf
    from safetensors.numpy import load_file

    from finetune.exports import llamacpp

    about = about or llamacpp.About()
    config = json.loads((exported / "config.json").read_text(encoding="utf-8"))
    config = {**config, **config.get("text_config", {})}
    weights = tensors(
        {k.replace("language_model.", ""): v for k, v in load_file(str(exported / "model.safetensors")).items()},
        config,
        arch,
    )
    vocab = llamacpp.vocabulary(tokenizer, weights["token_embd.weight"].shape[0])
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(about.name)
    writer.add_file_type(llamacpp.file_type(dtype))
    _hyperparameters(writer, config, arch)
    llamacpp.add_tokenizer(writer, vocab, about.chat_template)
    llamacpp.write_tensors(writer, weights, lambda tensor_name, value: tensor_type(tensor_name, value, dtype))


def _hyperparameters(writer, config: dict, arch: str) -> None:
    """The keys llama.cpp's converter writes for Gemma 3n (Gemma3NModel) and Gemma 4 (Gemma4Model)."""
    blocks, sliding = config["num_hidden_layers"], [t == "sliding_attention" for t in config["layer_types"]]
    rope = config["rope_parameters"]
    shared = config.get("num_kv_shared_layers") or 0
    writer.add_block_count(blocks)
    writer.add_context_length(config.get("max_position_embeddings", _CONTEXT))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    writer.add_sliding_window(config["sliding_window"])
    writer.add_sliding_window_pattern(sliding)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    ff, kv = config["intermediate_size"], config["num_key_value_heads"]
    if arch == "gemma3n":
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_altup_active_idx(config["altup_active_idx"])
        writer.add_altup_num_inputs(config["altup_num_inputs"])
        # A layer keeps the activations above this many standard deviations (the normal quantile of its
        # sparsity); 0 keeps all of them (-inf).
        writer.add_activation_sparsity_scale([_normal_quantile(s) for s in config["activation_sparsity_pattern"]])
    else:
        writer.add_key_length(config["global_head_dim"])
        writer.add_value_length(config["global_head_dim"])
        writer.add_key_length_swa(config["head_dim"])
        writer.add_value_length_swa(config["head_dim"])
        writer.add_rope_dimension_count(config["global_head_dim"])
        writer.add_rope_dimension_count_swa(int(config["head_dim"] * rope.get("partial_rotary_factor", 1.0)))
        if config.get("use_double_wide_mlp"):  # the layers that borrow keys and values have twice the width
            ff = [ff if i < blocks - shared else 2 * ff for i in range(blocks)]
        if config.get("num_global_key_value_heads") is not None:
            kv = [kv if s else config["num_global_key_value_heads"] for s in sliding]
        if config.get("enable_moe_block"):
            writer.add_expert_count(config["num_experts"])
            writer.add_expert_used_count(config["top_k_experts"])
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_feed_forward_length(ff)
    writer.add_head_count_kv(kv)


def _normal_quantile(p: float) -> float:
    from statistics import NormalDist

    return -math.inf if p <= 0 else math.inf if p >= 1 else NormalDist().inv_cdf(p)
