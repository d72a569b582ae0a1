"""Evaluation controls (--eval-every, --keep-best, --early-stop, --eval-data, --eval-fraction 0), eval --generate's
ROUGE-L, and generate's sampling: through the loop, the Python API and the command typed in a fresh process."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import BACKEND, SHORT, invoke, make_records, run_with_fault, train, write_jsonl

import finetune
from finetune.data import batching
from finetune.methods import registry
from finetune.training import loop


def metrics(out):
    return json.loads((out / "metrics.json").read_text())


def adapter_arrays(path):
    import h5py

    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: arrays.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None)
    return arrays


def eval_rows(out):
    rows = list(csv.DictReader((out / "history.csv").open()))
    return [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"]]


def typed(*args, env=None):
    """`finetune ARGS` in a fresh process, as a user types it."""
    environment = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"} | (env or {})
    command = [sys.executable, "-m", "finetune", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)


# === The loop, with a scripted held-out loss: when it evaluates, what it keeps, when it stops ===


class Variable:
    def __init__(self):
        self.value = np.zeros(2, np.float32)

    def numpy(self):
        return self.value

    def assign(self, value):
        self.value = np.array(value)


class Trainer:
    """Each step adds 1 to its one variable, so a weight tells the step it was taken at."""

    def __init__(self):
        self.trainable_variables = [Variable()]
        self.optimizer = None  # no schedule or clipping to report (optimizer.step_record gives {})

    def train_on_batch(self, x, y, sample_weight=None, return_dict=True):
        self.trainable_variables[0].assign(self.trainable_variables[0].value + 1)
        return {"loss": 1.0}


class Order(batching.Order):
    steps_per_epoch = 100

    def batch(self, step):
        return {"token_ids": np.zeros((1, 4))}, None, None

    def micro_batches(self, step):
        return [self.batch(step)]

    def metric_weights(self, step):
        return [1.0]

    def tokens(self, step):
        return 4, 2


def scripted_loop(losses, total_steps=10, **evaluation):
    scores = iter(losses)
    saved = []
    score = lambda: {"loss": next(scores), "perplexity": 1.0, "accuracy": 0.5}  # noqa: E731
    settings = loop.Evaluation(score, **evaluation, method=registry.get("sft"))
    hooks = loop.Hooks(settings, lambda progress: saved.append(progress.step), out=open(os.devnull, "w"))
    steps = loop.Loop(Trainer(), Order(), loop.Progress(), loop.Plan(total_steps, checkpoint_every=100), hooks)
    return steps, saved


def test_eval_every_evaluates_between_epochs_and_at_the_end():
    steps, saved = scripted_loop([5, 4, 3, 2], total_steps=10, every=3)
    steps.run()
    assert [e["step"] for e in steps.progress.evaluations] == [3, 6, 9, 10]
    assert saved == [3, 6, 9, 10]  # a checkpoint after each evaluation


def test_keep_best_restores_the_weights_of_the_lowest_loss():
    steps, _ = scripted_loop([5, 2, 3, 4], total_steps=8, every=2, keep_best=True)
    steps.run()
    assert steps.progress.best()["step"] == 4
    assert steps.restore_best()["step"] == 4
    assert steps.trainer.trainable_variables[0].value.tolist() == [4.0, 4.0]  # the weights after step 4


def test_early_stop_ends_after_patience_evaluations_without_improvement():
    steps, saved = scripted_loop([5, 2, 3, 4, 1, 1], total_steps=20, every=2, early_stop=2)
    steps.run()
    assert steps.progress.step == 8
    assert steps.progress.stopped_early["at_step"] == 8
    assert "2 evaluations without a lower held-out loss than 2.0000 at step 4" in steps.progress.stopped_early["reason"]
    assert saved[-1] == 8


def test_grpo_s_log_says_its_held_out_reward_where_its_loss_is_the_negated_reward(capsys):
    """GRPO's held-out loss is its negated mean reward (lower is better for --early-stop and --keep-best); what the
    log and the summary say is the reward."""
    from finetune.training import outputs

    grpo = registry.get("grpo")
    scores = iter([{"loss": -r, "reward": r, "accuracy": 1.0} for r in (0.2, 0.5, 0.4, 0.3, 0.1)])
    settings = loop.Evaluation(scores.__next__, 2, True, 2, ("reward",), grpo)
    hooks = loop.Hooks(settings, lambda progress: None, out=open(os.devnull, "w"))
    steps = loop.Loop(Trainer(), Order(), loop.Progress(), loop.Plan(10, checkpoint_every=100), hooks)
    steps.run()
    assert (
        "2 evaluations without a higher held-out reward than 0.5000 at step 4" in steps.progress.stopped_early["reason"]
    )
    steps.restore_best()
    assert "keep best: publishing the adapter of step 4 (eval reward 0.5000, 100% of the prompts above 0)" in (
        capsys.readouterr().out
    )
    rows = dict(outputs._eval_rows({"method": "grpo", "eval_loss_before": -0.1, "eval_loss": -0.5, "best_step": 4,
                                    "eval_reward_before": 0.1, "eval_reward": 0.5, "eval_accuracy_before": 0.25,
                                    "eval_accuracy": 1.0}))  # fmt: skip
    assert rows == {"eval reward": "0.100 -> 0.500 (best, step 4)", "eval accuracy": "0.250 -> 1.000"}
    # A run from before GRPO's metrics.json had eval_accuracy: its summary has the reward alone.
    rows = dict(outputs._eval_rows({"method": "grpo", "eval_loss_before": -0.1, "eval_loss": -0.5,
                                    "eval_reward_before": 0.1, "eval_reward": 0.5}))  # fmt: skip
    assert rows == {"eval reward": "0.100 -> 0.500"}


def test_no_held_out_records_means_no_evaluation():
    steps, saved = scripted_loop([], total_steps=3)
    steps.evaluation = loop.Evaluation(None)
    steps.run()
    assert steps.progress.evaluations == [] and steps.progress.step == 3


# === Whole runs ===


# A high learning rate makes the held-out loss go up and down, so the best is not always the last.
KEEP_BEST = ("--eval-every", "2", "--keep-best", "--lr", "0.3")


@pytest.fixture(scope="module")
def best_run(tmp_path_factory):
    """A --keep-best run, never stopped: the tests below only read it."""
    out = tmp_path_factory.mktemp("best") / "run"
    train(out, *KEEP_BEST)
    return out


@pytest.mark.backend_neutral
def test_keep_best_publishes_the_best_held_out_loss_in_history(best_run):
    out = best_run
    rows = eval_rows(out)  # history.csv: the evaluations after steps 2, 4, 6 and 8
    best_step, best_loss = min(rows, key=lambda r: r[1])
    published = metrics(out)
    assert published["best_step"] == best_step and published["eval_loss"] == pytest.approx(best_loss, abs=1e-6)
    assert [s for s, _ in rows] == [2, 4, 6, 8]
    # The adapter published is the best one: reloaded, it scores the best row's held-out loss.
    assert finetune.evaluate(out)["loss"] == pytest.approx(best_loss, abs=1e-3)


@pytest.mark.backend_neutral
def test_keep_best_survives_a_kill_and_resume(best_run, tmp_path):
    whole, out = best_run, tmp_path / "killed"
    assert run_with_fault(out, "SIGKILL", 6, *KEEP_BEST).returncode == -9
    assert (sorted((out / "checkpoints").iterdir())[-1] / "best.npz").is_file()
    result = invoke("gemma", "--resume", "--output", out)
    assert result.exit_code == 0, result.output + (result.stderr or "")
    assert metrics(out)["best_step"] == metrics(whole)["best_step"]
    assert metrics(out)["eval_loss"] == metrics(whole)["eval_loss"]
    resumed, uninterrupted = adapter_arrays(out / "adapter.lora.h5"), adapter_arrays(whole / "adapter.lora.h5")
    assert resumed.keys() == uninterrupted.keys()
    assert all(np.array_equal(resumed[k], uninterrupted[k]) for k in resumed)


@pytest.mark.backend_neutral
def test_early_stop_publishes_the_run_with_the_reason(tmp_path, monkeypatch):
    from finetune.training import scoring

    losses = iter([3.0, 2.0, 2.5, 2.6, 2.7, 2.8])  # before training, then after steps 2, 4, 6
    monkeypatch.setattr(scoring.HeldOut, "metrics", lambda self: {"loss": next(losses), "perplexity": 1.0,
                                                                    "accuracy": 0.5})  # fmt: skip
    out = tmp_path / "early"
    result = train(out, "--eval-every", "2", "--early-stop", "2")
    stopped = metrics(out)["stopped_early"]
    assert stopped["at_step"] == 6 and "2 evaluations without a lower held-out loss" in stopped["reason"]
    assert metrics(out)["steps"] == 6 and "early stop at step 6/8" in result.output
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    again = invoke("gemma", "--resume", "--output", out)  # finished: a repeated resume has nothing to do
    assert again.exit_code == 0 and "stopped early at step 6 (--early-stop) and is finished" in again.output
    assert metrics(out)["steps"] == 6


@pytest.mark.backend_neutral
def test_eval_data_with_eval_fraction_0_trains_on_every_record_typed(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", make_records(20))
    held = write_jsonl(tmp_path / "dev.jsonl", make_records(26)[20:])
    out = tmp_path / "run"
    flags = [*SHORT, "--data", data, "--eval-data", held, "--eval-fraction", "0", "--output", out]
    result = typed("gemma", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert metrics(out)["train_examples"] == 20 and metrics(out)["eval_examples"] == 6
    evaluated = typed("eval", "--run", out)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "examples 6" in evaluated.stdout
    reported = float(evaluated.stdout.split("eval_loss ")[1].split()[0])
    assert reported == pytest.approx(metrics(out)["eval_loss"], abs=1e-3)


@pytest.mark.backend_neutral
def test_eval_data_needs_eval_fraction_0(tmp_path):
    held = write_jsonl(tmp_path / "dev.jsonl", make_records(4))
    result = invoke("gemma", *SHORT, "--eval-data", held, "--output", tmp_path / "run")
    assert result.exit_code == 2 and "pass --eval-fraction 0 with it" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.backend_neutral
def test_eval_fraction_0_without_eval_data_skips_evaluation(tmp_path, small_data):
    out = tmp_path / "none-held"
    result = train(out, "--data", small_data, "--eval-fraction", "0", "--max-records", "24")
    assert "evaluation skipped" in result.output and "skipped: nothing held out" in result.output
    published = metrics(out)
    assert published["train_examples"] == 24 and published["eval_examples"] == 0
    assert published["eval_loss"] is None and published["eval_loss_before"] is None
    assert (out / "loss.png").is_file() and eval_rows(out) == []
    refused = invoke("eval", "--run", out)
    assert refused.exit_code == 2 and "held no records out" in refused.stderr
    assert "examples 24" in invoke("eval", "--run", out, "--data", small_data).output
    assert invoke("runs", out).exit_code == 0


@pytest.mark.backend_neutral
def test_keep_best_without_held_out_records_is_refused(tmp_path):
    result = invoke("gemma", *SHORT, "--eval-fraction", "0", "--keep-best", "--output", tmp_path / "run")
    assert result.exit_code == 2 and "--keep-best needs held-out records" in result.stderr


# === finetune eval --generate and finetune generate's sampling, on one tiny run ===


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("generation") / "run"
    train(out, "--eval-fraction", "0.1")  # 3 of the 28 usable records held out (the split ignores the batch size)
    return out


@pytest.mark.backend_neutral  # generation runs on every backend in test_as_typed; ROUGE-L is Python
def test_eval_generate_reports_rouge_l_typed(tiny_run):
    pytest.importorskip("rouge_score")
    result = typed("eval", "--run", tiny_run, "--generate", "2", "--backend", BACKEND)
    assert result.returncode == 0, result.stderr[-2000:]
    reported = float(result.stdout.split("rougeL ")[1].split()[0])
    assert "(2 answers)" in result.stdout and 0.0 <= reported <= 1.0
    assert finetune.evaluate(tiny_run, generate=2)["rougeL"] == pytest.approx(reported, abs=1e-4)


def test_rouge_l_is_rouge_score_s():
    rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
    from finetune.training import scoring

    predictions, references = ["the cat sat on the mat", "a b c"], ["the cat is on the mat", "c b a"]
    expected = [
        rouge_scorer.RougeScorer(["rougeL"]).score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references)
    ]
    assert scoring.rouge_l(predictions, references) == pytest.approx(sum(expected) / 2)
    assert scoring.rouge_l(["same words"], ["same words"]) == 1.0


@pytest.mark.skipif(BACKEND != "tensorflow", reason="keras-hub's RougeL needs TensorFlow")
def test_rouge_l_matches_keras_hub_s_metric():
    import keras_hub

    from finetune.training import scoring

    predictions, references = ["the cat sat on the mat", "a b c d"], ["the cat is on the mat", "c b a d"]
    metric = keras_hub.metrics.RougeL()
    metric.update_state(references, predictions)
    assert scoring.rouge_l(predictions, references) == pytest.approx(float(metric.result()["f1_score"]), abs=1e-6)


def test_a_seed_makes_sampling_repeatable_and_greedy_stays_the_default(tiny_run):
    prompts = ["What is 2 plus 3?"]
    sampled = [finetune.generate(tiny_run, prompts, 8, temperature=2.0, top_k=50, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]
    greedy = finetune.generate(tiny_run, prompts, 8)
    assert finetune.generate(tiny_run, prompts, 8, seed=5) == greedy  # a seed alone samples nothing
    assert finetune.generate(tiny_run, prompts, 8, top_p=0.9, temperature=1.5, seed=1) == finetune.generate(
        tiny_run, prompts, 8, top_p=0.9, temperature=1.5, seed=1
    )
    with pytest.raises(finetune.UserError, match="top_p must be in"):
        finetune.generate(tiny_run, prompts, top_p=2.0)
    # a top-k past the vocabulary keeps every token, as transformers' does: the frameworks' top_k refused it
    from finetune.model import presets

    vocabulary = presets.tiny_vocabulary_size()
    every = finetune.generate(tiny_run, prompts, 8, temperature=2.0, top_k=vocabulary, seed=3)
    assert finetune.generate(tiny_run, prompts, 8, temperature=2.0, top_k=10**6, seed=3) == every
    assert finetune.generate(tiny_run, prompts, 8, top_p=0.9, top_k=10**6, seed=3) == finetune.generate(
        tiny_run, prompts, 8, top_p=0.9, top_k=vocabulary, seed=3
    )


@pytest.mark.backend_neutral  # the labels are Python; seeded sampling is checked on every backend above
def test_generate_typed_labels_several_prompts_and_samples(tiny_run):
    flags = ["--run", tiny_run, "--max-new-tokens", "4", "--backend", BACKEND]
    result = typed("generate", *flags, "--prompt", "one", "--prompt", "two", "--top-p", "0.9", "--seed", "3")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "[1] one" and "[2] two" in lines
    again = typed("generate", *flags, "--prompt", "one", "--prompt", "two", "--top-p", "0.9", "--seed", "3")
    assert again.stdout == result.stdout and "note: --seed" not in result.stderr
    greedy = invoke("generate", *flags, "--prompt", "one", "--seed", "3")  # a seed, and nothing to seed: said
    assert greedy.exit_code == 0 and "note: --seed seeds sampling, and these answers are greedy" in greedy.stderr
    refused = invoke("generate", "--run", tiny_run, "--prompt", "x", "--temperature", "0")
    assert refused.exit_code == 2 and "--temperature must be positive" in refused.stderr
