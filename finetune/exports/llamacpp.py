"""The merged model as one GGUF file for llama.cpp and Ollama (`finetune export --format gguf`).

GGUF is llama.cpp's format: metadata (the architecture's hyperparameters and
the tokenizer's vocabulary) and named tensors, written here with the `gguf`
package, llama.cpp's own writer. What llama.cpp expects of Gemma, and how it
differs from keras-hub:

- Tensor names: token_embd, output_norm, and per block blk.N.attn_norm,
  attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down
  (Gemma 2 and 3 add post_attention_norm and post_ffw_norm, Gemma 3
  attn_q_norm and attn_k_norm). The output projection is token_embd (tied).
- Layout: a matrix is stored as transformers' Linear weight, (out, in) in
  numpy's order, which GGUF records reversed as (in, out); the writer does
  that. keras-hub's per-head kernels are flattened head by head.
- Norms: Gemma's RMSNorm multiplies by (1 + scale) and keras-hub stores the
  scale; llama.cpp multiplies by the stored weight, so 1 + scale is stored.
- Matrices are f16, bf16, q8_0 or f32 as asked; vectors (the norms) stay f32,
  as llama.cpp's converter keeps them. q8_0 is gguf's own quantizer (blocks
  of 32 weights sharing one f16 scale), as llama.cpp's converter writes
  --outtype q8_0; a matrix whose rows are not whole blocks stays f16, as
  there. The K-quants (q4_k_m) have no Python encoder: they are refused,
  naming llama-quantize, which makes them from the f16 file.

Gemma 1 is `gemma`, Gemma 2 `gemma2`, text Gemma 3 `gemma3`. llama.cpp fixes
some of their choices by architecture (Gemma 3's local RoPE base 10,000 and
its five local layers in six, Gemma 2's local layers on even blocks, the
27B models' query scaling by hidden size / heads), so a model that departs
from them is refused here rather than written to compute differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune.platform.errors import UserError

FILE = "model.gguf"
MODELFILE = "Modelfile"
DTYPES = ("f16", "bf16", "q8_0", "f32")
# K-quants: gguf's Python quantizer has no Q4_K encoder (gguf.quants reads it but cannot write it), and the
# "_m" mixes choose a type per tensor by llama.cpp's rules; llama.cpp's llama-quantize makes them from f16.
LLAMA_QUANTIZED = ("q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q4_0")
# llama.cpp's model sizes that scale queries by 1/sqrt(hidden / heads) instead of 1/sqrt(head_dim): it tells
# them by their layer count (Gemma 2 27B: 46 blocks, Gemma 3 27B: 62).
_HIDDEN_SCALED = {"gemma2": 46, "gemma3": 62}
_WORKS = "finetune writes GGUF for Gemma 1, 2, 3 (text and pictures), 3n (text) and 4 (text); use --format merged or hf"


def architecture(backbone) -> str:
    """llama.cpp's architecture name for `backbone` (gemma, gemma2, gemma3, gemma3n, gemma4), or a UserError saying
    why not."""
    kind = type(backbone).__name__
    if kind in ("Gemma4Backbone", "Gemma3nBackbone"):
        return _newer_architecture(backbone, kind)
    if kind == "GemmaBackbone":
        gemma2 = backbone.use_post_ffw_norm or backbone.final_logit_soft_cap is not None
        if not gemma2:
            if backbone.use_post_attention_norm or backbone.use_sliding_window_attention:
                raise UserError(
                    f"this Gemma model mixes Gemma 1 and 2 layers, which llama.cpp has no form of; {_WORKS}"
                )
            arch = "gemma"
        else:
            complete = backbone.use_post_ffw_norm and backbone.use_post_attention_norm
            capped = backbone.final_logit_soft_cap is not None and backbone.attention_logit_soft_cap is not None
            if not (complete and capped and backbone.use_sliding_window_attention):
                # llama.cpp's gemma2 always has the post norms, sliding layers and both soft caps (50 and 30
                # when the file names none), so a model without one would compute differently there.
                raise UserError(
                    "this Gemma 2 model lacks post norms, soft caps or sliding windows that llama.cpp's gemma2 "
                    f"always applies; {_WORKS}"
                )
            arch = "gemma2"
    elif kind == "Gemma3Backbone":
        if getattr(backbone, "is_embedding_model", False) or backbone.use_bidirectional_attention:
            raise UserError(f"this Gemma 3 model is an embedding model; {_WORKS}")
        if not (backbone.use_query_key_norm and backbone.use_post_ffw_norm and backbone.use_post_attention_norm):
            raise UserError(
                f"this Gemma 3 model lacks the post or query/key norms llama.cpp's gemma3 applies; {_WORKS}"
            )
        if backbone.attention_logit_soft_cap is not None or backbone.final_logit_soft_cap is not None:
            raise UserError(f"this Gemma 3 model has soft caps, which llama.cpp's gemma3 does not apply; {_WORKS}")
        if not backbone.use_sliding_window_attention or backbone.local_rope_scaling_factor != 1.0:
            raise UserError(
                f"llama.cpp's gemma3 has sliding local layers with unscaled RoPE, and this model has not; {_WORKS}"
            )
        arch = "gemma3"
    else:
        raise UserError(f"finetune cannot write a {kind} as GGUF: {_WORKS}")
    if not backbone.token_embedding.tie_weights:
        raise UserError(f"this model's output projection is not its token embedding, as llama.cpp's Gemma is; {_WORKS}")
    if not backbone.query_head_dim_normalize and backbone.hidden_dim // backbone.num_query_heads != backbone.head_dim:
        if _HIDDEN_SCALED.get(arch) != backbone.num_layers:
            raise UserError(
                "this model scales queries by hidden size / heads, which llama.cpp does only for the 27B "
                f"Gemma 2 and 3; {_WORKS}"
            )
    return arch


def _newer_architecture(backbone, kind: str) -> str:
    """Gemma 3n and 4 are written from the transformers export (transformers_gguf.py): what llama.cpp's converter
    takes from a transformers checkpoint of them."""
    if kind == "Gemma3nBackbone":
        streams = backbone.language_model.altup_num_inputs if hasattr(backbone, "language_model") else None
        streams = streams if streams is not None else getattr(backbone, "altup_num_inputs", None)
        if streams != 4:
            # llama.cpp's converter takes Gemma 3n with four AltUp streams only, as Google's E2B and E4B have.
            raise UserError(f"llama.cpp's gemma3n computes 4 AltUp streams and this Gemma 3n has {streams}; {_WORKS}")
        return "gemma3n"
    if getattr(backbone, "is_embedding_model", False) or getattr(backbone, "use_bidirectional_attention", 0) is True:
        raise UserError(f"this Gemma 4 model is an embedding model; {_WORKS}")
    return "gemma4"


def tensors(backbone, arch: str) -> dict:
    """{GGUF tensor name: float32 numpy array in llama.cpp's layout} of every weight llama.cpp's `arch` reads."""
    import numpy as np

    def array(value):
        import keras

        return np.asarray(keras.ops.convert_to_numpy(value), dtype=np.float32)

    def heads_to_rows(kernel):  # (heads, hidden, head_dim) -> (heads * head_dim, hidden), head by head
        heads, hidden, head_dim = kernel.shape
        return kernel.transpose(0, 2, 1).reshape(heads * head_dim, hidden)

    def norm(layer):
        return array(layer.scale) + 1.0

    out = {
        "token_embd.weight": array(backbone.token_embedding.embeddings),
        "output_norm.weight": norm(backbone.get_layer("final_normalization")),
    }
    for i, block in enumerate(backbone.transformer_layers):
        attention, name = block.attention, f"blk.{i}."
        out_kernel = array(attention.output_dense.kernel)  # (heads, head_dim, hidden)
        layer = {
            "attn_norm": norm(block.pre_attention_norm),
            "attn_q": heads_to_rows(array(attention.query_dense.kernel)),
            "attn_k": heads_to_rows(array(attention.key_dense.kernel)),
            "attn_v": heads_to_rows(array(attention.value_dense.kernel)),
            "attn_output": out_kernel.reshape(-1, out_kernel.shape[-1]).T,  # (hidden, heads * head_dim)
            "ffn_norm": norm(block.pre_ffw_norm),
            "ffn_gate": array(block.gating_ffw.kernel).T,  # a Dense kernel is (in, out)
            "ffn_up": array(block.gating_ffw_2.kernel).T,
            "ffn_down": array(block.ffw_linear.kernel).T,
        }
        if arch in ("gemma2", "gemma3"):
            layer["post_attention_norm"] = norm(block.post_attention_norm)
            layer["post_ffw_norm"] = norm(block.post_ffw_norm)
        if arch == "gemma3":
            layer["attn_q_norm"] = norm(attention.query_norm)
            layer["attn_k_norm"] = norm(attention.key_norm)
        out.update({f"{name}{key}.weight": value for key, value in layer.items()})
    return out


def vocabulary(tokenizer, size: int) -> dict:
    """The SentencePiece vocabulary as GGUF's tokenizer metadata, padded with unused pieces to `size` rows."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tokenizer.proto)
    if len(proto.pieces) > size:
        raise UserError(f"the tokenizer has {len(proto.pieces)} pieces but the model embeds {size}; {_WORKS}")
    # SentencePiece's piece types (NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6) are GGUF's.
    pieces = [(p.piece.encode("utf-8"), p.score, p.type) for p in proto.pieces]
    pieces += [(f"[PAD{i}]".encode(), -1000.0, 5) for i in range(len(pieces), size)]
    unigram = proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM
    ids = {p.piece: i for i, p in enumerate(proto.pieces)}
    return {
        # Gemma's vocabularies are SentencePiece BPE, llama.cpp's "llama" tokenizer; a unigram one (tiny's) is
        # its "t5" (UGM) tokenizer.
        "model": "t5" if unigram else "llama",
        "tokens": [p[0] for p in pieces],
        "scores": [float(p[1]) for p in pieces],
        "types": [int(p[2]) for p in pieces],
        "bos": tokenizer.token_to_id(tokenizer.start_token),
        "eos": tokenizer.token_to_id(tokenizer.end_token),
        "pad": tokenizer.pad_token_id,
        "unk": proto.trainer_spec.unk_id,
        "eot": ids.get("<end_of_turn>", ids.get("<turn|>")),  # Gemma 1 to 3n end a turn so, Gemma 4 with <turn|>
        "add_space_prefix": proto.normalizer_spec.add_dummy_prefix,
        "remove_extra_whitespaces": proto.normalizer_spec.remove_extra_whitespaces,
        "charsmap": bytes(proto.normalizer_spec.precompiled_charsmap),
    }


@dataclass(frozen=True)
class About:
    """What a GGUF file says of its model beside the weights and the vocabulary."""

    name: str = "finetune"
    chat_template: str | None = None
    """A chat run's template (the model's own, which the run rendered its records with), as
    tokenizer.chat_template: llama.cpp's server, its Jinja templates on, renders conversations, system messages and
    tools with it.
    None for a text template (dolly, alpaca, none)."""


def write(path: Path, backbone, tokenizer, dtype: str = "f16", about: About = About()) -> None:
    """Write `backbone` (LoRA already merged) and its tokenizer to the GGUF file `path`, matrices in `dtype`."""
    import gguf

    arch = architecture(backbone)
    weights = tensors(backbone, arch)
    vocab = vocabulary(tokenizer, weights["token_embd.weight"].shape[0])
    writer = gguf.GGUFWriter(str(path), arch)
    _hyperparameters(writer, backbone, arch, weights, about.name, dtype)
    add_tokenizer(writer, vocab, about.chat_template)
    write_tensors(writer, weights, lambda tensor_name, value: tensor_type(value, dtype))


def write_tensors(writer, weights: dict, kind_of) -> None:
    """Each of `weights` into the file in the type kind_of(name, value) says (float32 as it is, the others through
    gguf's quantizer), then the header, the metadata and the tensors written out and the file closed."""
    import gguf
    import numpy as np

    for tensor_name, value in weights.items():
        kind = kind_of(tensor_name, value)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor_name, np.ascontiguousarray(value, dtype=np.float32))
        else:
            writer.add_tensor(tensor_name, gguf.quants.quantize(np.ascontiguousarray(value), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def file_type(dtype: str):
    """general.file_type: the type most matrices are stored in."""
    import gguf

    kinds = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}  # fmt: skip
    return kinds.get(dtype, gguf.LlamaFileType.ALL_F32)


def tensor_type(value, dtype: str):
    """The GGML type a tensor is stored in: vectors f32; matrices as `dtype`, but q8_0 only where each row is
    whole blocks of 32 (else f16), as llama.cpp's converter falls back."""
    import gguf

    types = gguf.GGMLQuantizationType
    if value.ndim < 2 or dtype == "f32":
        return types.F32
    kind = {"f16": types.F16, "bf16": types.BF16, "q8_0": types.Q8_0}[dtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    return kind if value.shape[-1] % block == 0 else types.F16


def _hyperparameters(writer, backbone, arch: str, weights: dict, name: str, dtype: str) -> None:
    import gguf

    writer.add_name(name)
    writer.add_file_type(file_type(dtype))
    # keras-hub keeps no maximum position; these are the lengths Google's own configs give: 8k for Gemma 1 and 2,
    # for Gemma 3 128k where its global RoPE is stretched (4b and up, factor 8), else 32k (270m, 1b).
    stretched = arch == "gemma3" and backbone.global_rope_scaling_factor > 1.0
    writer.add_context_length(131072 if stretched else 32768 if arch == "gemma3" else 8192)
    writer.add_embedding_length(backbone.hidden_dim)
    writer.add_block_count(backbone.num_layers)
    writer.add_feed_forward_length(weights["blk.0.ffn_gate.weight"].shape[0])
    writer.add_head_count(backbone.num_query_heads)
    writer.add_head_count_kv(backbone.num_key_value_heads)
    writer.add_key_length(backbone.head_dim)
    writer.add_value_length(backbone.head_dim)
    writer.add_layer_norm_rms_eps(float(backbone.layer_norm_epsilon))
    if arch == "gemma":
        writer.add_rope_freq_base(10000.0)  # keras-hub's Gemma RoPE wavelength
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(backbone.attention_logit_soft_cap))
        writer.add_final_logit_softcapping(float(backbone.final_logit_soft_cap))
        writer.add_sliding_window(int(backbone.sliding_window_size))
    if arch == "gemma3":
        # llama.cpp's local layers use RoPE base 10,000; the file carries the global layers' base and scaling.
        # A model of fewer than six blocks has no global one: keras-hub gives global layers 1,000,000.
        global_block = next((b for b in backbone.transformer_layers if not b.use_sliding_window_attention), None)
        writer.add_rope_freq_base(float(global_block.rope_wavelength) if global_block else 1_000_000.0)
        writer.add_sliding_window(int(backbone.sliding_window_size))
        if backbone.global_rope_scaling_factor != 1.0:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(backbone.global_rope_scaling_factor))


def add_tokenizer(writer, vocab: dict, chat_template: str | None = None) -> None:
    """The vocabulary's metadata (vocabulary()), as llama.cpp's converter writes a SentencePiece tokenizer's, and
    the chat template where there is one (About.chat_template)."""
    if chat_template:
        writer.add_chat_template(chat_template)
    writer.add_tokenizer_model(vocab["model"])
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["types"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    writer.add_pad_token_id(vocab["pad"])
    writer.add_unk_token_id(vocab["unk"])
    if vocab["eot"] is not None:
        writer.add_eot_token_id(vocab["eot"])
    writer.add_add_bos_token(True)  # keras-hub's Gemma preprocessor starts every sequence with <bos>
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(vocab["add_space_prefix"])
    writer.add_remove_extra_whitespaces(vocab["remove_extra_whitespaces"])
    if vocab["charsmap"]:
        writer.add_precompiled_charsmap(vocab["charsmap"])


def modelfile(prompt: str, stop_tokens, projector: str | None = None) -> str:
    """An Ollama Modelfile for model.gguf: the run's prompt template around Ollama's {{ .Prompt }}, greedy.

    projector: str. The picture encoder's file beside it (mmproj.gguf): Ollama takes it as a second FROM.
    """
    lines = [f"FROM ./{FILE}", *([f"FROM ./{projector}"] if projector else [])]
    lines += [f'TEMPLATE """{prompt}"""', "PARAMETER temperature 0"]
    lines += [f'PARAMETER stop "{token}"' for token in stop_tokens]
    return "\n".join(lines) + "\n"
