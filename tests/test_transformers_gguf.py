"""Gemma 3n and Gemma 4 as GGUF (transformers_gguf.py): a run's export read back with gguf's reader, under the names,
shapes and keys llama.cpp's converter writes, with the values of the same run's transformers export (checked against
transformers in test_families.py), and the Gemma 4 file computed as llama.cpp's gemma4 graph computes it, in numpy; the
refusals, through the command line in a fresh process.

No llama.cpp binding installs here (llama-cpp-python builds llama.cpp from source), so these files are not run by
llama.cpp itself, nor compared with `finetune generate` through it.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import BACKEND, REPO, float32_policy
from test_export import TOKENS, read_gguf

import finetune
from finetune.model import presets

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs pip install 'finetune[gguf]'"),
    pytest.mark.backend_neutral,  # the converter is numpy, whichever backend merged the weights
]
SETTINGS = {"model.seq_len": 64, "model.precision": "float32", "train.batch_size": 2, "train.max_steps": 2,
            "train.samples": 0, "data.max_records": 24, "lora.rank": 4, "lora.targets": ["query", "value"]}  # fmt: skip


def trained(preset, folder):
    with float32_policy():
        finetune.run(finetune.load_config("tiny", {**SETTINGS, "backend": BACKEND, "model.preset": preset,
                                                     "output.dir": str(folder / "run")}))  # fmt: skip
    return folder / "run"


def command(*args, cwd):
    """`python -m finetune ARGS` in a fresh process, as a user types it."""
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "finetune", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)  # fmt: skip


def transformers_weights(run, out):
    from safetensors.numpy import load_file

    finetune.export(run, "hf", out)
    return load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """A 2-step tiny-gemma4 run, its GGUF export (f16, from the command line) and its transformers export."""
    folder = tmp_path_factory.mktemp("gemma4")
    run = trained("tiny-gemma4", folder)
    done = command("export", "--run", run, "--format", "gguf", "--output", folder / "gguf", cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "gguf", *transformers_weights(run, folder / "hf"), run


GEMMA4_BLOCK = ["attn_norm", "attn_q", "attn_q_norm", "attn_k", "attn_k_norm", "attn_v", "attn_output",
                "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm", "inp_gate",
                "proj", "post_norm", "layer_output_scale"]  # fmt: skip


def test_a_gemma4_run_exports_gguf_under_llama_cpp_s_gemma4_names_and_keys(gemma4):
    out, hf, config, _ = gemma4
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "finetune-export.json", "model.gguf"]
    tensors, fields = read_gguf(out / "model.gguf")
    names = {"token_embd.weight", "output_norm.weight", "rope_freqs.weight", "per_layer_token_embd.weight",
             "per_layer_model_proj.weight", "per_layer_proj_norm.weight"}  # fmt: skip
    names |= {f"blk.{i}.{n}.weight" for i in range(3) for n in GEMMA4_BLOCK}
    names -= {"blk.2.attn_k.weight", "blk.2.attn_k_norm.weight", "blk.2.attn_v.weight"}  # borrows layer 1's K and V
    assert set(tensors) == names
    assert fields["general.architecture"] == "gemma4" and fields["general.file_type"] == 1
    expected = {
        "gemma4.block_count": 3, "gemma4.embedding_length": 32, "gemma4.attention.head_count": 4,
        "gemma4.attention.head_count_kv": [2, 2, 2], "gemma4.attention.key_length": 16,
        "gemma4.attention.key_length_swa": 8, "gemma4.rope.dimension_count": 16, "gemma4.rope.dimension_count_swa": 8,
        "gemma4.feed_forward_length": [64, 64, 128], "gemma4.attention.sliding_window": 4,
        "gemma4.attention.sliding_window_pattern": [True, False, False], "gemma4.attention.shared_kv_layers": 1,
        "gemma4.embedding_length_per_layer_input": 4, "gemma4.rope.freq_base": 1e6, "gemma4.rope.freq_base_swa": 1e4,
        "gemma4.final_logit_softcapping": 30.0,
    }  # fmt: skip
    assert {key: fields.get(key) for key in expected} == expected
    tokenizer = presets.tiny_tokenizer("tiny-gemma4")
    assert fields["tokenizer.ggml.eot_token_id"] == tokenizer.token_to_id("<turn|>")  # llama.cpp ends a chat turn
    # ggml shapes are transformers' (out, in) reversed; the global layers' heads are twice as wide
    assert tensors["blk.1.attn_q.weight"][:2] == ((32, 64), "F16") and tensors["blk.0.attn_q.weight"][0] == (32, 32)
    assert tensors["blk.2.ffn_down.weight"][0] == (128, 32) and tensors["blk.0.attn_norm.weight"][1] == "F32"
    np.testing.assert_array_equal(tensors["rope_freqs.weight"][2], np.ones(8))  # every pair rotates (factor 1.0)
    pairs = {"blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight",
             "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",  # LoRA-merged
             "blk.2.attn_q_norm.weight": "model.layers.2.self_attn.q_norm.weight",  # stored as is: no 1 + scale
             "per_layer_model_proj.weight": "model.per_layer_model_projection.weight"}  # fmt: skip
    for name, hf_name in pairs.items():
        np.testing.assert_allclose(tensors[name][2].reshape(hf[hf_name].shape), hf[hf_name], rtol=2e-3, atol=1e-4)
    assert config["architectures"] == ["Gemma4ForCausalLM"]
    modelfile = (out / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model.gguf\nTEMPLATE") and "mmproj" not in modelfile


def positions():
    """Gemma 4's inputs for TOKENS: it takes the positions too."""
    return {"token_ids": TOKENS, "padding_mask": np.ones_like(TOKENS, dtype=bool),
            "position_ids": np.arange(TOKENS.shape[1], dtype="int32")[None]}  # fmt: skip


def llama_cpp_gemma4_logits(tensors, fields, tokens):
    """Logits as llama.cpp's gemma4 graph (src/models/gemma4-iswa.cpp) computes them from the file, in numpy.

    Embeddings scaled by sqrt(hidden); per-layer inputs (their embedding scaled by sqrt(width), plus the
    projection of the embeddings, normed, over sqrt 2); per block: RMSNorm, queries and keys normed by their
    weights and values by none, NeoX RoPE (sliding layers on their own base and head width, global ones through
    rope_freqs), attention unscaled, causal and, on sliding layers, within the window; the layers past the
    shared-KV point reuse the keys and values of the last earlier layer of their kind; post norms, a tanh-GELU
    gated MLP, the gated per-layer input, the layer's output scale; the final soft cap.
    """
    w = {name: value[2].astype(np.float64) for name, value in tensors.items()}
    f = {key.removeprefix("gemma4."): value for key, value in fields.items()}
    eps, hidden, layers = f["attention.layer_norm_rms_epsilon"], f["embedding_length"], f["block_count"]
    sliding, window, heads = (
        f["attention.sliding_window_pattern"],
        f["attention.sliding_window"],
        f["attention.head_count"],
    )
    per_layer, first_shared = f["embedding_length_per_layer_input"], layers - f["attention.shared_kv_layers"]
    n = len(tokens)

    def rms(x, weight=None):
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        return x if weight is None else x * w[weight]

    def rope(x, slide):
        dims = f["rope.dimension_count_swa"] if slide else f["rope.dimension_count"]
        base = f["rope.freq_base_swa"] if slide else f["rope.freq_base"]
        half = dims // 2
        freqs = base ** (-np.arange(half) / half) / (1.0 if slide else w["rope_freqs.weight"][:half])
        angles = np.arange(n)[:, None] * freqs[None, :]
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        a, b = x[..., :half], x[..., half:dims]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin, x[..., dims:]], axis=-1)

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    def experts(attended, p):
        """The router (on the unweighted RMSNorm of the block's input, over sqrt(hidden), times its scale)
        picks the top experts by softmax, their weights renormalised; each is a tanh-GELU gated MLP, gate then
        up in one matrix, its output times the expert's scale."""
        router = rms(attended) / np.sqrt(hidden) * w[p + "ffn_gate_inp.scale"] @ w[p + "ffn_gate_inp.weight"].T
        probs = np.exp(router - router.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        h, out = rms(attended, p + "pre_ffw_norm_2.weight"), np.zeros_like(attended)
        for t in range(n):
            chosen = np.argsort(-probs[t])[: f["expert_used_count"]]
            for e in chosen:
                gate, up = np.split(w[p + "ffn_gate_up_exps.weight"][e] @ h[t], 2)
                down = w[p + "ffn_down_exps.weight"][e] @ (gelu(gate) * up) * w[p + "ffn_down_exps.scale"][e]
                out[t] += probs[t, e] / probs[t, chosen].sum() * down
        return out

    x = w["token_embd.weight"][tokens] * np.sqrt(hidden)
    if per_layer:
        chosen = w["per_layer_token_embd.weight"][tokens].reshape(n, layers, per_layer) * np.sqrt(per_layer)
        projected = (x @ w["per_layer_model_proj.weight"].T / np.sqrt(hidden)).reshape(n, layers, per_layer)
        inputs = (rms(projected, "per_layer_proj_norm.weight") + chosen) / np.sqrt(2)
    cache = {}
    for i in range(layers):
        p, slide = f"blk.{i}.", sliding[i]
        kv_heads = f["attention.head_count_kv"][i]
        h = rms(x, p + "attn_norm.weight")
        q = rope(rms((h @ w[p + "attn_q.weight"].T).reshape(n, heads, -1), p + "attn_q_norm.weight"), slide)
        if i < first_shared:
            k = (h @ w[p + "attn_k.weight"].T).reshape(n, kv_heads, -1)
            v = (h @ w[p + "attn_v.weight"].T).reshape(n, kv_heads, -1) if p + "attn_v.weight" in w else k
            cache[slide] = (rope(rms(k, p + "attn_k_norm.weight"), slide), rms(v))
        k, v = cache[slide]
        k, v = np.repeat(k, heads // k.shape[1], axis=1), np.repeat(v, heads // v.shape[1], axis=1)
        distance = np.arange(n)[:, None] - np.arange(n)[None, :]
        hidden_from = (distance < 0) | ((distance >= window) if slide else False)
        scores = np.einsum("qhd,khd->hqk", q, k) + np.where(hidden_from, -np.inf, 0.0)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1) @ w[p + "attn_output.weight"].T
        attended = rms(out, p + "post_attention_norm.weight") + x
        h = rms(attended, p + "ffn_norm.weight")
        h = (gelu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        if p + "ffn_gate_inp.weight" in w:
            h = rms(h, p + "post_ffw_norm_1.weight") + rms(experts(attended, p), p + "post_ffw_norm_2.weight")
        x = rms(h, p + "post_ffw_norm.weight") + attended
        if per_layer:
            g = (gelu(x @ w[p + "inp_gate.weight"].T) * inputs[:, i]) @ w[p + "proj.weight"].T
            x = x + rms(g, p + "post_norm.weight")
        x = x * w[p + "layer_output_scale.weight"]
    out = rms(x, "output_norm.weight") @ w["token_embd.weight"].T
    cap = f["final_logit_softcapping"]
    return np.tanh(out / cap) * cap


def test_the_gemma4_file_computed_as_llama_cpp_does_gives_the_fine_tuned_logits(gemma4, tmp_path):
    """No llama.cpp binding installs here: llama.cpp's gemma4 graph, in numpy, reads the f32 file instead, on
    a prompt longer than the sliding window, through the layer that borrows its keys and values."""
    run = gemma4[-1]
    tensors, fields = read_gguf(finetune.export(run, "gguf", tmp_path / "gguf", dtype="f32") / "model.gguf")
    import keras

    with float32_policy():
        expected = keras.ops.convert_to_numpy(finetune.load(run)(positions()))[0]
    np.testing.assert_allclose(llama_cpp_gemma4_logits(tensors, fields, TOKENS[0]), expected, atol=1e-4)


def test_the_gemma4_moe_keeps_its_fused_experts_router_and_scales(tmp_path):
    import gguf
    import keras
    import keras_hub

    from finetune.exports import export, transformers_gguf

    with float32_policy():
        tokenizer = presets.tiny_tokenizer("tiny-gemma4-moe")
        backbone = presets.tiny_backbone(tokenizer.vocabulary_size(), name="tiny-gemma4-moe")
        export.write_transformers(tmp_path, backbone, tokenizer)
        expected = keras.ops.convert_to_numpy(
            keras_hub.models.Gemma4CausalLM(backbone=backbone, preprocessor=None)(positions())
        )[0]
    transformers_gguf.write(tmp_path / "exact.gguf", tmp_path, "gemma4", tokenizer, "f32")
    # llama.cpp's gemma4 graph, in numpy, from the f32 file: the experts and router read as llama.cpp reads them
    got = llama_cpp_gemma4_logits(*read_gguf(tmp_path / "exact.gguf"), TOKENS[0])
    np.testing.assert_allclose(got, expected, atol=1e-4)
    transformers_gguf.write(tmp_path / "model.gguf", tmp_path, "gemma4", tokenizer, "q8_0")
    tensors, fields = read_gguf(tmp_path / "model.gguf")
    assert fields["gemma4.expert_count"] == 4 and fields["gemma4.expert_used_count"] == 2
    assert fields["gemma4.expert_feed_forward_length"] == 16 and fields["gemma4.attention.head_count_kv"] == [2, 1]
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert tensors["blk.0.ffn_gate_up_exps.weight"][:2] == ((32, 32, 4), "Q8_0")  # (experts, 2 x 16, hidden)
    assert tensors["blk.0.ffn_down_exps.weight"][:2] == ((16, 32, 4), "F16")  # rows of 16: not whole q8_0 blocks
    assert tensors["blk.0.ffn_gate_inp.weight"][:2] == ((32, 4), "F32")  # the router stays f32
    assert tensors["blk.1.ffn_down_exps.scale"][0] == (4,) and tensors["blk.1.ffn_gate_inp.scale"][0] == (32,)
    from safetensors.numpy import load_file

    hf = load_file(str(tmp_path / "model.safetensors"))
    experts = hf["model.layers.1.experts.gate_up_proj"]
    got = tensors["blk.1.ffn_gate_up_exps.weight"][2].reshape(experts.shape)
    assert np.abs(got - experts).max() <= np.abs(experts).max() / 127 * 0.51 + 1e-6  # within q8_0's half step


def test_a_gemma3n_of_four_altup_streams_stacks_them_as_llama_cpp_s_gemma3n(tmp_path, monkeypatch):
    import dataclasses

    from finetune.exports import export, llamacpp, transformers_gguf

    tiny = presets.TINY["tiny-gemma3n"]  # two streams; Google's E2B and E4B, and llama.cpp, have four
    monkeypatch.setitem(presets.TINY, "tiny-gemma3n", dataclasses.replace(tiny, config={**tiny.config,
                                                                                         "altup_num_inputs": 4}))  # fmt: skip
    with float32_policy():
        tokenizer = presets.tiny_tokenizer("tiny-gemma3n")
        backbone = presets.tiny_backbone(tokenizer.vocabulary_size(), name="tiny-gemma3n")
        assert llamacpp.architecture(backbone) == "gemma3n"
        export.write_transformers(tmp_path, backbone, tokenizer)
    transformers_gguf.write(tmp_path / "model.gguf", tmp_path, "gemma3n", tokenizer, "f32")
    tensors, fields = read_gguf(tmp_path / "model.gguf")
    assert fields["general.architecture"] == "gemma3n" and fields["gemma3n.altup.num_inputs"] == 4
    assert fields["gemma3n.altup.active_idx"] == 0 and fields["gemma3n.attention.shared_kv_layers"] == 1
    assert fields["gemma3n.feed_forward_length"] == [64, 64, 64] and fields["gemma3n.context_length"] == 2048
    assert fields["gemma3n.attention.sliding_window_pattern"] == [True, False, True]
    sparsity = fields["gemma3n.activation_sparsity_scale"]
    assert math.isclose(sparsity[0], 1.6448536, rel_tol=1e-6) and sparsity[1:] == [-math.inf, -math.inf]
    assert tensors["altup_proj.weight"][0] == (32, 32, 3) and tensors["altup_unembd_proj.weight"][0] == (32, 32, 3)
    assert tensors["blk.0.altup_correct_coef.weight"][0] == (4, 4)  # (streams, streams), f32 as the converter keeps
    assert tensors["blk.0.altup_predict_coef.weight"][:2] == ((4, 16), "F32")
    assert {"blk.2.laurel_l.weight", "blk.2.laurel_r.weight", "blk.1.altup_correct_scale.weight"} <= set(tensors)
    from safetensors.numpy import load_file

    hf = load_file(str(tmp_path / "model.safetensors"))
    stacked = np.stack([hf[f"model.altup_projections.{i}.weight"] for i in range(3)])
    np.testing.assert_array_equal(tensors["altup_proj.weight"][2].reshape(stacked.shape), stacked)
    norm = hf["model.layers.1.post_feedforward_layernorm.weight"]
    np.testing.assert_array_equal(tensors["blk.1.post_ffw_norm.weight"][2], norm)  # no 1 + scale shift


def test_a_gemma3n_of_two_altup_streams_is_refused_from_the_command_line(tmp_path):
    run = trained("tiny-gemma3n", tmp_path)
    done = command("export", "--run", run, "--format", "gguf", "--output", tmp_path / "gguf", cwd=tmp_path)
    expected = "llama.cpp's gemma3n computes 4 AltUp streams and this Gemma 3n has 2; finetune writes GGUF for"
    assert done.returncode == 2 and expected in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "gguf").exists()


def test_q4_k_m_is_refused_naming_llama_quantize_from_the_command_line(gemma4, tmp_path):
    run = gemma4[-1]
    args = ["export", "--run", run, "--format", "gguf", "--output", tmp_path / "gguf", "--dtype", "q4_k_m"]
    done = command(*args, cwd=tmp_path)
    expected = "export with --dtype f16, then run llama-quantize DIR/model.gguf DIR/model-q4_k_m.gguf Q4_K_M"
    assert done.returncode == 2 and expected in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "gguf").exists()
