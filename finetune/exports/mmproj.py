"""A Gemma 3 model's picture encoder as llama.cpp's projector file, mmproj.gguf (beside model.gguf).

llama.cpp reads a vision model as two files: the text decoder (model.gguf)
and its picture encoder with the projector into the decoder's width, a
"clip" GGUF that its mtmd tools take with --mmproj. llama.cpp's converter
(convert_hf_to_gguf.py --mmproj) writes it from a transformers checkpoint;
this writes the same from finetune's transformers export of the run
(export.write_transformers, checked against transformers' own
Gemma3ForConditionalGeneration), so the SigLIP tower and projector carry the
weights the run's model used:

- Tensor names: gguf's own map for the clip architecture, from the Hub's
  transformers names (v.patch_embd, v.position_embd, v.blk.N.attn_q/k/v/out,
  ln1, ln2, ffn_up, ffn_down, v.post_ln, mm.input_projection,
  mm.soft_emb_norm).
- Values: as transformers holds them, but the projector's RMSNorm scale,
  which Gemma multiplies by (1 + scale) and llama.cpp by the stored weight.
- Types: vectors f32; the patch and position embeddings f32 and the input
  projection f16, as the converter forces them; other matrices as --dtype.
- Metadata: clip.projector_type gemma3, the tower's sizes, the pixel mean and
  std, and the pooling factor where it is not Gemma 3's 4.

Only Gemma 3's SigLIP tower has this form here; any other encoder is refused
before anything is written (export.check_encoders).
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "mmproj.gguf"
# The names finetune's transformers export gives (transformers 5) -> the Hub checkpoints' names, which
# llama.cpp's converter and gguf's name map read.
_HUB_PREFIXES = (("model.vision_tower.", "vision_tower.vision_model."),
                 ("model.multi_modal_projector.", "multi_modal_projector."))  # fmt: skip
_DEFAULT_POOLING = 4  # llama.cpp's gemma3 projector pools 4x4 patches unless the file says otherwise


def tensors(weights: dict, blocks: int) -> dict:
    """{clip tensor name: float32 array} of the vision tower and projector in transformers' `weights`."""
    import gguf
    import numpy as np

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, blocks)
    out = {}
    for name, value in weights.items():
        hub = next((name.replace(a, b, 1) for a, b in _HUB_PREFIXES if name.startswith(a)), None)
        if hub is None:
            continue  # the text decoder: model.gguf holds it
        hub = hub.replace("_weight", ".weight")  # mm_input_projection_weight is a bare parameter
        mapped = names.get_name(hub, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"llama.cpp's clip map has no name for {hub}")
        value = np.asarray(value, dtype=np.float32)
        if "soft_emb_norm" in hub:
            value = value + 1.0  # Gemma's RMSNorm scales by 1 + weight, llama.cpp's by the weight
        out[mapped] = value
    return out


def tensor_type(name: str, value, dtype: str):
    """The GGML type llama.cpp's converter gives this clip tensor under --outtype `dtype`."""
    import gguf

    from finetune.exports import llamacpp

    types = gguf.GGMLQuantizationType
    if value.ndim < 2 or name.startswith(("v.patch_embd.", "v.position_embd.")):
        return types.F32
    if name.startswith("mm.input_projection."):
        return types.F16
    return llamacpp.tensor_type(value, dtype)


def write(path: Path, exported: Path, dtype: str = "f16", name: str = "finetune") -> None:
    """Write mmproj.gguf from the transformers export in `exported` (config.json, preprocessor_config.json,
    model.safetensors) of a Gemma 3 model with pictures."""
    import gguf
    from safetensors.numpy import load_file

    from finetune.exports import llamacpp

    config = json.loads((exported / "config.json").read_text(encoding="utf-8"))
    pixels = json.loads((exported / "preprocessor_config.json").read_text(encoding="utf-8"))
    vision, text = config["vision_config"], config["text_config"]
    weights = tensors(load_file(str(exported / "model.safetensors")), vision["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(name)
    writer.add_file_type(llamacpp.file_type(dtype))
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(text["hidden_size"])
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["num_hidden_layers"])
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_image_mean([float(x) for x in pixels["image_mean"]])
    writer.add_vision_image_std([float(x) for x in pixels["image_std"]])
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(float(vision.get("layer_norm_eps", 1e-6)))
    writer.add_vision_use_gelu(True)
    # The projector average-pools the patch grid into mm_tokens_per_image soft tokens: pooling factor = patches
    # per side / tokens per side (4 for Gemma 3: 64 / 16); llama.cpp reads it from the file where it differs.
    pooling = (vision["image_size"] // vision["patch_size"]) // round(config["mm_tokens_per_image"] ** 0.5)
    if pooling != _DEFAULT_POOLING:
        writer.add_vision_projector_scale_factor(pooling)
    llamacpp.write_tensors(writer, weights, lambda tensor_name, value: tensor_type(tensor_name, value, dtype))
