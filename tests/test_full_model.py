"""--full: every weight of the language model trains, and the run publishes the whole model (full_model.py).

A run of each of `tiny` and `tiny-gemma3` trains once per module, through the installed command in a fresh
process; a copy cut at a checkpoint resumes to the same weights, bit for bit. eval, generate and export reopen
the tiny run from the command line; the refusals are the CLI's (exit 2, nothing written). Every method under
--full: test_method_matrix.py. The plan's full-weight terms against what XLA allocates: below, on JAX.
"""

import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import BACKEND, float32_policy, invoke, killed_after, make_records, write_jsonl

import finetune
from finetune import config
from finetune.platform import backend
from finetune.platform.errors import UserError
from finetune.training import plan, resolve

GiB = 2**30
TOKENS = np.array([[2, 50, 61, 72, 83, 94, 105, 116, 127, 5, 6, 7, 300, 301]], dtype="int32")
in_torch_suite = pytest.mark.skipif(BACKEND != "torch", reason="transformers is checked in the PyTorch suite")
neutral = pytest.mark.backend_neutral


def flags(preset, data, out, batch=("--batch-size", "2")):
    """A short --full run: 6 steps of 2 at seq-len 48, float32 (exact), a checkpoint every 3 steps."""
    return ["--preset", preset, "--backend", BACKEND, "--data", str(data), "--seq-len", "48", *batch,
            "--max-records", "24", "--eval-fraction", "0.25", "--max-steps", "6", "--checkpoint-every", "3",
            "--precision", "float32", "--lr", "1e-3", "--full", "--set", "train.samples=0",
            "--set", "train.threads=1", "--output", str(out)]  # fmt: skip


def weights(out) -> dict:
    arrays = {}
    with h5py.File(out / "model.weights.h5", "r") as f:
        f.visititems(lambda name, item: arrays.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None)
    return arrays


def metrics(out) -> dict:
    return json.loads((out / "metrics.json").read_text())


def logits(lm, tokens=TOKENS):
    import keras

    from finetune.model import builder

    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    if "position_ids" in builder.input_names(lm):
        x["position_ids"] = np.arange(tokens.shape[1])[None].astype("int32")
    return keras.ops.convert_to_numpy(lm(x))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "records.jsonl", make_records(24))


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """preset -> the run directory of a --full run trained by the installed command in a fresh process, once."""
    made = {}

    def trained(preset):
        if preset not in made:
            out = tmp_path_factory.mktemp(preset) / "run"
            env = {**os.environ, "KERAS_BACKEND": BACKEND}
            done = subprocess.run([sys.executable, "-m", "finetune", "gemma", *flags(preset, data, out)],
                                  capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            made[preset] = out
        return made[preset]

    return trained


@pytest.fixture(params=["tiny", "tiny-gemma3"])
def whole(request, runs):
    """(preset, its --full run directory)."""
    return request.param, runs(request.param)


@pytest.fixture
def tiny(runs):
    """The tiny preset's --full run, which eval, generate and export reopen."""
    return runs("tiny")


def test_full_trains_every_weight_and_the_held_out_loss_falls(whole):
    preset, out = whole
    trained = metrics(out)
    assert trained["full"] and trained["rank"] is None and trained["steps"] == 6
    assert trained["eval_loss"] < trained["eval_loss_before"]
    described = json.loads((out / "model.json").read_text())
    assert described["format"] == "finetune-full-model" and described["dtype"] == "float32"
    assert described["preset"]["name"] == preset and described["weights"] == len(weights(out))
    assert not (out / "adapter.lora.h5").exists()
    # Every weight trained: the published model's parameters are the model's (no LoRA factors among them).
    assert trained["trainable_parameters"] == sum(v.size for v in weights(out).values())
    resolved = config.read_recipe(out / "config.yaml")["resolved"]
    assert resolved["precision"]["value"] == "float32"


def test_a_full_run_killed_after_a_checkpoint_resumes_to_the_same_weights(whole, data, tmp_path):
    preset, out = whole
    cut = killed_after(out, tmp_path / "killed", 3)
    refused = invoke("gemma", "--resume", "--set", "model.full=false", "--output", cut)
    assert refused.exit_code == 2 and "model.full=True" in refused.output, refused.output  # LoRA cannot take it up
    result = invoke("gemma", *flags(preset, data, cut), "--resume")
    assert result.exit_code == 0, result.output
    assert metrics(cut)["resumed_from_step"] == 3 and metrics(cut)["steps"] == 6
    expected, got = weights(out), weights(cut)
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert metrics(cut)["eval_loss"] == metrics(out)["eval_loss"]


def test_eval_reopens_the_trained_model_from_the_command_line(tiny):
    evaluated = invoke("eval", "--run", tiny)
    assert evaluated.exit_code == 0, evaluated.output
    loss = float(re.search(r"eval_loss (\S+)", evaluated.output).group(1))
    assert loss == pytest.approx(metrics(tiny)["eval_loss"], abs=1e-4)


@neutral
def test_generate_and_the_python_api_load_the_trained_model(tiny):
    from finetune.model import builder, presets

    generated = invoke("generate", "--run", tiny, "--prompt", "What is 2 plus 3?", "--max-new-tokens", "4")
    assert generated.exit_code == 0, generated.output
    # The Python API loads the same model: its logits are the trained ones, not the base's.
    with float32_policy():
        tuned = logits(finetune.load(tiny))
        base = logits(builder.load_base(presets.resolve("tiny"), 48)[0])
    assert np.isfinite(tuned).all() and np.abs(tuned - base).max() > 1e-3


def test_merged_export_is_the_trained_model_keras_hub_loads(tiny, tmp_path):
    import keras_hub

    result = invoke("export", "--run", tiny, "--format", "merged", "--output", tmp_path / "merged")
    assert result.exit_code == 0, result.output
    with float32_policy():
        merged = keras_hub.models.GemmaCausalLM.from_preset(str(tmp_path / "merged"))
        tuned = finetune.load(tiny)
        np.testing.assert_allclose(logits(merged), logits(tuned), atol=1e-5)


@in_torch_suite
def test_hf_export_gives_transformers_the_trained_logits(tiny, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    result = invoke("export", "--run", tiny, "--format", "hf", "--output", tmp_path / "hf")
    assert result.exit_code == 0, result.output
    model = transformers.GemmaForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        hf = model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    with float32_policy():
        np.testing.assert_allclose(hf, logits(finetune.load(tiny)), atol=1e-4)


@neutral
def test_gguf_export_writes_the_model_and_adapter_formats_are_refused(tiny, tmp_path):
    result = invoke("export", "--run", tiny, "--format", "gguf", "--output", tmp_path / "gguf")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "gguf" / "model.gguf").stat().st_size > 0
    for fmt in ("lora", "peft"):
        result = invoke("export", "--run", tiny, "--format", fmt, "--output", tmp_path / fmt)
        assert result.exit_code == 2, result.output
        assert "trained every weight" in result.output and "merged, hf, gguf" in result.output
        assert "Traceback" not in result.output and not (tmp_path / fmt).exists()


@neutral
def test_weights_of_another_run_are_refused_before_they_load(tiny, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    described = json.loads((copy / "model.json").read_text())
    (copy / "model.json").write_text(json.dumps({**described, "weights_sha256": "0" * 64}))
    result = invoke("eval", "--run", copy)
    assert result.exit_code == 2 and "checksums differ" in result.output, result.output
    (copy / "model.json").write_text(json.dumps({**described, "preset": {**described["preset"], "fingerprint": "f"}}))
    result = invoke("export", "--run", copy, "--format", "merged", "--output", tmp_path / "merged")
    assert result.exit_code == 2 and "another architecture" in result.output, result.output
    assert not (tmp_path / "merged").exists()


@neutral
@pytest.mark.parametrize(
    "extra, said",
    [
        (["--quantize", "int4"], "--full with --quantize int4 is not supported"),
        (["--precision", "bfloat16"], "AdamW's small updates round away in 16-bit weights"),
        (["--rank", "8"], "--rank (lora.rank: 8) is a LoRA setting"),
        (["--set", "lora.rank=8"], "--rank (lora.rank: 8) is a LoRA setting"),
        (["--dora"], "--dora (lora.dora: True)"),
        (["--lora-dropout", "0.1"], "--lora-dropout (lora.dropout: 0.1)"),
        (["--target", "query"], "--target (lora.targets: ['query'])"),
        (["--parallel", "model", "--mesh", "1x2"], "--full with --parallel model is not supported"),
    ],
)
def test_what_full_cannot_go_with_is_refused_and_nothing_is_written(extra, said, tmp_path):
    out = tmp_path / "run"
    result = invoke("gemma", "--preset", "tiny", "--backend", BACKEND, "--full", *extra, "--output", out)
    assert result.exit_code == 2, result.output
    assert said in result.output and "Traceback" not in result.output
    assert not out.exists()


@neutral
def test_full_typed_over_a_lora_recipe_leaves_the_recipe_s_lora_behind():
    """gemma3-270m's recipe sets rank 8: `--recipe gemma3-270m --full` trains every weight (Google's guide for that
    model) instead of being refused for the recipe's LoRA section; a LoRA flag typed beside --full is refused."""
    cfg = config.load("gemma3-270m", {"model.full": True})
    assert cfg.model.full and cfg.lora.rank == config.LoraConfig().rank and cfg.model.seq_len == 256
    with pytest.raises(UserError, match=r"--rank \(lora.rank: 8\)"):
        config.load("gemma3-270m", {"model.full": True, "lora.rank": 8})


@neutral
def test_a_full_run_keeps_its_weights_float32_and_says_why(monkeypatch):
    """auto on a bf16 device computes in bf16 but stores float32 (mixed_bfloat16); float16's device takes float32."""
    cfg = config.load(None, {"model.full": True})
    for decided, kept in (("bfloat16", "mixed_bfloat16"), ("float16", "float32"), ("float32", "float32")):
        monkeypatch.setattr(backend, "auto_precision_why", lambda *a, d=decided: (d, "auto: the device's"))
        made = resolve._precision(cfg, "gpu", None)
        assert made.value == kept
        assert ("--full keeps its weights float32" in made.why) == (decided != "float32")
    # The plan decides the same offline.
    assert plan.make(cfg, target=plan.device("l4")).precision == "mixed_bfloat16"


@neutral
def test_lora_off_swaps_the_base_in_and_the_trained_weights_back():
    """A method that scores the base (DPO's reference, GRPO's KL) reads a --full model's kept base weights."""
    from finetune.model import builder, presets

    with float32_policy():
        model = builder.build_model(presets.resolve("tiny"), builder.Recipe(seq_len=32, precision="float32",
                                                                            full=True, keep_base=True))  # fmt: skip
        variable = model.lm.backbone.trainable_variables[0]
        base = np.array(variable.numpy())
        variable.assign(base + 1.0)
        with builder.lora_off(model.lm):
            np.testing.assert_array_equal(variable.numpy(), base)
        np.testing.assert_array_equal(variable.numpy(), base + 1.0)
        assert len(model.lm.backbone.trainable_variables) == len(model.lm.backbone.weights) - len(
            [w for w in model.lm.backbone.weights if not w.trainable]
        )


@neutral
def test_a_picture_model_trains_its_decoder_and_keeps_its_encoder_frozen():
    from finetune.model import builder, presets

    with float32_policy():
        model = builder.build_model(presets.resolve("tiny-gemma3-vision"), builder.Recipe(seq_len=32,
                                    precision="float32", full=True, images=True))  # fmt: skip
    backbone = model.lm.backbone
    encoder = {id(w) for w in backbone.vision_encoder.weights}
    trained = backbone.trainable_weights
    assert encoder and not encoder & {id(w) for w in trained}
    assert len(trained) == len([w for w in backbone.weights if id(w) not in encoder and "seed" not in w.path])


# --- the plan -------------------------------------------------------------------------------------------------


@neutral
def test_the_plan_counts_a_gradient_and_two_moments_for_every_weight():
    full = plan.make(
        config.load(None, {"model.preset": "gemma3_270m", "model.full": True, "model.precision": "float32"})
    )
    lora = plan.make(config.load(None, {"model.preset": "gemma3_270m", "model.precision": "float32"}))
    assert full.memory["gradients"] == full.memory["weights"]  # no encoder: every weight trains
    assert full.memory["optimizer"] == 2 * full.memory["weights"]
    assert "lora_weights" not in full.memory and full.memory["weights"] == lora.memory["weights"]
    assert full.memory["total"] - lora.memory["total"] == pytest.approx(
        3 * full.memory["weights"] - lora.memory["lora_weights"] * 4, rel=1e-9
    )


@neutral
def test_a_full_run_that_cannot_fit_is_refused_with_what_lora_needs():
    cfg = config.load(None, {"backend": "jax", "model.preset": "gemma3_1b", "model.full": True,
                             "model.precision": "float32", "model.seq_len": 512, "train.batch_size": 4})  # fmt: skip
    with pytest.raises(UserError, match=r"--full 1\d\.\d\d GiB needed.*drop --full: LoRA r4 on query,value needs"):
        plan.check_full_fits(cfg, "gpu", 15 * GiB)
    plan.check_full_fits(cfg, "gpu", 80 * GiB)  # fits: nothing said
    result = invoke("plan", "--backend", "jax", "--preset", "gemma3_1b", "--full", "--device-memory", "t4",
                    "--seq-len", "512", "--batch-size", "4")  # fmt: skip
    assert "does not fit" in result.output and "drop --full: LoRA r4" in result.output, result.output


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's memory analysis is JAX's")
def test_the_full_plan_is_within_15_percent_of_what_xla_allocates_for_the_train_step(tmp_path):
    """test_plan.py's small architecture (float32, batch 4 x 128), every weight trained: XLA's train step holds
    the weights and AdamW's moments (its arguments) and the gradients and activations (its temporaries). Its
    state is donated, as keras' JAX trainer donates it, so the new weights and moments reuse the old ones'."""
    from test_plan import xla_step_bytes

    from finetune.model import builder

    measured = xla_step_bytes(tmp_path, builder.train_every_weight, donate=True)
    cfg = config.load(None, {"model.preset": str(tmp_path / "small"), "model.precision": "float32", "model.full": True,
                             "model.seq_len": 128, "train.batch_size": 4, "model.remat": "off"})  # fmt: skip
    planned = plan.make(cfg).memory
    assert planned["gradients"] + planned["optimizer"] > 0.5 * measured  # the full-weight terms dominate here
    assert planned["total"] == pytest.approx(measured, rel=0.15), (planned["total"], measured)


@neutral
def test_full_takes_the_same_controls_as_lora_accumulation_equals_the_whole_batch(data, tmp_path):
    """Schedule, warm-up, decay and clipping (optimizer.py) apply to every weight; 2 micro-batches of 2 accumulated
    train as one batch of 4."""
    import csv

    controls = ["--lr-schedule", "cosine", "--warmup-steps", "1", "--max-grad-norm", "0.5", "--set",
                "train.weight_decay=0.1", "--max-steps", "3", "--packing", "off", "--eval-fraction", "0"]  # fmt: skip
    runs = {}
    for name, batch in (("whole", ["--batch-size", "4"]), ("accumulated", ["--batch-size", "2", "--grad-accum", "2"])):
        out = tmp_path / name
        result = invoke("gemma", *flags("tiny", data, out, batch), *controls)
        assert result.exit_code == 0, result.output
        with (out / "history.csv").open() as f:
            runs[name] = [(float(r["train_loss"]), float(r["grad_norm"])) for r in csv.DictReader(f) if r["train_loss"]]
    assert len(runs["whole"]) == 3 and runs["whole"][0][1] > 0.5  # clipped: the norm before clipping is logged
    assert np.array(runs["accumulated"]) == pytest.approx(np.array(runs["whole"]), rel=1e-5, abs=1e-6)


def test_full_in_mixed_bfloat16_trains_on_every_backend(data, tmp_path):
    """auto's precision for --full on a bf16 GPU or TPU (mixed_bfloat16) trains; every method's LoRA run in it:
    test_method_matrix.py."""
    result = invoke("gemma", "--preset", "tiny", "--backend", BACKEND, "--precision", "mixed_bfloat16", "--full",
                    "--data", str(data), "--seq-len", "48", "--batch-size", "2", "--max-steps", "2",
                    "--eval-fraction", "0", "--set", "train.samples=0", "--output", str(tmp_path / "run"))  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    run = metrics(tmp_path / "run")
    assert run["steps"] == 2 and np.isfinite(run["train_loss"]), run
