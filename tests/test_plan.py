"""`finetune plan` and `--plan-only`: per-device bytes, verdicts, refusals; offline and without keras.

The architecture table's own counts are test_archs.py's.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BACKEND, PUBLISHED, ROUNDED, float32_policy
from typer.testing import CliRunner

from finetune import config
from finetune.cli import app
from finetune.model import archs
from finetune.platform.errors import UserError
from finetune.training import plan, resolve

runner = CliRunner()
GiB = 2**30

SEVEN_B = ["--preset", "gemma_7b_en", "--parallel", "model", "--mesh", "1x8", "--seq-len", "512", "--batch-size", "8"]


def invoke(*args):
    return runner.invoke(app, ["plan", *[str(a) for a in args]])


def make(devices=None, device=None, **settings):
    overrides = {"backend": "jax", **settings}
    return plan.make(config.load(None, overrides), devices, plan.device(device) if device else None)


def test_7b_plan_prints_offline_without_importing_keras(tmp_path):
    code = (
        "import sys\n"
        "from finetune.cli import app\n"
        f"try:\n    app(['plan', '--backend', 'jax', *{SEVEN_B!r}])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "frameworks = [m for m in sys.modules if m.split('.')[0] in ('keras', 'keras_hub', 'jax', 'torch', 'tensorflow')]\n"
        "assert not frameworks, frameworks\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAGGLE")}
    env.update(HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))  # no ~/.kaggle either
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    for expected in ("mesh 1x8", "embedding", "query", "ffw_linear", "model on heads", "LoRA weights", "total"):
        assert expected in proc.stdout, expected


def test_weights_are_split_eight_ways_on_1x8_but_the_norms():
    planned = make(**{"model.preset": "gemma_7b_en", "distribution.parallel": "model", "distribution.mesh": "1x8"})
    params = PUBLISHED["gemma_7b_en"]
    norms = next(g for g in planned.groups if g.name == "norm scales").shape[0]
    assert planned.precision == "bfloat16"  # auto, with no device named: the base stored in bf16
    assert planned.memory["weights"] == pytest.approx((params - norms) * 2 / 8 + norms * 2)
    assert all(g.layout.startswith("model on") for g in planned.groups if g.name != "norm scales")


def test_a_single_key_value_head_shards_on_the_hidden_axis():
    planned = make(**{"model.preset": "gemma_2b_en", "distribution.parallel": "model", "distribution.mesh": "1x4"})
    layouts = {g.name: g.layout for g in planned.groups}
    assert layouts["query"] == "model on heads"
    assert layouts["key"] == layouts["value"] == "model on hidden"


def test_an_indivisible_model_axis_exits_2_naming_the_kernel():
    result = invoke("--backend", "jax", "--preset", "gemma_2b_en", "--parallel", "model", "--mesh", "1x3")
    assert result.exit_code == 2
    assert "cannot shard embedding" in result.output and "model axis of 3" in result.output


def test_the_data_axis_splits_the_batch_not_the_weights():
    one = make(**{"train.batch_size": 8})
    four = make(**{"train.batch_size": 8, "distribution.parallel": "data", "distribution.mesh": "4x1"})
    assert four.memory["weights"] == one.memory["weights"]
    assert four.memory["activations"] == pytest.approx(one.memory["activations"] / 4)
    assert four.memory["logits"] == one.memory["logits"]  # one chunk of positions at a time, whatever the batch


def test_a_default_batch_is_planned_as_the_run_fits_it_to_the_data_axis():
    """The run makes its default batch (4 on JAX) split over 8 devices; the plan plans that batch, not a refusal."""
    result = invoke("--preset", "tiny", "--backend", "jax", "--parallel", "data", "--devices", "8")
    assert result.exit_code == 0, result.output
    assert "batch 8 (1 per device)" in result.output
    assert "batch size 8: the default 4 does not split over the data axis of 8 devices" in result.output
    chosen = invoke("--preset", "tiny", "--backend", "jax", "--parallel", "data", "--devices", "8", "--batch-size", 4)
    assert chosen.exit_code == 2 and "--batch-size 4 does not split over a data axis of 8 devices" in chosen.output


def test_device_memory_takes_sizes_and_known_kinds():
    assert plan.device("16GB")[1].memory == 16 * 10**9
    assert plan.device("16GiB")[1].memory == 16 * GiB
    assert plan.device("512 MiB")[1].memory == 512 * 2**20
    assert plan.device("T4") == ("t4", plan.DEVICES["t4"])
    assert plan.device("v3-8")[1].memory == 16 * GiB
    assert not plan.device("t4")[1].bfloat16  # so auto plans float16 there, as a run on a T4 does
    for bad in ("nonsense", "16", "16G", "-1GB"):
        result = invoke("--device-memory", bad)
        assert result.exit_code == 2 and "--device-memory" in result.output, bad


def test_the_verdict_compares_the_total_with_the_device():
    small = make(device="h100", **{"model.preset": "gemma_2b_en"})
    assert small.fits and small.verdict.startswith("fits")
    large = make(device="t4", **{"model.preset": "gemma_7b_en"})
    assert large.fits is False and "does not fit" in large.verdict
    assert make(device="t4").precision == "float16"


def test_json_output_for_machines():
    result = invoke("--backend", "jax", *SEVEN_B, "--device-memory", "a100-80g", "--json")
    assert result.exit_code == 0, result.output
    planned = json.loads(result.output)
    memory = planned["bytes_per_device"]
    assert memory["total"] == pytest.approx(sum(v for k, v in memory.items() if k != "total"), abs=8)
    assert planned["mesh"] == {"data": 1, "model": 8, "devices": 8}
    assert planned["fits"] is True and planned["device"] == "a100-80g"


def test_local_preset_directories_and_unknown_names(tmp_path):
    backbone = dict(archs.ARCHS["gemma3_1b"].config)
    (tmp_path / "config.json").write_text(json.dumps({"class_name": "Gemma3Backbone", "config": backbone}))
    planned = make(**{"model.preset": str(tmp_path)})
    assert planned.parameters == PUBLISHED["gemma3_1b"]
    result = invoke("--preset", "gemma9_1t")
    assert result.exit_code == 2 and "no architecture table for preset 'gemma9_1t'" in result.output


def test_plan_only_prints_the_plan_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["gemma", "--preset", "tiny", "--output", "run", "--plan-only"])
    assert result.exit_code == 0, result.output
    assert "memory per device" in result.output and "total" in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("accelerator", [False, True])
def test_plan_only_plans_for_this_machine_as_the_run_decides(accelerator, tmp_path, monkeypatch):
    """--plan-only plans the run that would train here: with no GPU or TPU, on this CPU, where `auto` is what the
    run decides (float32 for JAX); it said bfloat16 and half the weights' bytes, "name a device" it cannot name."""
    from finetune.platform import backend

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(backend, "no_accelerator_here", lambda: not accelerator)
    result = runner.invoke(app, ["gemma", "--preset", "tiny", "--backend", "jax", "--plan-only"])
    assert result.exit_code == 0, result.output
    if accelerator:  # one that cannot be named without loading a framework: a bf16 accelerator is assumed
        assert "precision bfloat16" in result.output
    else:
        assert "precision float32" in result.output and "note: precision auto is float32 on cpu" in result.output


# Settings a run refuses before it reads its data; --plan-only, which reads none, refuses them alike.
REFUSED_SETTINGS = [
    (["--method", "grpo", "--reward", "exact", "--group-by-length"], "--group-by-length: GRPO pads every prompt"),
    (["--method", "grpo", "--reward", "exact", "--packing", "on"], "--packing on: --method grpo: each rollout"),
    (
        ["--method", "grpo", "--reward", "exact", "--max-completion-length", "8", "--batch-size", "auto"],
        "--batch-size counts prompts",
    ),
    (["--method", "grpo"], "learns from rewards: pass --reward"),
    (["--method", "dpo", "--num-generations", "4"], "--num-generations is a setting of GRPO and RLOO"),
    (["--method", "sft", "--labels", "a,b"], "--labels names a classifier's classes"),
    (["--method", "orpo", "--beta", "0"], "--beta 0 leaves ORPO's loss nothing to weigh"),
    (["--method", "dpo", "--train-on-prompt"], "--train-on-prompt puts the prompt's tokens in the loss; DPO's"),
    (["--method", "classify", "--labels", "good", "--labels", "good", "--labels", "bad"], "names 'good' twice"),
    (["--method", "grpo", "--reward", "exact", "--reward-weights", "1", "--reward-weights", "2"], "gives 2 weights"),
    (
        ["--method", "grpo", "--reward", "exact", "--max-completion-length", "48", "--seq-len", "48"],
        "--seq-len 48 leaves 0 tokens for the prompt",
    ),
]


@pytest.mark.backend_neutral  # the settings' checks (methods/registry.check) are Python before any backend
@pytest.mark.parametrize("flags,message", REFUSED_SETTINGS, ids=[" ".join(f[1:3]) for f, _ in REFUSED_SETTINGS])
def test_plan_only_refuses_what_the_run_refuses(tmp_path, monkeypatch, flags, message):
    """A plan of a run that would be refused is no plan: --plan-only exits 2 with the run's own message, and the
    run itself refuses it before its data is read (the data file does not exist) or its output made."""
    monkeypatch.chdir(tmp_path)
    for extra in (["--plan-only"], ["--data", "missing.jsonl"]):
        result = runner.invoke(app, ["gemma", "--preset", "tiny", "--output", "run", *flags, *extra])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), (extra, result.output)
        assert list(tmp_path.iterdir()) == []


@pytest.mark.backend_neutral  # files and Python before any backend
def test_plan_only_reads_the_output_and_the_rewards_as_the_run_would(tmp_path, monkeypatch):
    """--plan-only refuses, as the run does and writing nothing, an --output that holds a run (without
    --overwrite), a folder of the user's, and a --reward that does not load; with --overwrite, or rewards that
    load, it plans."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "finetune-run.json").write_text("{}")
    (tmp_path / "old" / "metrics.json").write_text("{}")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "bad.py").write_text("raise ValueError('broken')\n")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    grpo = ["--method", "grpo", "--max-completion-length", "32", "--batch-size", "2", "--output", "new"]
    for flags, message in (
        (["--output", "old"], "already holds a run"),
        (["--output", "mine"], "mine"),
        ([*grpo, "--reward", "bad.py:f"], "bad.py failed to load (ValueError: broken)"),
        ([*grpo, "--reward", "exact", "--reward", "run:old"], "has no config.yaml"),
    ):
        # The run refuses an output before it reads its data (missing here); a reward once it has read it.
        for extra in (["--plan-only"], ["--data", "missing.jsonl"]) if "--reward" not in flags else (["--plan-only"],):
            result = runner.invoke(app, ["gemma", "--preset", "tiny", *flags, *extra])
            assert result.exit_code == 2 and message in " ".join(result.output.split()), (flags, extra, result.output)
    for flags in (["--output", "old", "--overwrite"], [*grpo, "--reward", "exact"]):
        result = runner.invoke(app, ["gemma", "--preset", "tiny", *flags, "--plan-only"])
        assert result.exit_code == 0, (flags, result.output)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_lora_counts_follow_the_factor_shapes():
    # query and value of gemma_7b_en, rank 4: A (16, 3072, 4) and B (4, 256) each, in 28 blocks.
    planned = make(**{"model.preset": "gemma_7b_en"})
    assert planned.lora_parameters == 28 * 2 * (16 * 3072 * 4 + 4 * 256)
    assert planned.memory["optimizer"] == 2 * planned.memory["lora_weights"] == 2 * planned.lora_parameters * 4


@pytest.mark.backend_neutral  # the count is the plan's Python; DoRA's magnitudes are built on every backend: test_builder
def test_dora_adds_a_magnitude_for_each_output_of_each_adapted_kernel():
    from finetune.config import LoraConfig
    from finetune.model import builder, presets

    targets = ["query", "value", "attention_output", "ffw_gating", "ffw_linear"]
    settings = {"model.preset": "tiny", "lora.targets": targets, "lora.rank": 2}
    plain, dora = make(**settings), make(**settings, **{"lora.dora": True})
    lm, _ = builder.build(presets.resolve("tiny"), seq_len=32)
    builder.enable_lora(lm, LoraConfig(rank=2, targets=targets, dora=True))
    assert dora.lora_parameters == builder.trainable_parameters(lm) > plain.lora_parameters


def test_refusals_exit_2_with_a_message():
    for args, message in [
        (["--target", "query,mlp"], "unknown LoRA target 'mlp'"),
        (["--devices", "2"], "--devices 2 needs --parallel data or --parallel model"),
        (["--backend", "jax", "--parallel", "model"], "pass --mesh DxM"),
        (["--backend", "jax", "--parallel", "model", "--devices", "8", "--mesh", "2x2"], "needs 4 devices"),
        (["--preset", "kaggle://keras/gemma"], "no architecture table"),
    ]:
        result = invoke(*args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_devices_without_a_mesh_and_kaggle_handles():
    planned = make(
        8, **{"model.preset": "kaggle://keras/gemma/keras/gemma_instruct_7b_en/3", "distribution.parallel": "model"}
    )
    assert (planned.data, planned.model_axis, planned.parameters) == (1, 8, PUBLISHED["gemma_7b_en"])


def test_int4_packs_the_kernels_and_7b_fits_a_t4_without_remat():
    settings = {"model.preset": "gemma_7b_en", "model.precision": "float16", "train.batch_size": 1}
    float_plan = make(**settings, **{"model.remat": "off"})
    int4 = make(device="t4", **settings, **{"model.quantize": "int4"})
    # Two weights a byte plus a scale and zero point per 128: the decoder kernels shrink to under a third.
    assert int4.memory["weights"] < 0.4 * float_plan.memory["weights"]
    # One kernel dequantized at a time (quantized.lean_projection): the largest, the FFW's 3072 x 24576, in float16.
    assert int4.memory["dequantized_kernel"] == pytest.approx(3072 * 24576 * (1 + 3 * 2))
    assert not int4.remat and int4.fits and int4.verdict.startswith("fits")
    assert any(n.startswith("remat auto: off") for n in int4.notes)


def test_the_kaggle_verdicts_for_2b_and_7b_int4_on_a_t4_are_fits():
    for recipe in ("kaggle-2xt4", "kaggle-t4-7b-int4"):
        cfg = config.load(recipe)
        planned = plan.make(cfg, 2 if cfg.distribution.parallel != "none" else None, plan.device("t4"))
        assert planned.precision == "float16" and planned.fits, (recipe, planned.verdict)


def test_a_cpu_plan_counts_the_frameworks_resident_memory():
    planned = make(device="cpu", **{"model.preset": "gemma_2b_en", "backend": "tensorflow"})
    assert planned.memory["runtime"] > GiB / 2
    assert "runtime" not in make(device="h100", **{"model.preset": "gemma_2b_en"}).memory


@pytest.mark.parametrize("framework", ["jax", "torch", "tensorflow"])
def test_a_cpu_plan_counts_tensorflow_where_the_family_keeps_it_on_another_backend(framework):
    newer = make(device="cpu", **{"model.preset": "tiny-gemma3", "backend": framework}).memory
    gemma = make(device="cpu", **{"model.preset": "tiny", "backend": framework}).memory
    assert "tensorflow_preprocessing" not in gemma
    # TensorFlow's own process counts it in its runtime; JAX's and PyTorch's keep it beside theirs.
    assert ("tensorflow_preprocessing" in newer) == (framework != "tensorflow")
    assert "tensorflow_preprocessing" not in make(device="h100", **{"model.preset": "gemma3_1b"}).memory


def test_tensorflow_on_a_cpu_counts_its_measured_step_beside_the_rest():
    settings = {"model.preset": "gemma_2b_en", "model.precision": "float16"}
    tensorflow = make(device="cpu", **settings, backend="tensorflow")
    assert tensorflow.memory["tensorflow_step"] == 256000 * 2048 * 2  # one float16 token embedding
    assert "tensorflow_step" not in make(device="cpu", **settings, backend="torch").memory
    assert "tensorflow_step" not in make(device="t4", **settings, backend="tensorflow").memory


def test_remat_keeps_each_block_s_input_only():
    plain = make(**{"model.preset": "gemma_2b_en", "model.remat": "off", "train.batch_size": 1})
    recomputed = make(**{"model.preset": "gemma_2b_en", "model.remat": "on", "train.batch_size": 1})
    assert recomputed.remat and recomputed.memory["activations"] < plain.memory["activations"] / 4
    assert make(**{"model.remat": "auto"}).remat is False  # no device named: nothing to fit


def test_remat_keeps_each_block_s_input_on_jax_on_a_cpu_too():
    """gemma3-1b, seq 512, batch 8, float32 on JAX on a CPU: XLA asked 29.6 GB with jax.checkpoint, which its CPU
    compiler merged back into the forward; the recomputation now waits for the gradient (remat.py), and the plan
    counts each block's input, as on the other backends, and auto turns it on where the run does not fit."""
    settings = {"model.preset": "gemma3_1b", "model.seq_len": 512, "train.batch_size": 8}
    on = make(device="cpu", **settings, **{"model.remat": "on"})
    off = make(device="cpu", **settings, **{"model.remat": "off"})
    assert on.memory["activations"] < off.memory["activations"] / 4
    assert on.remat and make(device="cpu", **settings, **{"model.remat": "auto"}).remat  # 29.6 GB do not fit
    torch = make(device="cpu", **settings, **{"model.remat": "on", "backend": "torch", "model.precision": "float32"})
    assert torch.memory["activations"] == on.memory["activations"]


SMALL = dict(num_layers=4, num_query_heads=4, num_key_value_heads=1, hidden_dim=256, intermediate_dim=2048,
             head_dim=64, vocabulary_size=32768)  # fmt: skip
"""A small architecture whose weights, activations and loss chunk all count."""


def xla_step_bytes(tmp_path, adapt, donate: bool = False) -> int:
    """SMALL saved as a preset at tmp_path/small, float32, `adapt(lm)` applied (LoRA, or every weight trained), its
    train step on one packed batch of 4 x 128 compiled by XLA: the bytes of every argument (the weights, the
    trained ones, AdamW, the batch) and of its temporaries. donate: the state donated, as keras' JAX trainer donates
    it, so the new weights and moments reuse the old ones' memory (test_full_model.py)."""
    import jax
    import keras_hub

    from finetune.data import batching, packing
    from finetune.model import builder, presets

    with float32_policy():
        backbone = keras_hub.models.GemmaBackbone(**SMALL, dtype="float32")
        backbone.save_to_preset(str(tmp_path / "small"))
        lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
        adapt(lm)
        trainer = builder.compile(lm, 1e-3, 0.0)
        pairs = [(f"Instruction:\nName {i} things.\n\nResponse:\n", "thing " * 30) for i in range(16)]
        examples, _ = batching.tokenize(pairs, presets.tiny_tokenizer(), 128)
        x, y, w = batching.TrainOrder(packing.pack(examples, 128), 4, seed=0).batch(0)
        trainer.train_on_batch(x, y, sample_weight=w)  # builds AdamW
        state = tuple(
            [v.value for v in variables]
            for variables in (trainer.trainable_variables, trainer.non_trainable_variables,
                              trainer.optimizer.variables, trainer.metrics_variables)
        )  # fmt: skip
        step = jax.jit(trainer.train_step, donate_argnums=0) if donate else jax.jit(trainer.train_step)
        analysis = step.lower(state, (x, y, w)).compile().memory_analysis()
    return analysis.argument_size_in_bytes + analysis.temp_size_in_bytes


@pytest.mark.skipif(os.environ.get("KERAS_BACKEND", "jax") != "jax", reason="XLA's memory analysis is JAX's")
def test_the_plan_is_within_15_percent_of_what_xla_allocates_for_the_train_step(tmp_path):
    """SMALL, float32, batch 4 x 128, LoRA r4 on query and value: XLA's compiled train step says what it holds
    (xla_step_bytes). The plan, which never loads a model, must come within 15% of it."""
    from finetune.model import builder
    from finetune.platform import backend

    measured = xla_step_bytes(tmp_path, lambda lm: builder.enable_lora(lm, config.LoraConfig(rank=4,
                              targets=["query", "value"])))  # fmt: skip
    cfg = config.load(None, {"model.preset": str(tmp_path / "small"), "model.precision": "float32",
                             "model.seq_len": 128, "train.batch_size": 4, "model.remat": "off"})  # fmt: skip
    planned = plan.make(cfg).memory["total"]
    assert backend.loss_chunk(32768) * 32768 * 4 > 0.1 * measured  # the loss chunk is a real share here
    assert planned == pytest.approx(measured, rel=0.15), (planned, measured)


@pytest.mark.parametrize(
    "args, preset",
    [(["--parallel", "model", "--mesh", "1x8"], "gemma4_31b"), ([], "gemma4_26b_a4b"), ([], "gemma3n_e4b")],
)
def test_the_newest_gemma_plan_offline_with_keras_hub_s_counts(args, preset):
    result = invoke("--backend", "jax", "--preset", preset, *args, "--json")
    assert result.exit_code == 0, result.output
    planned = json.loads(result.output)
    arch = archs.ARCHS[preset]
    assert planned["parameters"] == archs.parameter_count(arch.config, arch.family) + arch.encoder_params
    published, precision = ROUNDED.get(preset, (PUBLISHED.get(preset), 1))
    assert round(planned["parameters"] / precision) * precision == published
    assert any("not loaded" in note for note in planned["notes"])  # the image and audio encoders
    groups = {g["group"]: g for g in planned["groups"]}
    if preset == "gemma4_31b":  # global layers: 4 key/value heads, not divisible by 8: on the hidden axis
        assert groups["query"]["layout"] == groups["query (global)"]["layout"] == "model on heads"
        assert groups["key"]["layout"] == "model on kv heads" and groups["key (global)"]["layout"] == "model on hidden"
        assert "value (global)" not in groups  # its values reuse its keys
    if preset == "gemma4_26b_a4b":
        assert groups["experts gate"]["shape"] == [128, 2816, 704] and groups["experts gate"]["copies"] == 30
        assert any("8 of 128 route each token" in note for note in planned["notes"])
    result = invoke("--backend", "jax", "--preset", preset, *args, "--target", "query,proj")
    assert result.exit_code == 2, result.output
    if preset.startswith("gemma4"):
        assert "Gemma 4's 'proj' layers stay frozen: the mixture-of-experts router" in result.output
    else:
        assert "unknown LoRA target 'proj'" in result.output


def test_moe_activations_count_every_expert_keras_hub_computes():
    """keras-hub's dense dispatch, which PyTorch runs (JAX's routed one: tests/test_experts.py)."""
    dense = make(**{"backend": "torch", "model.preset": "gemma4_31b", "train.batch_size": 1})
    moe = make(**{"backend": "torch", "model.preset": "gemma4_26b_a4b", "train.batch_size": 1})
    config = archs.ARCHS["gemma4_26b_a4b"].config
    experts = 30 * 256 * 128 * (4 * 704 + 3 * 2816) * 2  # layers x tokens x experts x per token, bfloat16
    assert moe.memory["activations"] > experts > dense.memory["activations"]
    assert config["num_experts_per_token"] == 8


# --- `finetune plan --images N`: Gemma 3's pictures in the plan and in --batch-size auto's -----------------------
# The counts are checked against keras-hub's numbers (256 soft tokens a picture, the encoder's published weights),
# and on JAX against what XLA allocates for a train step whose frozen encoder's pass is its largest part. The check
# at gemma3_4b's real dims is tools/vision_peak.py's (docs/images.md gives its result).

GEMMA3_4B = {"model.preset": "gemma3_4b", "model.seq_len": 512, "train.batch_size": 1, "model.precision": "bfloat16"}
# Passes of the step: the decoder's and the encoder's, of which the plan's total takes the larger.
PASSES = ("activations", "logits", "dequantized_kernel", "vision_forward", "total")


def plan_torch(device=None, **settings):
    cfg = config.load(None, {"backend": "torch", **settings})
    return plan.make(cfg, None, plan.device(device) if device else None)


@pytest.mark.one_backend
def test_gemma3_4b_with_a_picture_counts_256_soft_tokens_and_the_frozen_encoder_s_pass():
    planned = plan_torch(**GEMMA3_4B, **{"data.images": 1})
    assert planned.images == {
        "per_example": 1,
        "tokens_per_image": 256,
        "slots": 1,
        "image_size": 896,
        "seen": "896x896",
    }
    assert any("260 of the 512 tokens" in note and "252 left for the text" in note for note in planned.notes)
    # keras-hub builds the encoder in float32 under bfloat16; a run feeds it the one picture a row. PyTorch
    # holds the scores and their softmax at once (XLA, one of them: the JAX test below).
    per_picture = (2 * 16 * 4096**2 + 5 * 4096 * 1152) * 4
    m = planned.memory
    assert m["vision_forward"] == per_picture and m["image_pixels"] == 896 * 896 * 3 * 4
    two = plan_torch(**{**GEMMA3_4B, "model.seq_len": 1024, "data.images": 2})  # two pictures: two slots a row
    assert two.images["slots"] == 2 and two.memory["vision_forward"] == 2 * per_picture
    assert {g.name: g for g in planned.groups}["vision encoder"].bytes_per_device == 419_816_304 * 4
    held = sum(v for k, v in m.items() if k not in PASSES)
    decoder = m["activations"] + m["logits"] + m["dequantized_kernel"]
    assert m["total"] == held + max(m["vision_forward"], decoder)
    text = plan_torch(**GEMMA3_4B)  # no pictures: the encoder's weights load, it never runs
    assert text.images is None and "vision_forward" not in text.memory
    assert text.memory["weights"] == m["weights"] and m["total"] > text.memory["total"]


@pytest.mark.one_backend
def test_batch_size_auto_fits_fewer_rows_with_pictures_where_the_encoder_s_pass_is_the_larger():
    def rows(**settings):  # 272 tokens: one picture's 260 and a short text, whose decoder pass is the smaller
        planned = plan_torch("l4", **{**GEMMA3_4B, "train.batch_size": "auto", "model.seq_len": 272}, **settings)
        (note,) = [n for n in planned.notes if n.startswith("batch auto")]
        return int(re.search(r"up to (\d+) sequences", note).group(1))

    assert 1 <= rows(**{"data.images": 1}) < rows()


@pytest.mark.one_backend
def test_batch_size_auto_is_the_largest_batch_the_plan_says_fits():
    """The loss's logits are one chunk of positions, whatever the batch: auto counted them per row, and said 9
    for gemma_2b_en on a T4, where the plan of 10 fits."""
    settings = {"model.preset": "gemma_2b_en", "model.remat": "off"}
    planned = make(device="t4", **settings, **{"train.batch_size": "auto"})
    (note,) = [n for n in planned.notes if n.startswith("batch auto")]
    rows = int(re.search(r"up to (\d+) sequences", note).group(1))

    def fits(batch):
        sized = make(device="t4", **settings, **{"train.batch_size": batch})
        return sized.memory["total"] <= sized.usable * (1 - plan.HEADROOM)

    assert rows >= 2 and fits(rows) and not fits(rows + 1)


@pytest.mark.one_backend
def test_the_encoder_s_config_gives_keras_hub_s_counts():
    for name in ("gemma3_4b", "gemma3_12b", "gemma3_27b"):
        arch = archs.ARCHS[name]
        assert archs.vision_parameter_count(arch.vision) == arch.vision_params, name
        assert archs.tokens_per_image(arch.vision) == 256
    tiny = plan_torch(**{"model.preset": "tiny-gemma3-vision", "model.seq_len": 64, "data.images": 2})
    assert tiny.images["tokens_per_image"] == 4 and "vision encoder" in {g.name for g in tiny.groups}


@pytest.mark.one_backend
def test_the_plan_counts_gemma3n_s_pictures_and_its_encoder_as_built():
    """tiny-gemma3n-vision: 4 soft tokens a picture and their 4 markers in the sequence, its 32x32 pixels, and the
    image encoder's and embedder's weights as keras-hub builds them."""
    from finetune.model import presets

    planned = plan_torch(**{"model.preset": "tiny-gemma3n-vision", "model.seq_len": 64, "data.images": 2})
    assert planned.images["tokens_per_image"] == 4 and planned.images["image_size"] == 32
    assert "images: 2 an example, 4 soft tokens each: 16 of the 64 tokens" in " ".join(planned.notes)
    assert (
        planned.memory["image_pixels"] == planned.batch_size * 2 * 32 * 32 * 3 * 4
        and planned.memory["vision_forward"] > 0
    )
    name = "tiny-gemma3n-vision"
    backbone = presets.tiny_backbone(presets.tiny_vocabulary_size(name), name=name)
    built = backbone.vision_encoder.count_params() + backbone.embed_vision.count_params()
    assert built == presets.TINY_GEMMA3N_VISION_PARAMS == planned.model.vision_params
    from finetune.platform.errors import UserError

    with pytest.raises(UserError, match="does not count yet"):
        plan_torch(**{"model.preset": "gemma3n_e2b", "data.images": 1})


@pytest.mark.one_backend
def test_a_run_counts_its_data_s_pictures_over_images():
    assert resolve._images(None, 1) == resolve.Decision(1, "the most a record of the data holds")
    assert resolve._images(2, 1).value == 1 and "--images 2 is for plans" in resolve._images(2, 1).why


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "tiny-gemma3-vision", "--images", "3"], "takes at most 2 pictures an example"),
        (["--preset", "tiny-gemma3-vision", "--images", "-1"], "images per example must not be negative"),
        (["--preset", "tiny-gemma3-vision", "--images", "2", "--seq-len", "16"], "raise --seq-len"),
        (["--preset", "gemma_2b_en", "--images", "1"], "it has no vision encoder"),
        (["--preset", "gemma4_4b", "--images", "1"], "the plan does not count yet"),
        (["--preset", "gemma3n_e2b", "--images", "1"], "whose weights and pass the plan does not count yet"),
        (["--preset", "tiny-gemma3-vision", "--images", "one"], "--images"),
    ],
)
def test_a_bad_images_value_exits_2_with_a_message(args, message):
    result = invoke("--backend", "torch", *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.one_backend
def test_the_command_plans_a_picture_in_a_fresh_process(tmp_path):
    command = Path(sys.executable).with_name("finetune")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    args = [str(command), "plan", "--preset", "tiny-gemma3-vision", "--images", "1"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    for row in ("images 1 per example, 4 soft tokens each", "vision encoder, forward", "pictures, the batch's"):
        assert row in done.stdout, row
    assert not list(tmp_path.iterdir())  # a plan writes nothing


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's memory analysis is JAX's")
def test_the_plan_of_a_frozen_encoder_s_pass_is_within_15_percent_of_what_xla_allocates(tmp_path, monkeypatch):
    """tiny-gemma3-vision with an encoder whose pass is most of the step: 64x64 pictures in 256 patches, 4 heads,
    4 blocks, float32, batch 4 x 64 with one picture a row. Were the encoder's activations kept for the backward,
    XLA would hold about four times its planned pass."""
    import dataclasses
    from types import SimpleNamespace

    import jax
    import numpy as np
    from PIL import Image

    from finetune.data import batching, formats, templates
    from finetune.methods import prepare
    from finetune.model import builder, presets

    heavy = dict(presets.TINY_GEMMA3_VISION_ENCODER, image_size=64, num_heads=4, hidden_dim=32, num_layers=4)
    spec = dataclasses.replace(presets.TINY["tiny-gemma3-vision"], vision=heavy)
    monkeypatch.setitem(presets.TINY, "tiny-gemma3-vision", spec)
    lines = []
    for i in range(4):
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(tmp_path / f"{i}.png")
        lines.append(f'{{"messages": [{{"role": "user", "content": "<image>Colour {i}?"}}, '
                     f'{{"role": "assistant", "content": "blue"}}], "images": ["{i}.png"]}}')  # fmt: skip
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    with float32_policy():
        lora = config.LoraConfig(rank=4)
        recipe = builder.Recipe(64, "float32", lora=lora, optimizer=builder.Optimizer(1e-3, 0.0))
        model = builder.build_model(presets.resolve("tiny-gemma3-vision"), recipe)
        records = formats.read(str(tmp_path / "p.jsonl"))[0]
        cfg = SimpleNamespace(
            model=SimpleNamespace(seq_len=64, preset="tiny-gemma3-vision"), data=SimpleNamespace(train_on_prompt=False)
        )
        usable = prepare.pictured_examples(records, templates.get("gemma-chat"), model.preprocessor, cfg, "p")
        arrays = batching.pad([e for _, e in usable], 64)
        names = builder.input_names(model.lm)
        x, y, w = batching.inputs(arrays, np.arange(4), 1, batching.target_width(arrays, 4), names=names)
        trainer = model.trainer
        trainer.train_on_batch(x, y, sample_weight=w)  # builds AdamW
        state = tuple(
            [v.value for v in variables]
            for variables in (trainer.trainable_variables, trainer.non_trainable_variables,
                              trainer.optimizer.variables, trainer.metrics_variables)
        )  # fmt: skip
        analysis = jax.jit(trainer.train_step).lower(state, (x, y, w)).compile().memory_analysis()
    measured = analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
    planned = plan_torch(**{"backend": "jax", "model.preset": "tiny-gemma3-vision", "model.precision": "float32",
                      "model.seq_len": 64, "train.batch_size": 4, "model.remat": "off", "data.images": 1})  # fmt: skip
    assert planned.memory["vision_forward"] > 0.5 * planned.memory["total"]  # the encoder's pass is the check
    assert planned.memory["total"] == pytest.approx(measured, rel=0.15), (planned.memory, measured)


@pytest.mark.backend_neutral
def test_a_grpo_plan_counts_each_prompt_s_completions_and_the_rollout_s_cache():
    """--batch-size counts prompts, each --num-generations rows in the step; the sampling before the step holds
    keras-hub's KV cache (and on PyTorch the first pass's logits at every prompt position), counted where it
    exceeds the step's own activations and logits."""
    grpo = {"model.preset": "gemma_2b_en", "train.method": "grpo", "model.seq_len": 256}
    four = make(**grpo, **{"train.num_generations": 4})
    eight = make(**grpo, **{"train.num_generations": 8})
    assert eight.memory["activations"] == pytest.approx(2 * four.memory["activations"])
    assert "rollout" not in four.memory  # a short cache: the step's activations are the larger
    # A small model with Gemma 3's 262k vocabulary, remat on: the step's activations are small beside the logits
    # of the first pass of PyTorch's sampling, at every prompt position.
    small = {"model.preset": "gemma3_270m", "train.method": "grpo", "train.num_generations": 8, "model.seq_len": 1024,
             "train.batch_size": 1, "model.remat": "on", "model.precision": "bfloat16"}  # fmt: skip
    torch_plan = make(backend="torch", **small)
    dims = torch_plan.model.dims
    cache = 2 * 8 * dims.num_layers * 2 * 1024 * dims.num_key_value_heads * dims.head_dim * 2
    logits = 8 * 1024 * dims.vocabulary_size * 2
    assert torch_plan.memory["rollout"] == pytest.approx(
        cache + logits - torch_plan.memory["activations"] - torch_plan.memory["logits"]
    )
    assert any("rollout kv cache" in note and "rollout prompt logits" in note for note in torch_plan.notes)
    jax_plan = make(**small)  # XLA keeps no prompt logits
    assert jax_plan.memory.get("rollout", 0) < torch_plan.memory["rollout"]
    shown = invoke("--preset", "gemma_2b_en", "--method", "grpo", "--num-generations", "4", "--seq-len", "256")
    assert shown.exit_code == 0 and "each prompt of a batch is 4 rows" in shown.output, shown.output


def test_the_plan_refuses_a_quantized_base_the_run_refuses(monkeypatch):
    """A family whose quantized base the run refuses (families.Family.no_quantize) is refused by the plan too, for
    the same reason: the plan once said gemma4_31b in int4 fits 24 GB while the run refused it. Gemma 4 quantizes
    now (builder.effective_kernels), so a family is given a reason here."""
    import dataclasses

    from finetune.model import families

    assert make(device="24GB", **{"model.preset": "gemma4_31b", "model.quantize": "int4"}).quantize == "int4"
    refusing = dataclasses.replace(families.FAMILIES["gemma4"], no_quantize="a reason")
    monkeypatch.setitem(families.FAMILIES, "gemma4", refusing)
    with pytest.raises(UserError, match="--quantize int4 is not for Gemma 4 yet: a reason"):
        make(device="24GB", **{"model.preset": "gemma4_31b", "model.quantize": "int4"})


@pytest.mark.backend_neutral  # the plan's Python
def test_new_tokens_rows_are_counted_with_their_gradients_and_moments():
    """--add-tokens trains a float32 row of the hidden width per token beside LoRA (model/tokens.py): its weights,
    gradients and AdamW's two moments, and with --grad-accum their sum, are in the plan."""
    base = make(**{"model.preset": "gemma_2b_en"})
    added = make(**{"model.preset": "gemma_2b_en", "model.add_tokens": ["<a>", "<b>", "<c>"]})
    rows = 3 * 2048
    assert added.memory["new_token_rows"] == 4 * rows * 4 and "new_token_rows" not in base.memory
    assert added.memory["total"] - base.memory["total"] == pytest.approx(added.memory["new_token_rows"])
    assert any("3 new embedding rows (6,144 weights)" in note for note in added.notes)
    accumulating = make(**{"model.preset": "gemma_2b_en", "model.add_tokens": ["<a>"], "train.grad_accum": 2})
    assert accumulating.memory["new_token_rows"] == 5 * 2048 * 4


@pytest.mark.backend_neutral  # the plan's Python
def test_the_table_shows_every_part_of_the_memory_it_totals():
    """Each part the total counts has its row: GRPO's rollout beyond the step and --add-tokens' rows were counted
    in the total and shown nowhere."""
    grpo = {"model.preset": "gemma3_270m", "train.method": "grpo", "train.num_generations": 8, "model.seq_len": 1024,
            "train.batch_size": 1, "model.remat": "on", "model.precision": "bfloat16"}  # fmt: skip
    for settings in (grpo, {"model.add_tokens": ["<a>"]}, {"model.quantize": "int8"}, {"train.grad_accum": 4}):
        planned = make(**{"model.preset": "gemma_2b_en", "backend": "torch", **settings}, device="h100")
        shown = plan.table(planned)
        parts = [key for key, value in planned.memory.items() if key != "total" and value]
        assert parts and all(plan._ROWS[key] in shown for key in parts), (settings, parts)
    assert "rollout" in make(**{"backend": "torch", **grpo}, device="h100").memory
    # --grad-accum's sum of the gradients is a row of its own, the size of the gradients, not in AdamW's moments
    once, summed = (
        make(**{"model.preset": "gemma_2b_en"}),
        make(**{"model.preset": "gemma_2b_en", "train.grad_accum": 4}),
    )
    assert summed.memory["gradient_sum"] == summed.memory["lora_gradients"] and "gradient_sum" not in once.memory
    assert summed.memory["optimizer"] == once.memory["optimizer"]
    assert summed.memory["total"] - once.memory["total"] == pytest.approx(summed.memory["gradient_sum"])
