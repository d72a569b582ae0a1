"""LoRA on Gemma 4's experts (--target experts) and their routed dispatch on JAX, on tiny-gemma4-moe.

The adapted bank computes x W_e + s (x A_e) B_e for each expert, and its merge is W_e + s A_e B_e; the routed
dispatch (a grouped matmul over the token-expert pairs sorted by expert) gives the dense dispatch's outputs and
LoRA gradients; a run on an int4 base trains it from the command line, resumes it, and exports it where the format
can carry it; what the experts' LoRA does not compute is refused with exit 2. The families' own checks (merged and
hf exports of an adapter with experts, an in-process resume) are tests/test_families.py's.
"""

import json
import subprocess
import sys

import h5py
import keras
import numpy as np
import pytest
from conftest import BACKEND, float32_policy, killed_after, write_jsonl
from typer.testing import CliRunner

import finetune
from finetune import config
from finetune.cli import app
from finetune.config import LoraConfig
from finetune.exports import export
from finetune.model import builder, experts, families, optimizer, presets
from finetune.platform import backend
from finetune.platform.errors import UserError
from finetune.training import adapter, guards, plan

TOKENS = np.arange(2, 18)[None].astype("int32")


def inputs(tokens=TOKENS):
    return {"token_ids": tokens, "padding_mask": np.ones_like(tokens), "position_ids": np.arange(tokens.shape[1])[None]}


def adapted_moe(targets=("query", "experts"), seed=0, draw=True):
    """tiny-gemma4-moe in float32 with LoRA on `targets`, its B factors drawn (with `draw`) so that the update is
    not zero."""
    with float32_policy():
        lm, _ = builder.build(presets.resolve("tiny-gemma4-moe"), 32, "float32")
        builder.enable_lora(lm, LoraConfig(rank=2, alpha=4.0, targets=list(targets)), seed=seed)
    if draw:
        draw_b(lm, seed)
    return lm


def draw_b(lm, seed=0):
    rng = np.random.default_rng(seed + 1)
    for variable in lm.trainable_weights:
        if variable.path.endswith("_b"):
            variable.assign(rng.normal(0, 0.1, tuple(variable.shape)).astype("float32"))


def hidden(lm, training=False):
    return keras.ops.convert_to_numpy(lm.backbone(inputs(), training=training))


def test_the_bank_s_lora_starts_at_the_base_and_its_merge_gives_the_adapted_outputs():
    """B starts at zero, so the adapted bank computes the base's outputs; with B drawn, the update beside each
    expert's projections equals the base bank with W_e + s A_e B_e merged in (export.merge), on this backend."""
    with float32_policy():
        base, _ = builder.load_base(presets.resolve("tiny-gemma4-moe"), 32)
    before = hidden(base)
    lm = adapted_moe(["experts"], draw=False)
    np.testing.assert_array_equal(hidden(lm), before)
    banks = experts.banks(lm.backbone)
    assert len(banks) == 2 and {v.path.split("/")[-1] for v in lm.trainable_weights} == set(experts.FACTORS)
    a = keras.ops.convert_to_numpy(banks[0].lora_gate_proj_a)
    assert a.shape == (4, 32, 2) and np.abs(a).max() <= np.sqrt(6 / 32)  # He uniform over each expert's fan-in
    fast = {v.path.split("/")[-1] for v in lm.trainable_weights if optimizer.steps_fast_under_lora_plus(v)}
    assert fast == set(experts.FACTORS[1::2])  # LoRA+ steps the experts' B factors fast, as the others'
    assert guards.b_factors_all_zero(lm.backbone)
    draw_b(lm)
    assert not guards.b_factors_all_zero(lm.backbone)
    layers = adapter.layers_with_weights(lm.backbone)
    factors = {i: [v.numpy() for v in (getattr(layers[i], n) for n in experts.FACTORS)]
               for i in lm.backbone._lora_enabled_layers}  # fmt: skip
    export.merge(base.backbone, factors, 2.0)  # alpha 4 over rank 2
    merged = hidden(base)
    assert np.abs(merged - hidden(lm)).max() < 1e-5 * np.abs(merged).max()
    assert np.abs(merged - before).max() > 0.01 * np.abs(before).max()  # the update is there to merge


@pytest.mark.skipif(BACKEND != "jax", reason="the routed dispatch is built on JAX")
@pytest.mark.parametrize("targets", [("query",), ("query", "experts")])
def test_the_routed_dispatch_gives_the_dense_outputs_and_lora_gradients(targets):
    """Each token through its 2 experts of 4 as a grouped matmul, against keras-hub's dense dispatch (every expert
    on every token) with the same LoRA: outputs, and the gradients of every LoRA factor, in float32."""
    import jax

    lm = adapted_moe(targets)
    backbone = lm.backbone
    trainable = [v.value for v in backbone.trainable_variables]
    frozen = [v.value for v in backbone.non_trainable_variables]
    weights = np.random.default_rng(2).normal(size=(1, 16, 32)).astype("float32")

    def loss(values):
        out, _ = backbone.stateless_call(values, frozen, inputs(), training=True)
        return (out * weights).sum(), out

    results = {}
    for routed in (False, True):
        for bank in experts.banks(backbone):
            bank.routed = routed
        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(trainable)  # traced anew: `routed` changed
        results[routed] = (np.asarray(out), [np.asarray(g) for g in grads])
    (dense_out, dense_grads), (routed_out, routed_grads) = results[False], results[True]
    # Within 1e-5 of each one's largest value: float32's rounding, which sums the two dispatches in other orders (in
    # float64 they agreed exactly); measured at 2e-6 at most.
    assert np.abs(routed_out - dense_out).max() < 1e-5 * np.abs(dense_out).max()
    for variable, got, want in zip(backbone.trainable_variables, routed_grads, dense_grads, strict=True):
        assert np.abs(want).max() > 0, variable.path
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max(), variable.path


@pytest.mark.one_backend
def test_the_routed_dispatch_is_jax_s_on_one_tpu():
    """Where XLA compiles ragged_dot as a grouped matmul: on a CPU and a GPU it pads it out to every expert."""
    assert backend.routed_experts_rule("jax", "tpu")[0]
    for framework, device, devices, why in [
        ("torch", "gpu", 1, "on torch, keras-hub's dense dispatch"),
        ("jax", "cpu", 1, "on a cpu, keras-hub's dense dispatch"),
        ("jax", "gpu", 1, "XLA compiles a grouped matmul on a TPU only"),
        ("jax", "tpu", 8, "over 8 devices"),
    ]:
        routed, said = backend.routed_experts_rule(framework, device, devices)
        assert not routed and why in said


def make(device="v5p", **settings):
    """The plan of gemma4_26b_a4b on one `device` (bfloat16), one sequence of 256, remat off."""
    cfg = config.load(None, {"backend": "jax", "model.preset": "gemma4_26b_a4b", "train.batch_size": 1,
                             "model.remat": "off", **settings})  # fmt: skip
    return plan.make(cfg, None, plan.device(device))


@pytest.mark.one_backend
def test_the_plan_counts_each_expert_s_factors_and_what_routing_saves():
    """Each of the 128 experts' A (in, r) and B (r, out) in each of 30 blocks, three projections; on JAX on one TPU
    the activations of 8 experts a token, not 128, and the note says what that saves; on a GPU all 128."""
    plain, adapted = make(), make(**{"lora.targets": ["query", "value", "experts"]})
    per_block = 128 * 3 * (2816 * 4 + 4 * 704)  # gate and up (2816 -> 704), down (704 -> 2816), rank 4
    assert adapted.lora_parameters - plain.lora_parameters == 30 * per_block
    assert adapted.memory["optimizer"] == 2 * adapted.lora_parameters * 4
    same = make(**{"lora.targets": ["query", "value", *families.EXPERT_PARAMETERS]})
    assert same.lora_parameters == adapted.lora_parameters
    dense = make("h100")
    routed_note = next(note for note in plain.notes if note.startswith("experts:"))
    assert "each token computes its 8 alone" in routed_note and "16x fewer expert FLOPs" in routed_note
    assert "on a gpu, keras-hub's dense dispatch computes every expert" in next(
        n for n in dense.notes if "experts:" in n
    )
    saved = 30 * 256 * (128 * (4 * 704 + 3 * 2816) - 8 * (4 * 704 + 4 * 2816)) * 2  # bfloat16, seq-len 256
    assert dense.memory["activations"] - plain.memory["activations"] == pytest.approx(saved)


@pytest.mark.backend_neutral  # the count is the plan's Python, the build's factors the same on every backend
def test_the_plan_s_count_is_the_built_model_s():
    cfg = config.load(None, {"backend": "jax", "model.preset": "tiny-gemma4-moe", "lora.targets": ["experts"],
                             "lora.rank": 3})  # fmt: skip
    with float32_policy():
        lm, _ = builder.build(presets.resolve("tiny-gemma4-moe"), 32, "float32")
        builder.enable_lora(lm, LoraConfig(rank=3, targets=["experts"]))
    assert plan.make(cfg).lora_parameters == builder.trainable_parameters(lm) == 2 * 3 * 4 * (32 * 3 + 3 * 16)


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "--preset", "tiny-gemma4"], "tiny-gemma4 has no mixture-of-experts layers (a dense Gemma 4)"),
        (["plan", "--preset", "tiny-gemma3"], "Gemma 3 has no mixture-of-experts layers"),
        (["plan", "--preset", "tiny-gemma4-moe", "--target", "experts.gate_up_proj"], "together; pass --target"),
        (["gemma", "--plan-only", "--preset", "tiny-gemma4-moe", "--dora"], "--dora with --target experts: DoRA"),
        (["gemma", "--plan-only", "--preset", "tiny-gemma4-moe", "--lora-dropout", "0.1"], "--lora-dropout with"),
    ],
)
def test_the_plan_refuses_what_the_run_refuses_on_the_experts(args, message):
    result = CliRunner().invoke(app, [*args, "--backend", "jax", "--target", "query,experts"])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.backend_neutral  # refused before a step, by code that does not branch on the backend
def test_the_builder_refuses_what_the_experts_lora_does_not_compute():
    with float32_policy():
        lm, _ = builder.load_base(presets.resolve("tiny-gemma4-moe"), 32)
        dense, _ = builder.load_base(presets.resolve("tiny-gemma4"), 32)
    with pytest.raises(UserError, match="--dora with --target experts"):
        builder.enable_lora(lm, LoraConfig(rank=2, targets=["experts"], dora=True))
    with pytest.raises(UserError, match="--lora-dropout with --target experts"):
        builder.enable_lora(lm, LoraConfig(rank=2, targets=["query", "experts"], dropout=0.1))
    with pytest.raises(UserError, match="adapts an expert's gate, up and down projections together"):
        builder.enable_lora(lm, LoraConfig(rank=2, targets=["experts.down_proj"]))
    with pytest.raises(UserError, match="this model has no mixture-of-experts layers"):
        builder.enable_lora(dense, LoraConfig(rank=2, targets=["experts"]))
    assert not any(getattr(layer, "lora_enabled", False) for layer in lm.backbone._flatten_layers())
    assert builder.enable_lora(lm, LoraConfig(rank=2, targets=list(families.EXPERT_PARAMETERS))) == 2


# --- From the command line, on an int4 base ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    records = [{"instruction": f"What is {i} plus {i + 1}?", "response": f"{2 * i + 1}."} for i in range(24)]
    return write_jsonl(tmp_path_factory.mktemp("data") / "sums.jsonl", records)


def command(data, out, *more):
    return [sys.executable, "-m", "finetune", "gemma", "--preset", "tiny-gemma4-moe", "--backend", BACKEND,
            "--quantize", "int4", "--target", "all-linear", "--target", "experts", "--precision", "float32",
            "--batch-size", "2", "--data", str(data), "--max-records", "24", "--seq-len", "32", "--max-steps", "6",
            "--checkpoint-every", "3", "--set", "train.samples=0", "--output", str(out), *more]  # fmt: skip


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """--quantize int4 on Gemma 4's MoE (refused before: its blocks read the FFW kernels, which came without their
    scales), LoRA on every linear kind and on the experts, in a fresh process."""
    out = tmp_path_factory.mktemp("moe") / "run"
    done = subprocess.run(command(data, out), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def factors(run):
    arrays = {}
    with h5py.File(run / "adapter.lora.h5", "r") as f:
        f.visititems(lambda name, item: arrays.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None)
    return arrays


def test_the_command_line_trains_the_experts_on_an_int4_base(trained):
    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["eval_loss"] < metrics["eval_loss_before"] and metrics["steps"] == 6
    described = json.loads((trained / "adapter.json").read_text())
    assert described["quantize"] == "int4" and described["targets"] == ["all-linear", "experts"]
    banks = [entry for entry in described["adapted"] if entry["name"] == "moe_expert_bank"]
    assert len(banks) == 2 and banks[0]["lora_down_proj_b"] == [4, 4, 32]
    saved = factors(trained)
    moved = [name for name in saved if name.endswith("lora_gate_proj_b") and np.abs(saved[name]).max() > 0]
    assert len(moved) == 2  # every bank's B left zero: the experts trained


@pytest.mark.backend_neutral  # a checkpoint holds every trainable variable, the experts' among them, on each
# backend: tests/test_families.py resumes tiny-gemma4-moe with experts in process on every backend
def test_a_killed_run_resumes_from_the_command_line_to_the_same_experts(trained, data, tmp_path):
    out = killed_after(trained, tmp_path / "killed", 3)
    done = subprocess.run(command(data, out, "--resume"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads((out / "metrics.json").read_text())["resumed_from_step"] == 3
    expected, got = factors(trained), factors(out)
    assert expected.keys() == got.keys() and any("lora_up_proj_a" in name for name in got)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_peft_refuses_the_experts_and_lora_carries_them(trained, tmp_path):
    result = CliRunner().invoke(app, ["export", "--run", str(trained), "--format", "peft", "--output",
                                      str(tmp_path / "peft")])  # fmt: skip
    assert result.exit_code == 2 and "adapter is on the experts" in result.output, result.output
    assert "--format lora" in result.output and not (tmp_path / "peft").exists()
    exported = finetune.export(trained, "lora", tmp_path / "lora")
    assert factors(exported).keys() == factors(trained).keys()
    with float32_policy():
        lm = finetune.load(trained)
    saved, layers = factors(trained), adapter.layers_with_weights(lm.backbone)
    for bank in experts.banks(lm.backbone):  # finetune.load reads the experts' factors keras-hub's loader skips
        name = f"lora/{layers.index(bank)}/vars/lora_down_proj_b"
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(bank.lora_down_proj_b), saved[name])
