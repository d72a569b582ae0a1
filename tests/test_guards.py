"""The guards against a run that trains and learns nothing on a new Gemma (issue 36): float16 on Gemma 3, 3n and 4
(the rule itself: test_resolve), an adapter that never moved, a broken forward, and KV sharing's cached generation.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from conftest import BACKEND, SHORT, float32_policy, invoke, train

import finetune
from finetune.model import presets
from finetune.training import guards, outputs, runs

QUIET = {**os.environ, "KERAS_BACKEND": BACKEND, "TF_CPP_MIN_LOG_LEVEL": "3"}


# === float16 on Gemma 3, 3n and 4: warned, not refused ===


@pytest.mark.backend_neutral  # the warning is resolve.py's; float16 trains on every backend: test_objective
def test_float16_on_gemma3_is_warned_once_and_trains(tmp_path):
    args = ["gemma", "--preset", "tiny-gemma3", "--precision", "float16", "--backend", BACKEND, "--seq-len", "32",
            "--batch-size", "2", "--max-steps", "1", "--max-records", "12", "--set", "train.samples=0",
            "--output", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "finetune", *args], capture_output=True, text=True, env=QUIET,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("warning: --precision float16: Gemma 3's activations pass float16's largest") == 1
    precision = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["resolved"]["precision"]
    assert precision["value"] == "float16" and "65,504" in precision["why"]


# === An adapter that never moved ===


@pytest.mark.one_backend
def test_an_unchanged_adapter_is_found_with_its_likely_cause():
    rows = [{"step": 1, "train_loss": 2.0, "learning_rate": 0.0, "grad_norm": 0.5}]
    why = guards.adapter_unchanged(True, 2.5, 2.5, rows, 40, 1e-4)
    assert why.startswith("every LoRA B factor is still exactly 0") and "learning rate 0" in why
    why = guards.adapter_unchanged(False, 2.51241, 2.51236, [{**rows[0], "learning_rate": 1e-9}], 40, 1e-9)
    assert why.startswith("the held-out loss is 2.5124 before and after") and "--lr 1e-09" in why
    assert "0 steps" in guards.adapter_unchanged(True, None, None, [], 0, 1e-4)
    masked = guards.adapter_unchanged(True, None, None, [{**rows[0], "learning_rate": 1e-4}], 0, 1e-4)
    assert "masked out of the loss" in masked
    assert guards.adapter_unchanged(False, 2.5, 2.4, rows, 40, 1e-4) is None
    assert guards.adapter_unchanged(False, None, None, rows, 40, 1e-4) is None  # nothing held out, B moved


def test_a_run_at_learning_rate_0_says_the_adapter_did_not_change(tmp_path):
    """--lr 0 is refused at the edge; a run whose only step is its warm-up's first trains at learning rate 0."""
    refused = invoke("gemma", *SHORT, "--lr", "0", "--output", tmp_path / "zero")
    assert refused.exit_code == 2 and "learning rate must be positive" in refused.output
    assert not (tmp_path / "zero").exists()
    out = tmp_path / "warm-up"
    result = train(out, "--max-steps", "1", "--warmup-steps", "1")
    assert "warning: the adapter did not change: every LoRA B factor is still exactly 0" in result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["adapter_changed"] is False and "learning rate 0" in metrics["adapter_changed_why"]
    listed = invoke("runs", out)
    assert listed.exit_code == 0 and "the adapter did not change" in listed.output


def test_a_run_that_trains_says_nothing_of_the_kind(uninterrupted):
    metrics = json.loads((uninterrupted / "metrics.json").read_text())
    assert metrics["adapter_changed"] is True and metrics["forward_warning"] is None
    assert metrics["held_out_warning"] is None
    assert "did not change" not in outputs.summary_table(metrics, uninterrupted)
    assert runs.describe(uninterrupted)["note"] == ""


# === An adapter that scores its held-out records worse than the base ===


@pytest.mark.one_backend
def test_a_held_out_loss_above_the_base_s_is_doubted_with_its_likely_causes():
    why = guards.held_out_worse(2.5, 2.61, None, 2e-4)
    assert why.startswith("the held-out loss rose in training, 2.5000 -> 2.6100: the adapter scores")
    assert "--lr 0.0002" in why and "--keep-best" in why
    best = guards.held_out_worse(2.5, 2.61, 40, 2e-4)
    assert "the best evaluation's adapter (step 40)" in best and "--keep-best" not in best
    assert guards.held_out_worse(2.5, 2.4, None, 2e-4) is None
    assert guards.held_out_worse(2.51241, 2.51244, None, 2e-4) is None  # the same to the summary's digits
    assert guards.held_out_worse(None, None, None, 2e-4) is None  # nothing held out (or GRPO's sampled reward)


@pytest.mark.backend_neutral  # the check reads the held-out loss every backend computes: test_backends_agree
def test_a_dpo_run_held_out_on_the_opposite_preference_is_warned(tmp_path):
    """Trained to prefer one answer and evaluated on pairs that prefer the other, the held-out loss rises above
    ln 2, the base's: the summary, metrics.json and `finetune runs` say so."""
    train_pairs, held_out = tmp_path / "train.jsonl", tmp_path / "held-out.jsonl"
    pairs = [(f"Is {i} good?", "yes it is", "no it is not") for i in range(16)]
    train_pairs.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in pairs))
    held_out.write_text("".join(json.dumps({"prompt": p, "chosen": r, "rejected": c}) + "\n" for p, c, r in pairs))
    out = tmp_path / "run"
    result = invoke("gemma", *SHORT, "--method", "dpo", "--data", train_pairs, "--eval-data", held_out,
                    "--eval-fraction", "0", "--seq-len", "32", "--batch-size", "4", "--max-steps", "4",
                    "--set", "train.samples=0", "--output", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_loss"] > metrics["eval_loss_before"] == pytest.approx(math.log(2), abs=1e-5)
    assert metrics["held_out_warning"].startswith("the held-out loss rose in training")
    assert result.output.count("warning: the held-out loss rose in training") == 1
    assert "held-out loss above the base's" in runs.describe(out)["note"]


# === A broken forward ===


@pytest.mark.one_backend
def test_a_first_loss_near_ln_vocabulary_is_a_broken_forward():
    uniform = math.log(262_144)  # 12.48: Gemma 3's and 4's vocabulary
    warning = guards.broken_forward(0.91 * uniform, 262_144)
    assert "weights were not loaded" in warning and "tokenizer or chat template" in warning
    assert "precision overflow" in warning
    assert guards.broken_forward(1.2 * uniform, 262_144) is not None  # worse than a uniform guess
    assert guards.broken_forward(0.89 * uniform, 262_144) is None
    assert guards.broken_forward(2.1, 262_144) is None  # what a pretrained Gemma scores
    assert guards.broken_forward(float("nan"), 262_144) is None  # the NaN stop says that one


@pytest.mark.backend_neutral  # the check reads the held-out loss every backend computes: test_backends_agree
def test_a_pretrained_preset_whose_first_loss_is_a_uniform_guess_is_warned(tmp_path, monkeypatch, capsys):
    """tiny-gemma3's weights are random, so its first loss is about ln(811) = 6.70: counted as pretrained here, it
    is what a preset whose weights never loaded looks like."""
    monkeypatch.setattr(presets, "pretrained", lambda source: True)
    settings = {"backend": BACKEND, "output.dir": str(tmp_path / "run"), "model.preset": "tiny-gemma3",
                "model.seq_len": 32, "train.batch_size": 2, "train.max_steps": 1, "train.samples": 0,
                "data.max_records": 12}  # fmt: skip
    metrics = finetune.run(finetune.load_config("tiny", settings))
    printed = capsys.readouterr().out
    assert abs(metrics["eval_loss_before"] - math.log(811)) < 0.1 * math.log(811)
    assert metrics["forward_warning"].startswith("the held-out loss before training")
    assert printed.count("weights were not loaded") == 2  # when it was measured, and in the summary
    assert "broken forward" in runs.describe(tmp_path / "run")["note"]


# === KV sharing: the cached generation equals the forward pass ===


def recording_sampler(steps: int):
    """keras-hub's greedy sampler, stepped `steps` times in Python so that it keeps the logits of each cached step."""
    import keras_hub

    class Recording(keras_hub.samplers.GreedySampler):
        def __init__(self):
            super().__init__()
            self.logits = []

        def compute_probabilities(self, logits):
            self.logits.append(logits)
            return super().compute_probabilities(logits)

        def run_loop(self, cond, body, loop_vars=None, maximum_iterations=None, model=None):
            for _ in range(steps):
                loop_vars = body(*loop_vars)
            return loop_vars

    return Recording()


def cached_steps(lm, ids, mask, steps: int):
    """(the token ids, the logits of each step) of lm.generate_step, keras-hub's cached generation, stepped by
    recording_sampler; compiled on JAX, whose op-by-op dispatch took 33 s for it."""
    from keras import ops

    sampler = lm.sampler = recording_sampler(steps)

    def generate(ids, mask):
        sampler.logits.clear()
        out = lm.generate_step({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)["token_ids"]
        return out, ops.stack(sampler.logits)

    if BACKEND == "jax":
        import jax

        generate = jax.jit(generate)
    out, logits = generate(ops.convert_to_tensor(ids), ops.convert_to_tensor(mask))
    return ops.convert_to_numpy(out), ops.convert_to_numpy(logits).astype("float32")[:, 0]


def log_softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("preset", ["tiny-gemma3n", "tiny-gemma4"])
def test_the_cached_generation_of_kv_shared_layers_equals_the_forward_pass(preset):
    """Their last layer borrows an earlier layer's keys and values (transformers' training path once lost them): the
    log-prob of each token keras-hub's cached greedy generation picks equals the teacher-forced forward's."""
    from keras import ops

    from finetune.model import builder, families

    with float32_policy():
        lm, _ = builder.build(presets.resolve(preset), 32, "float32")
    shared = [block.is_kv_shared_layer for block in families.decoder_blocks(lm.backbone)]
    assert any(shared) and not all(shared)
    prompt, length = 5, 14  # 9 new tokens, past the sliding windows of 4
    ids = np.zeros((1, length), "int32")
    ids[0, :prompt] = [2, 681, 513, 413, 223]
    mask = np.arange(length)[None] < prompt
    lm.compile(sampler="greedy")
    generated = np.asarray(
        ops.convert_to_numpy(lm.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)["token_ids"])
    )
    stepped, logits = cached_steps(lm, ids, mask, length - prompt)
    np.testing.assert_array_equal(stepped, generated)  # compiled = stepped
    fed = {"token_ids": generated, "padding_mask": np.ones((1, length), "int32"),
           "position_ids": np.arange(length, dtype="int32")[None]}  # fmt: skip
    names = builder.input_names(lm)
    forward = log_softmax(ops.convert_to_numpy(lm({k: v for k, v in fed.items() if k in names}))[0].astype("float32"))
    cached = log_softmax(logits)
    assert len(cached) == length - prompt
    for step, position in enumerate(range(prompt, length)):
        token = generated[0, position]
        assert forward[position - 1].argmax() == token
        assert abs(forward[position - 1, token] - cached[step, token]) < 1e-4, (position, token)
    np.testing.assert_allclose(cached, forward[prompt - 1 : length - 1], atol=1e-4)
