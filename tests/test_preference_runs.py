"""Preference runs end to end: DPO from the command line in a fresh process, ORPO and SimPO through the Python API,
a DPO run killed and resumed, and eval, generate and export of a DPO run; the refusals of a wrong method.

The data is learnable by a tiny model: the chosen answer repeats the prompt's word as many times as it asks, the
rejected answer is "no".
"""

import csv
import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest
import yaml
from conftest import BACKEND, invoke, run_with_fault, train, write_jsonl

import finetune
from finetune.methods import preference
from finetune.training import checkpoint

WORDS = ["apple", "river", "stone", "cloud", "green", "music", "paper", "light", "table", "glass"]
FAST = ["--preset", "tiny", "--backend", BACKEND, "--seq-len", "64", "--batch-size", "4", "--lr", "1e-2",
        "--set", "train.samples=1", "--set", "train.max_new_tokens=4"]  # fmt: skip


def learnable_pairs(n=48, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word, times = rng.choice(WORDS), rng.randint(1, 3)
        out.append({"prompt": f"Say {word} {times} times.", "chosen": " ".join([word] * times), "rejected": "no"})
    return out


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", learnable_pairs())


@pytest.fixture(scope="module")
def dpo_run(pairs_file, tmp_path_factory):
    """`finetune gemma --method dpo` as typed, in a fresh process: 20 steps of 4 pairs."""
    out = tmp_path_factory.mktemp("dpo") / "run"
    args = [sys.executable, "-m", "finetune", "gemma", *FAST, "--method", "dpo", "--data", str(pairs_file),
            "--max-steps", "20", "--output", str(out)]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "metrics.json").read_text()), done.stdout


def test_dpo_learns_a_preference_from_the_command_line(dpo_run):
    """ln 2 before training (the policy is the reference), reward accuracy well above chance after; TRL's metrics
    in each step's history row and in metrics.json; the reference scored once, before training."""
    out, metrics, stdout = dpo_run
    assert metrics["method"] == "dpo" and metrics["beta"] == 0.1
    assert metrics["eval_loss_before"] == pytest.approx(math.log(2), abs=1e-5)
    assert metrics["eval_reward_accuracy_before"] == 0.0  # every reward is 0: no pair is ahead yet
    assert metrics["eval_reward_accuracy"] >= 0.75 and metrics["eval_loss"] < 0.5
    assert stdout.count("scoring the reference") == 1
    # each evaluation's line says the reward accuracy, by its name (the held-out metrics hold no `accuracy`)
    assert f"eval loss {metrics['eval_loss']:.4f}, reward accuracy {metrics['eval_reward_accuracy']:.3f}" in stdout
    # --packing auto packs the pairs (issue 34): a packed micro-batch of 4 rows holds several pairs
    assert "packing: 46 pairs in " in stdout and "pairs packed" in stdout, stdout[-3000:]
    header = (out / "history.csv").read_text().splitlines()[0].split(",")
    for name in preference.METRICS:
        assert name in header and metrics[name] is not None, name
    assert "eval_reward_accuracy" in header
    evaluations = [row for row in csv.DictReader((out / "history.csv").open()) if row["eval_loss"]]
    assert evaluations and all(row["eval_reward_accuracy"] and not row["eval_accuracy"] for row in evaluations)


@pytest.mark.backend_neutral  # DPO's scoring runs on every backend above
def test_eval_generate_and_export_work_on_a_dpo_run(dpo_run, tmp_path):
    out, metrics, _ = dpo_run
    evaluated = invoke("eval", "--run", out)
    assert evaluated.exit_code == 0, evaluated.output
    assert f"eval_loss {metrics['eval_loss']:.4f}" in evaluated.output
    assert f"eval_reward_accuracy {metrics['eval_reward_accuracy']:.4f}" in evaluated.output
    generated = invoke("generate", "--run", out, "--prompt", "Say apple 2 times.", "--max-new-tokens", "4")
    assert generated.exit_code == 0, generated.output
    exported = invoke("export", "--run", out, "--format", "peft", "--output", tmp_path / "peft")
    assert exported.exit_code == 0, exported.output
    assert (tmp_path / "peft" / "adapter_config.json").is_file()


@pytest.mark.parametrize("method", ["orpo", "simpo"])
def test_orpo_and_simpo_lower_their_held_out_loss(method, pairs_file, tmp_path):
    settings = {"backend": BACKEND, "data.path": str(pairs_file), "output.dir": str(tmp_path / method),
                "model.seq_len": 64, "train.batch_size": 4, "train.max_steps": 12, "train.learning_rate": 1e-2,
                "train.samples": 0, "train.method": method}  # fmt: skip
    metrics = finetune.run(finetune.load_config("tiny", settings))
    assert metrics["method"] == method
    assert metrics["eval_loss"] < metrics["eval_loss_before"]


@pytest.mark.backend_neutral  # the reference's log-probabilities are numpy; exact resume: test_checkpoint
def test_a_killed_dpo_run_resumes_to_the_same_adapter_without_scoring_the_reference_again(
    pairs_file, tmp_path, monkeypatch
):
    """Packed pairs (issue 34). SIGKILL right after the step-4 checkpoint; --resume reads the reference log-probabilities the checkpoint
    kept (scoring them again is made to fail) and ends at the whole run's adapter and losses, bit for bit."""
    flags = ["--method", "dpo", "--data", pairs_file, "--batch-size", "4", "--lr", "1e-2"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train(whole, *flags)  # conftest's SHORT run: 8 steps, a checkpoint every 2, 40 of the 48 pairs
    stopped = run_with_fault(killed, "SIGKILL", 4, *flags)
    assert stopped.returncode == -9, stopped.stderr[-2000:]
    kept = checkpoint.latest(killed).state()["reference"]
    assert len(kept["train"]) + len(kept["held_out"]) == 40

    def refuse(*args):
        raise AssertionError("a resumed run scored the reference again")

    monkeypatch.setattr(preference, "reference_logps", refuse)
    resumed = invoke("gemma", "--resume", "--output", killed)
    assert resumed.exit_code == 0, resumed.output
    assert "scoring the reference" not in resumed.output
    assert "packing: 38 pairs in " in resumed.output  # --packing auto: the pairs train packed, and resume exactly
    a, b = (json.loads((run / "metrics.json").read_text()) for run in (whole, killed))
    assert a["eval_loss"] == b["eval_loss"] and a["eval_loss_before"] == b["eval_loss_before"]
    assert a["train_loss"] == b["train_loss"] and a["reward_margin"] == b["reward_margin"]
    import h5py

    with h5py.File(whole / "adapter.lora.h5") as f, h5py.File(killed / "adapter.lora.h5") as g:
        names = []
        f.visit(names.append)
        for name in names:
            if hasattr(f[name], "shape"):
                np.testing.assert_array_equal(g[name][()], f[name][()], err_msg=name)


def test_a_method_and_data_that_do_not_match_are_refused(pairs_file, tmp_path):
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"instruction": "Hi.", "response": "Hello."}] * 8)
    for flags, words in [
        (["--method", "dpo", "--data", sft], "--method dpo trains on preference pairs"),
        (["--data", pairs_file], "pass --method dpo"),
        (["--method", "orpo", "--label-smoothing", "0.1", "--data", pairs_file], "--label-smoothing is DPO's"),
    ]:
        result = invoke("gemma", *FAST, *flags, "--max-steps", "1", "--output", tmp_path / "refused")
        assert result.exit_code == 2 and words in result.output, (flags, result.output)
        assert not (tmp_path / "refused").exists()


@pytest.mark.one_backend
def test_plan_counts_packed_rows_or_two_sequences_a_pair():
    """Packed, --batch-size counts rows of --seq-len, whole pairs laid in them: an SFT batch's activations. It
    counted two sequences a row there too, 2x too many. Unpacked, each of the batch's pairs is two sequences."""
    from finetune import config
    from finetune.training import plan

    def activations(method, packing="auto", preset="gemma_2b_en"):
        cfg = config.from_dict({"model": {"preset": preset, "seq_len": 512}, "data": {"packing": packing},
                                "train": {"batch_size": 4, "method": method}})  # fmt: skip
        return plan.make(cfg).memory["activations"]

    sft = activations("sft")
    assert activations("dpo") == activations("orpo") == activations("dpo", "on") == sft
    assert activations("dpo", "off") == activations("simpo", "off") == 2 * sft == 2 * activations("sft", "off")
    # A model with a vision encoder takes keras-hub's own mask, so its rows are not packed (resolve.packing).
    assert activations("dpo", preset="gemma3_4b") == 2 * activations("sft", preset="gemma3_4b")
    packed = invoke("plan", "--preset", "gemma_2b_en", "--batch-size", "4", "--method", "dpo")
    assert packed.exit_code == 0 and "counts rows of --seq-len" in packed.output, packed.output
    shown = invoke("plan", "--preset", "gemma_2b_en", "--batch-size", "4", "--method", "dpo", "--set",
                   "data.packing=off")  # fmt: skip
    assert shown.exit_code == 0 and "two sequences" in shown.output, shown.output


@pytest.mark.backend_neutral  # pairs and template: Python; DPO's ln 2 start: test_preference
def test_conversational_pairs_train_on_a_gemma3_preset(tmp_path):
    """TRL's conversational form (a prompt of messages, one assistant message each side), rendered in the family's
    chat turns, trains with DPO on tiny-gemma3."""
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in learnable_pairs(16)]  # fmt: skip
    data = write_jsonl(tmp_path / "chat.jsonl", chat)
    settings = {"backend": BACKEND, "data.path": str(data), "data.template": "auto", "output.dir": str(tmp_path / "run"),
                "model.seq_len": 64,
                "train.batch_size": 4, "train.max_steps": 3, "train.samples": 0, "train.method": "dpo"}  # fmt: skip
    metrics = finetune.run(finetune.load_config("tiny", {**settings, "model.preset": "tiny-gemma3"}))
    assert metrics["steps"] == 3 and metrics["eval_loss_before"] == pytest.approx(math.log(2), abs=1e-5)
    template = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]["template"]
    assert template == "gemma-chat"  # the family's turns, as SFT chat records take them


@pytest.mark.one_backend  # the bench's worker process: the pair steps themselves are tested on every backend above
def test_bench_trains_dpo_on_the_peer_s_pairs(tmp_path):
    out = tmp_path / "rows.json"
    args = [sys.executable, "-m", "finetune", "bench", "--arch", "tiny", "--seq-len", "64", "--batch-size", "2",
            "--steps", "1", "--warmup", "1", "--recipes", "finetune", "--method", "dpo", "--backends", BACKEND,
            "--json", str(out)]  # fmt: skip
    env = {**__import__("os").environ, "KERAS_BACKEND": BACKEND, "FINETUNE_BENCH_PEAK_SIZE": "1024"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["pairs_per_s"] > 0 and row["tokens_per_s"] > 0 and "dpo, pairs packed" in row["settings"]
    assert row["loss"] == pytest.approx(math.log(2), abs=0.05)  # two steps from ln 2
    assert "pairs/s" in done.stdout


def test_orpo_trains_through_an_epoch_whose_last_step_has_filler_pairs(tmp_path):
    """45 pairs: 2 held out, 43 to train, so the epoch's last step of 4 holds 3 pairs and a filler. A filler pair's
    mean log-probability is 0, and ORPO's log(1 - p) of it was -inf: the step's loss was NaN ("training diverged")."""
    data = write_jsonl(tmp_path / "pairs.jsonl", learnable_pairs(45))
    out = tmp_path / "run"
    args = [sys.executable, "-m", "finetune", "gemma", *FAST, "--seq-len", "32", "--method", "orpo", "--data",
            str(data), "--epochs", "1", "--packing", "off", "--output", str(out)]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 11 and math.isfinite(metrics["train_loss"])  # ceil(43 / 4): the last step is ragged


@pytest.mark.backend_neutral  # pairs are cut in Python before any model; each method's loss: test_preference
@pytest.mark.parametrize("method", ["dpo", "orpo", "simpo"])
def test_a_prompt_longer_than_seq_len_is_cut_and_the_run_trains(method, tmp_path):
    """One prompt that alone filled --seq-len stopped the whole run with a UserError; it is cut, and said so."""
    rows = learnable_pairs(16)
    for row in rows[:3]:
        row["prompt"] = "Think of many things, " * 20 + row["prompt"]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    args = [sys.executable, "-m", "finetune", "gemma", *FAST, "--seq-len", "32", "--method", method, "--data",
            str(data), "--max-steps", "2", "--output", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "note: 3 of 16 pairs cut to --seq-len 32" in done.stdout
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 2


@pytest.mark.backend_neutral  # pairs are cut in Python before any model
@pytest.mark.parametrize("method", ["dpo", "reward"])
def test_a_pair_whose_answers_the_cut_leaves_alike_is_skipped_and_said(method, tmp_path):
    """Answers that differ only past --seq-len are the same tokens once cut: no preference to learn (DPO's ln 2 and
    no gradient), and a held-out one scored the same before and after ("the adapter did not change")."""
    rows = learnable_pairs(16)
    for row in rows[:3]:
        row["chosen"], row["rejected"] = "apple " * 40 + "yes", "apple " * 40 + "no"
    data = write_jsonl(tmp_path / "alike.jsonl", rows)
    result = invoke("gemma", *FAST, "--seq-len", "32", "--method", method, "--data", data, "--max-steps", "2",
                    "--output", tmp_path / "run")  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    assert "note: 3 pairs skipped: cut to --seq-len 32, their chosen and rejected answers are the same" in result.output
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["train_examples"] + metrics["eval_examples"] == 13


class _Stop(Exception):
    pass


@pytest.mark.backend_neutral  # the bench's own loop; lora_off itself is tested on every backend (test_preference)
def test_the_bench_scores_dpo_s_reference_under_the_base_however_many_steps_have_trained(monkeypatch):
    """The bench scores each step's pairs just before the step. It scored them with the policy as trained so far, so
    from the second step on the reference was the policy itself and DPO's loss sat at ln 2 (on JAX, to every digit).
    Each pair's reference must be the base's: the same as a fresh model's, scored before any step."""
    from finetune.tools import bench

    scored, real = {}, bench._score_reference

    def record(view, arrays, pairs, batch_size, feed):
        real(view, arrays, pairs, batch_size, feed)
        scored.update({int(i): arrays.reference[i].copy() for i in pairs})

    monkeypatch.setattr(bench, "_score_reference", record)
    workload = bench.Workload(arch="tiny", seq_len=64, batch_size=2, steps=4, warmup=1, method="dpo")
    bench._work(bench.Spec(BACKEND, "finetune", "precision", workload))  # float32
    assert len(scored) >= 4  # five steps' pairs, all but the first scored after a step has trained

    def base_scores(spec, model, method, *_):  # the same model, untrained: every pair scored at once
        from finetune.data import batching, pair_batches
        from finetune.model import builder

        arrays = pair_batches.pad(bench.bench_pairs(spec.workload, model.tokenizer), spec.workload.seq_len)
        feed = batching.Feed(inputs=builder.input_names(model.lm))
        view = builder.objective_view(model.lm, method.objective(bench.TrainConfig()))
        real(view, arrays, np.array(sorted(scored)), 2, feed)
        raise _Stop(arrays.reference)

    monkeypatch.setattr(bench, "_train_pairs", base_scores)
    with pytest.raises(_Stop) as stop:
        bench._work(bench.Spec(BACKEND, "finetune", "precision", workload))
    base = stop.value.args[0]
    for i, reference in scored.items():
        np.testing.assert_allclose(reference, base[i], rtol=0, atol=1e-4)  # it drifted 2e-3 in 4 steps


def test_a_dora_run_in_bfloat16_scores_its_reference_as_eval_does(pairs_file, tmp_path):
    """The reference is the base, the adapter switched off, in the run as in `finetune eval`: a fresh DoRA adapter
    is the base's function but rounds otherwise in bfloat16, so a reference taken from the model as built made the
    run's held-out loss differ from what `finetune eval` reports of the same adapter."""
    out = tmp_path / "dora"
    result = invoke("gemma", *FAST, "--method", "dpo", "--dora", "--precision", "bfloat16", "--data", pairs_file,
                    "--max-steps", "2", "--set", "train.samples=0", "--output", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    published = json.loads((out / "metrics.json").read_text())
    evaluated = finetune.evaluate(out)
    assert evaluated["loss"] == pytest.approx(published["eval_loss"], abs=1e-6), (evaluated, published)
    assert published["eval_loss_before"] == pytest.approx(np.log(2), abs=1e-6)  # the fresh adapter is the base


@pytest.mark.backend_neutral  # the rows' layout is numpy's
def test_packing_auto_at_batch_1_trains_pairs_longer_than_a_row_unpacked(tmp_path):
    """--batch-size 1 packs a micro-batch of one row, which a pair longer than --seq-len cannot fill whole: auto
    trains the pairs unpacked, and says so (it was refused, as --packing on still is)."""
    long = [{"prompt": "Tell me about " + "the river " * 12, "chosen": " It is long. " * 4, "rejected": " No."}] * 8
    data = write_jsonl(tmp_path / "long.jsonl", long)
    flags = ["--preset", "tiny", "--backend", BACKEND, "--method", "dpo", "--data", str(data), "--seq-len", "48",
             "--batch-size", "1", "--max-steps", "1", "--eval-fraction", "0", "--set", "train.samples=0"]  # fmt: skip
    result = invoke("gemma", *flags, "--output", str(tmp_path / "auto"))
    assert result.exit_code == 0, result.output
    assert "note: packing off: a pair is longer than one row of --seq-len 48" in result.output
    resolved = yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())["resolved"]
    assert resolved["packing"]["value"] is False, resolved
    refused = invoke("gemma", *flags, "--packing", "on", "--output", str(tmp_path / "on"))
    assert refused.exit_code == 2 and "pass --batch-size 2 or more, or --packing off" in refused.output
    assert not (tmp_path / "on").exists()
