"""`finetune gemma --method rloo`: TRL's RLOOConfig's defaults, what it takes and refuses, and runs from the command
line in a fresh process: it learns, logs RLOO's quantities, and resumes to the uninterrupted run. Its advantages
and loss against TRL's code: test_rloo_trl.py. GRPO's rollouts, which it shares: test_grpo.py, test_rollouts.py."""

import csv
import dataclasses
import json

import numpy as np
import pytest
from conftest import invoke, make_records, write_jsonl
from test_grpo import assert_same_run, files, grpo, guide_run, history, killed_and_resumed, story_prompts  # noqa: F401 (files: the fixture)

from finetune.config import TrainConfig
from finetune.methods import registry, rloo
from finetune.platform.errors import UserError


def run(*args, fault=None):
    """`finetune gemma --method rloo` with test_grpo's FAST settings (8 completions of 4 tokens a prompt), fresh."""
    return grpo(*args, fault=fault, method="rloo")


@pytest.mark.one_backend
def test_the_defaults_are_trl_s_rlooconfig_s():
    trl_config = pytest.importorskip("trl.trainer.rloo_config")
    theirs = {f.name: f.default for f in dataclasses.fields(trl_config.RLOOConfig)}
    decided = registry.decide(TrainConfig(method="rloo", reward=["length"]), "prompts")
    for name in ("beta", "num_generations", "temperature", "top_p", "epsilon", "num_iterations",
                 "normalize_advantages"):  # fmt: skip
        assert decided[name][0] == theirs[name], name
    assert theirs["epsilon_high"] is None and decided["epsilon_high"][0] == decided["epsilon"][0]
    assert decided["max_completion_length"][0] == theirs["max_completion_length"] // 2  # as GRPO's: one device
    # --beta 0 is TRL's "no reference model", as GRPO's; RLOO takes no --loss-type or --scale-rewards (TRL's has none)
    assert registry.decide(TrainConfig(method="rloo", reward=["length"], beta=0.0), "prompts")["beta"][0] == 0.0
    for name in ("loss_type", "scale_rewards"):
        assert name not in decided and name not in theirs
    assert "normalize_advantages" not in registry.get("grpo").defaults


@pytest.mark.one_backend
def test_the_leave_one_out_baseline_by_hand():
    """Each completion's advantage is its reward less its siblings' mean; the KL penalty comes off first."""
    table = np.array([[1.0], [0.0], [0.0], [3.0]], np.float32)  # one prompt, 4 completions
    advantage, stats = rloo.leave_one_out(table, np.ones(1), 4)
    np.testing.assert_allclose(advantage, [1 - 1, 0 - 4 / 3, 0 - 4 / 3, 3 - 1 / 3], rtol=1e-6)
    penalised, _ = rloo.leave_one_out(table, np.ones(1), 4, penalty=np.array([0.0, 0.0, 0.0, 3.0]))
    np.testing.assert_allclose(penalised, [1 - 0, -1 / 3, -1 / 3, 0 - 1 / 3], rtol=1e-6)
    assert stats["reward"] == 1.0  # the rewards' statistics are before the penalty, as TRL logs them


@pytest.mark.one_backend
@pytest.mark.parametrize("method, settings, said", [
    ("rloo", {"loss_type": "grpo"}, "--loss-type is GRPO's; --method rloo has none"),
    ("rloo", {"scale_rewards": "batch"}, "--scale-rewards is GRPO's; --method rloo has none"),
    ("grpo", {"normalize_advantages": True}, "--normalize-advantages is RLOO's; --method grpo has none"),
    ("dpo", {"num_iterations": 2}, "--num-iterations is a setting of GRPO and RLOO"),
])  # fmt: skip
def test_each_online_method_refuses_the_other_s_own_settings(method, settings, said):
    with pytest.raises(UserError, match=said):
        train = TrainConfig(method=method, reward=["length"] * (method != "dpo"), **settings)
        registry.decide(train, "preference" if method == "dpo" else "prompts")


@pytest.mark.one_backend
@pytest.mark.parametrize("flags, said", [
    (["--data", "SFT", "--reward", "length"], "--method rloo trains on prompts alone"),
    (["--data", "PROMPTS", "--reward", "length", "--loss-type", "grpo"], "--loss-type is GRPO's"),
    (["--data", "PROMPTS", "--reward", "length", "--scale-rewards", "none"], "--scale-rewards is GRPO's"),
    (["--data", "PROMPTS", "--reward", "length", "--num-generations", "1"], "num generations must be at least 2"),
    (["--data", "PROMPTS", "--reward", "length", "--batch-size", "auto"], "--method rloo: --batch-size counts prompts"),
])  # fmt: skip
def test_refusals_from_the_command_line_exit_2_before_anything_is_written(tmp_path, flags, said):
    data = {"SFT": write_jsonl(tmp_path / "sft.jsonl", make_records(8)),
            "PROMPTS": write_jsonl(tmp_path / "prompts.jsonl", story_prompts()[:8])}  # fmt: skip
    flags = [data.get(f, f) for f in flags]
    out = tmp_path / "run"
    refused = invoke("gemma", "--preset", "tiny", "--method", "rloo", "--seq-len", "48", "--max-completion-length",
                     "4", "--max-steps", "1", *flags, "--output", out)  # fmt: skip
    assert refused.exit_code == 2 and said in refused.output, refused.output
    assert not out.exists()


@pytest.mark.one_backend
def test_normalize_advantages_on_a_grpo_run_exits_2_in_a_fresh_process(files, tmp_path):  # noqa: F811
    data, _ = files
    done = grpo("--data", data, "--reward", "length", "--normalize-advantages", "--max-steps", "1", "--output",
                tmp_path / "run")  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--normalize-advantages is RLOO's; --method grpo has none" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def learning_flags(files, out) -> list:  # noqa: F811
    data, reward_file = files
    return ["--data", data, "--reward", f"{reward_file}:starts_with_the", "--max-steps", "8", "--output", out]


@pytest.fixture(scope="module")
def learned(files, tmp_path_factory):  # noqa: F811
    """8 steps of 4 prompts, 8 completions each, on a learnable reward, with TRL's --beta 0.05 KL penalty."""
    out = tmp_path_factory.mktemp("learned") / "run"
    done = run(*learning_flags(files, out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "metrics.json").read_text()), done.stdout


def test_rloo_learns_from_the_command_line_and_logs_its_quantities(learned):
    """A fresh process: the held-out reward rises; history.csv has the rollouts' rewards, the KL of the penalty,
    the clip ratios and the entropy; metrics.json names the method and its constants."""
    out, metrics, stdout = learned
    assert metrics["method"] == "rloo" and metrics["beta"] == 0.05 and metrics["normalize_advantages"] is False
    assert "loss_type" not in metrics and metrics["num_generations"] == 8
    assert metrics["eval_reward"] >= metrics["eval_reward_before"] + 0.3, metrics
    with (out / "history.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["train_loss"]]
    for name in ("reward", "reward_std", "reward_starts_with_the", "frac_reward_zero_std", "kl", "clip_ratio_low",
                 "clip_ratio_high", "clip_ratio_region", "entropy", "completion_length"):  # fmt: skip
        assert all(r[name] != "" for r in rows), name
    assert float(rows[0]["kl"]) == 0.0 and float(rows[-1]["kl"]) != 0.0  # the adapter starts as the base
    assert metrics["train_kl"] is not None and metrics["train_entropy"] is not None
    assert "rollout 8: reward" in stdout


@pytest.mark.backend_neutral  # the rollout order's resume is GRPO's, whose kill and resume run on every backend
def test_a_killed_rloo_run_resumes_to_the_uninterrupted_history_and_adapter(files, learned, tmp_path):  # noqa: F811
    """SIGKILL right after the step-4 checkpoint, then --resume alone: history.csv and the adapter are the
    uninterrupted run's (its rollouts, KL penalty and reference passes included)."""
    whole, metrics, _ = learned
    out = tmp_path / "killed"
    resumed = killed_and_resumed(run, out, 4, *learning_flags(files, out), "--checkpoint-every", "4")
    assert "resuming" in resumed.stdout and "rollout 5: reward" in resumed.stdout
    assert_same_run(whole, out)
    assert json.loads((out / "metrics.json").read_text())["eval_reward"] == pytest.approx(metrics["eval_reward"])


@pytest.mark.backend_neutral  # the order's state is Python's; GRPO's kill inside a batch runs on every backend
def test_a_run_killed_within_a_batch_of_rollouts_resumes_to_the_uninterrupted_run(files, tmp_path):  # noqa: F811
    """--num-iterations 2 with --normalize-advantages: each batch trains two steps, its sequence ratios moving off 1
    on the second; killed after step 1, the checkpoint kept step 2's batch, and the resumed run is the whole one."""
    data, reward_file = files
    flags = ["--data", data, "--reward", f"{reward_file}:opens_with_the", "--num-iterations", "2",
             "--normalize-advantages", "--max-steps", "4", "--eval-fraction", "0", "--checkpoint-every", "1"]  # fmt: skip
    whole = tmp_path / "whole"
    done = run(*flags, "--output", whole)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = tmp_path / "run"
    resumed = killed_and_resumed(run, out, 1, *flags, "--output", out, kept=True)  # step 2's batch
    assert "sampled again" not in resumed.stdout and "rollout 1: reward" not in resumed.stdout
    assert [r["step"] for r in history(out)] == [1, 2, 3, 4]
    assert_same_run(whole, out)


@pytest.mark.one_backend  # rl.md marks it slow for test_docs, naming this test
def test_the_rl_guide_s_rloo_run_learns_as_it_says(tmp_path):
    """docs/rl.md's RLOO command, as written, from a directory holding the repository's examples/."""
    metrics = json.loads((guide_run("rloo", tmp_path) / "metrics.json").read_text())
    assert metrics["method"] == "rloo" and metrics["eval_reward"] - metrics["eval_reward_before"] >= 0.4, metrics
