"""`finetune gemma --method grpo`: prompt-only data, refusals, and a run from the command line in a fresh process."""

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import adapter_arrays, invoke, write_jsonl

import finetune
from finetune.data import formats
from finetune.methods import registry, rollouts
from finetune.platform.errors import UserError
from finetune.training import checkpoint, runs

REWARDS = '''
def starts_with_the(prompts, completions, answer, **columns):
    """1 where the completion opens with "The". Each record's `answer` (its subject) arrives beside its prompt."""
    assert len(answer) == len(completions) and all(a in p for p, a in zip(prompts, answer)), (prompts, answer)
    return [float(c.strip().startswith("The")) for c in completions]


def opens_with_the(prompts, completions, **columns):
    return [float(c.strip().startswith("The")) for c in completions]


def broken(prompts, completions, **columns):
    raise RuntimeError("no judge today")


def none_at_all(prompts, completions, log_metric, **columns):
    log_metric("skipped", float(len(completions)))  # TRL's: a metric of the function's own
    return [None for _ in completions]


def the_but_held_out_the_same(prompts, completions, **columns):
    """opens_with_the, and 0.5 for every held-out prompt (they open with "Held"), whatever it is answered."""
    return [0.5 if p.startswith("Held") else float(c.strip().startswith("The")) for p, c in zip(prompts, completions)]
'''
SUBJECTS = ["a cat", "the sea", "a king", "rain", "a robot", "winter", "a bridge", "music", "a road", "fire", "a lamp",
            "the moon", "a boat", "bread", "a clock", "snow", "a horse", "the city", "a garden", "a river", "a teacher",
            "a storm", "a forest", "a song", "a letter", "a mountain", "a village", "a dragon", "the sun", "a friend",
            "a house", "a train"]  # fmt: skip


def story_prompts() -> list:
    """64 prompts the tiny preset has not seen: it was pretrained on the shipped sample, whose prompts it answers
    by rote (p = 0.999 for the first word of "What is the capital of Vietnam?"), so that all G completions of
    one of those prompts are alike and no group has an advantage to learn from."""
    return [{"prompt": f"{kind} {s}.", "answer": s} for kind in ("Write a story about", "Tell me about")
            for s in SUBJECTS]  # fmt: skip


def sample_prompts(n=24):
    rows = [json.loads(line) for line in formats.SAMPLE_PATH.read_text().splitlines()[:n]]
    return [{"prompt": r["instruction"]} for r in rows]


@pytest.mark.one_backend
def test_prompt_records_are_read_with_their_columns(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?", "answer": "6"}])
    records, found = formats.read(str(path))
    assert found == "prompts" and records[1].columns == {"answer": "6"} and records[1].instruction == "3+3?"
    chat = write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "Hi?"}], "solution": 1}])  # fmt: skip
    records, found = formats.read(str(chat))
    assert found == "prompts-chat" and records[0].turns == (("user", "Be brief.\n\nHi?"),)
    assert records[0].columns == {"solution": 1}
    # The reward functions get the messages as the data gives them (TRL's prompts), the system message apart.
    assert rollouts.messages_of(records[0]) == [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Hi?"}]  # fmt: skip


@pytest.mark.one_backend
def test_only_grpo_takes_prompts_and_grpo_takes_only_prompts():
    from finetune.config import TrainConfig

    with pytest.raises(UserError, match="pass --method grpo"):
        registry.decide(TrainConfig(), "prompts")
    with pytest.raises(UserError, match="trains on prompts alone"):
        registry.decide(TrainConfig(method="grpo", reward=["exact"]), "dolly")
    with pytest.raises(UserError, match="--reward scores the rollouts of GRPO and RLOO"):
        registry.decide(TrainConfig(reward=["exact"]), "dolly")
    with pytest.raises(UserError, match="--num-generations is a setting of GRPO and RLOO"):
        registry.decide(TrainConfig(method="dpo", num_generations=4), "preference")
    with pytest.raises(UserError, match="--beta 0"):
        registry.decide(TrainConfig(method="dpo", beta=0.0), "preference")
    decided = registry.decide(TrainConfig(method="grpo", reward=["exact"]), "prompts")
    assert decided["loss_type"][0] == "dapo" and decided["num_generations"][0] == 8 and decided["beta"][0] == 0.0


@pytest.mark.one_backend
def test_grpo_s_samples_are_as_long_as_its_rollouts():
    """samples.md's generations are scored by the rewards as rollouts are: they take --max-completion-length,
    not --max-new-tokens (a length reward scored them at 48 tokens where rollouts had 8)."""
    from finetune.config import Config

    cfg = Config()
    cfg.train.method, cfg.train.reward, cfg.train.max_completion_length = "grpo", ["length"], 8
    assert registry.get("grpo").sample_tokens(cfg) == 8 and registry.get("sft").sample_tokens(cfg) == 48


FAST = ["--preset", "tiny", "--precision", "float32", "--seq-len", "48", "--batch-size", "4", "--num-generations",
        "8", "--max-completion-length", "4", "--temperature", "1", "--lr", "3e-2", "--eval-fraction", "0.25",
        "--set", "train.samples=0"]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo")
    (folder / "rewards.py").write_text(REWARDS)
    return write_jsonl(folder / "prompts.jsonl", story_prompts()), folder / "rewards.py"


def grpo(*args, fault: tuple | None = None, method: str = "grpo") -> subprocess.CompletedProcess:
    """`finetune gemma --method grpo` (or `method`, RLOO's) with FAST's settings, in a fresh process; `fault`
    (signal, step): killed by tests/fault_run.py right after that step's checkpoint."""
    program, env = ["-m", "finetune"], dict(os.environ)
    if fault is not None:
        program = [str(Path(__file__).parent / "fault_run.py")]
        env.update({"FAULT": fault[0], "FAULT_STEP": str(fault[1])})
    command = [sys.executable, *program, "gemma", *FAST, "--method", method, *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def learning_flags(files, out) -> list:
    data, reward_file = files
    return ["--data", data, "--reward", f"{reward_file}:starts_with_the", "--max-steps", "12", "--output", out]


@pytest.fixture(scope="module")
def learned(files, tmp_path_factory):
    """12 steps of 4 prompts, 8 completions each, on a learnable reward (the completion opens with "The")."""
    out = tmp_path_factory.mktemp("learned") / "run"
    done = grpo(*learning_flags(files, out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "metrics.json").read_text()), done.stdout


@pytest.mark.backend_neutral  # the metrics are Python; GRPO's training: the tests below, every backend
def test_a_reward_function_that_gives_none_for_every_completion_leaves_its_metrics_empty(files, tmp_path):
    """TRL's reward functions may return None for a completion they do not score; one that does for all of them
    left NaN in the step's metrics, which the checkpoint could not write (exit 1). Its metrics are now empty."""
    data, reward_file = files
    out = tmp_path / "run"
    done = grpo("--data", data, "--reward", f"{reward_file}:none_at_all", "--max-steps", "1", "--output", out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with (out / "history.csv").open() as f:
        step = next(r for r in csv.DictReader(f) if r["train_loss"])
    assert step["reward_none_at_all"] == "" and step["completion_length"] != ""
    assert json.loads((out / "metrics.json").read_text())["train_reward"] is None
    assert float(step["skipped"]) > 0  # what it gave log_metric: kept by name


@pytest.mark.backend_neutral  # the guard is Python over metrics; GRPO's training: the tests below, every backend
def test_a_held_out_reward_that_stays_the_same_does_not_call_a_trained_adapter_unchanged(files, tmp_path):
    """GRPO's held-out score is a mean reward of sampled text, which can stay the same while the adapter moves: the
    same score before and after is no evidence (Method.held_out_moves), and the moved B factors say it changed."""
    data, reward_file = files
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": f"Held out: tell me about {s}."} for s in SUBJECTS[:4]])
    out = tmp_path / "run"
    done = grpo("--data", data, "--eval-data", held, "--reward", f"{reward_file}:the_but_held_out_the_same",
                "--eval-fraction", "0", "--max-steps", "2", "--output", out)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_reward"] == metrics["eval_reward_before"] == 0.5, metrics
    assert metrics["adapter_changed"] is True, metrics["adapter_changed_why"]


def test_grpo_learns_from_the_command_line(learned):
    """A fresh process: the reward rises on the held-out prompts; the reward function got the records' `answer`
    column (it checks each against its prompt); the rollouts' rewards and lengths and the view's KL and clip
    ratios reach history.csv, the held-out reward before and after metrics.json."""
    out, metrics, stdout = learned
    assert metrics["method"] == "grpo" and metrics["loss_type"] == "dapo"
    # 16 held-out prompts, one completion each: 0.2-0.4 before, 0.9-1.0 after 12 steps on every backend.
    assert metrics["eval_reward"] >= metrics["eval_reward_before"] + 0.3, metrics
    header = (out / "history.csv").read_text().splitlines()[0].split(",")
    for name in ("reward", "reward_std", "reward_starts_with_the", "frac_reward_zero_std", "completion_length",
                 "completion_length_max", "completion_clipped", "kl", "clip_ratio_region", "entropy", "eval_reward"):  # fmt: skip
        assert name in header
    assert "rollout 12: reward" in stdout and "scored alike" not in stdout


def test_eval_generate_of_a_grpo_run_is_refused_and_its_data_must_be_prompts(learned, tmp_path):
    """Its prompts have no reference answers for ROUGE-L (it scored 0 every time), and records with answers are
    not what it scores (a mean reward of 1.0 on them)."""
    out, _, _ = learned
    refused = invoke("eval", "--run", out, "--generate", "1")
    assert refused.exit_code == 2 and "no reference answers for --generate" in refused.stderr, refused.output
    answers = write_jsonl(tmp_path / "answers.jsonl", [{"text": "a b c", "label": "good"}])
    refused = invoke("eval", "--run", out, "--data", answers)
    assert refused.exit_code == 2 and "the run is grpo, which takes prompts alone" in refused.stderr, refused.output


def history(out) -> list[dict]:
    with (out / "history.csv").open() as f:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]


def resume(out) -> subprocess.CompletedProcess:
    """`finetune gemma --resume --output OUT` alone, in a fresh process; it must exit 0."""
    resumed = subprocess.run([sys.executable, "-m", "finetune", "gemma", "--resume", "--output", str(out)],
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    return resumed


def killed_and_resumed(launch, out, step: int, *flags, kept: bool = False) -> subprocess.CompletedProcess:
    """`launch(*flags)` (grpo, or another method's launcher), its run in `out` SIGKILLed right after the step-`step`
    checkpoint, then resumed alone; the resume's process. kept: the checkpoint must keep its batch of rollouts
    (order.npz: killed within a batch that --num-iterations trains on)."""
    killed = launch(*flags, fault=("SIGKILL", step))
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert (checkpoint.latest(out).path / checkpoint.ORDER).is_file() == kept
    return resume(out)


def guide_run(method: str, folder) -> Path:
    """docs/rl.md's first command of --method `method`, as written, run in `folder` holding a copy of the
    repository's examples/; the run's directory."""
    guide = (Path(__file__).parent.parent / "docs" / "rl.md").read_text()
    start = f"finetune gemma --preset tiny --method {method} "
    (command,) = [line for line in guide.splitlines() if line.startswith(start)]
    shutil.copytree(Path(__file__).parent.parent / "examples", folder / "examples")
    done = subprocess.run([sys.executable, "-m", "finetune", *shlex.split(command, comments=True)[1:]], cwd=folder,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder / "runs" / method


def assert_same_run(whole, out) -> None:
    """The run in `out` has the history.csv and adapter of the run in `whole`, within 1e-5. TensorFlow's oneDNN
    kernels may sum in another order in another process: Adam turns that float noise in a near-zero gradient into
    ~1e-5 of an update."""
    expected, got = history(whole), history(out)
    assert [r.keys() for r in got] == [r.keys() for r in expected]
    for a, b in zip(got, expected):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5), (a, b)
    first, second = adapter_arrays(whole / "adapter.lora.h5"), adapter_arrays(out / "adapter.lora.h5")
    assert first.keys() == second.keys() and len(first) > 1
    for name in first:
        np.testing.assert_allclose(second[name], first[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_killed_grpo_run_resumes_to_the_uninterrupted_history_and_adapter(files, learned, tmp_path):
    """SIGKILL right after the step-4 checkpoint, then --resume alone: the rollouts are sampled again from the
    restored adapter with the same seeds, so history.csv and the adapter are the uninterrupted run's."""
    whole, metrics, _ = learned
    out = tmp_path / "killed"
    resumed = killed_and_resumed(grpo, out, 4, *learning_flags(files, out), "--checkpoint-every", "4")
    assert "resuming" in resumed.stdout and "rollout 5: reward" in resumed.stdout
    assert_same_run(whole, out)
    again = json.loads((out / "metrics.json").read_text())
    assert again["eval_reward"] == pytest.approx(metrics["eval_reward"], abs=1e-6)
    assert again["eval_reward_before"] == metrics["eval_reward_before"]


def test_eval_and_export_of_a_grpo_run(learned, tmp_path):
    """`finetune eval` samples the held-out prompts as the run did: its reward is metrics.json's; the Python API
    gives the same. The adapter exports as any run's."""
    out, metrics, _ = learned
    evaluated = invoke("eval", "--run", out)
    assert evaluated.exit_code == 0, evaluated.output
    assert f"eval_reward {metrics['eval_reward']:.4f}" in evaluated.output, evaluated.output
    assert f"eval_accuracy {metrics['eval_accuracy']:.4f}" in evaluated.output, evaluated.output  # as docs/rl.md says
    assert finetune.evaluate(out)["reward"] == pytest.approx(metrics["eval_reward"], abs=1e-6)
    for fmt, written in [("peft", "adapter_config.json"), ("merged", "config.json")]:
        exported = invoke("export", "--run", out, "--format", fmt, "--output", tmp_path / fmt)
        assert exported.exit_code == 0, exported.output
        assert (tmp_path / fmt / written).is_file()


@pytest.mark.one_backend
def test_prompts_answered_by_rote_are_named_as_the_reason_nothing_is_learned(files, tmp_path):
    """The shipped sample's prompts, which the tiny preset learned by heart: at temperature 1 each prompt's
    completions are alike, so every advantage is 0 and the run learns nothing (how issue 35's first runs went:
    held-out reward 0.25 before and after); the log says why."""
    _, reward_file = files
    data = write_jsonl(tmp_path / "sample.jsonl", sample_prompts())
    done = grpo("--data", data, "--reward", f"{reward_file}:opens_with_the", "--max-steps", "2", "--eval-fraction",
                "0", "--output", tmp_path / "run")  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "100% of prompts without advantage" in done.stdout
    assert done.stdout.count("completions scored alike, so every advantage is 0") == 1, done.stdout


BAD_AT_THE_THIRD_CALL = """
CALLS = []


def judge(prompts, completions, **columns):
    CALLS.append(1)
    if len(CALLS) == 3:
        {bad}
    return [float(c.strip().startswith("The")) for c in completions]
"""


@pytest.mark.one_backend  # the checks are Python's; the checkpoints' own tests run on every backend
@pytest.mark.parametrize("bad, said", [("raise RuntimeError('no judge today')", "raised RuntimeError: no judge today"),
                                       ("return [1.0]", "returned 1 values for 32 completions"),
                                       ("return [float('nan')] * len(completions)", "returned nan, not a finite number or None")])  # fmt: skip
def test_a_bad_reward_mid_run_exits_2_naming_it_and_the_prompt_and_keeps_the_last_checkpoint(files, tmp_path, bad,
                                                                                             said):  # fmt: skip
    """The third batch of rollouts (step 3) goes wrong: exit 2 naming the function, the step and a prompt of the
    batch; the step-2 checkpoint is kept, and with the function fixed --resume trains on to the end."""
    data, _ = files
    reward_file = tmp_path / "judge.py"
    reward_file.write_text(BAD_AT_THE_THIRD_CALL.format(bad=bad))
    out = tmp_path / "run"
    done = grpo("--data", data, "--reward", f"{reward_file}:judge", "--max-steps", "4", "--eval-fraction", "0",
                "--checkpoint-every", "1", "--output", out)  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    prompts = {r["prompt"] for r in story_prompts()}
    message = done.stderr
    assert f"the reward function judge {said}, at step 3, on the prompt '" in message, message
    assert message.split("on the prompt '")[1].split("'")[0] in prompts, message
    assert "the checkpoint at step 2 is kept: fix the cause and rerun with --resume" in message, message
    assert [c.step for c in checkpoint.find(out)] == [1, 2] and not (out / "metrics.json").exists()
    described = runs.describe(out)  # `finetune runs`' row
    assert described["state"] == "failed" and "last checkpoint step 2" in described["note"], described
    if "raise" in bad:
        reward_file.write_text(BAD_AT_THE_THIRD_CALL.format(bad="pass"))
        other = invoke("gemma", "--resume", "--num-generations", "4", "--output", out)
        assert other.exit_code == 2 and "train.num_generations=8" in other.output, other.output
        other = invoke("gemma", "--resume", "--reward", "length", "--output", out)  # its rewards would not compare
        assert other.exit_code == 2 and "train.reward=[" in other.output, other.output
        # --packing off is what GRPO's rows were (auto left them unpacked): the same run, resumed
        resumed = subprocess.run([sys.executable, "-m", "finetune", "gemma", "--resume", "--packing", "off", "--output",
                                  str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
        assert json.loads((out / "metrics.json").read_text())["steps"] == 4


@pytest.mark.one_backend
def test_a_reward_that_fails_on_the_held_out_prompts_before_training_leaves_nothing(files, tmp_path):
    data, reward_file = files
    done = grpo("--data", data, "--reward", f"{reward_file}:broken", "--max-steps", "2", "--output", tmp_path / "r")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "broken raised RuntimeError: no judge today, scoring the held-out prompts, on the prompt" in done.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.one_backend  # rl.md marks it slow for test_docs, naming this test
def test_the_rl_guide_s_first_run_learns_as_it_says(tmp_path):
    """docs/rl.md's first command, as written, from a directory holding the repository's examples/: the held-out
    reward rises as the guide says (0.2–0.4 to 0.9–1.0)."""
    out = guide_run("grpo", tmp_path)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_reward_before"] <= 0.4 and metrics["eval_reward"] >= 0.8, metrics
    assert metrics["eval_reward"] - metrics["eval_reward_before"] >= 0.4, metrics
    # samples.md: each greedy generation with its rewards, before and after; no empty reference for prompts alone
    samples = (out / "samples.md").read_text()
    assert "**Reference**" not in samples
    scored = re.findall(r"reward (\d\.\d{3}) \(opens_with_the (\d\.\d{3})\)", samples)
    assert len(scored) == 2 * samples.count("## Sample") > 0, samples[:2000]
    assert all(total == each for total, each in scored) and {"0.000", "1.000"} >= {t for t, _ in scored}


def test_a_run_killed_within_a_batch_of_rollouts_resumes_to_the_uninterrupted_run(files, tmp_path):
    """--num-iterations 2 trains each batch of rollouts two steps, scored when sampled and under the base (--beta);
    killed after step 1, the checkpoint kept step 2's batch (order.npz), and the resumed run trains on it as the
    uninterrupted run did: the same history and adapter."""
    data, reward_file = files
    flags = ["--data", data, "--reward", f"{reward_file}:opens_with_the", "--num-iterations", "2", "--beta", "0.04",
             "--max-steps", "4", "--eval-fraction", "0", "--checkpoint-every", "1"]  # fmt: skip
    whole = tmp_path / "whole"
    done = grpo(*flags, "--output", whole)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = tmp_path / "run"
    resumed = killed_and_resumed(grpo, out, 1, *flags, "--output", out, kept=True)
    assert "sampled again" not in resumed.stdout and "rollout 2: reward" in resumed.stdout
    assert "rollout 1: reward" not in resumed.stdout  # step 2 trained on step 1's batch, kept
    got = history(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4] and all(r["kl"] >= 0 for r in got)
    assert_same_run(whole, out)


@pytest.mark.one_backend  # the sampler itself is checked on every family and backend in test_rollouts.py
@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-gemma4"])
def test_grpo_trains_the_newer_families_from_the_command_line(files, tmp_path, preset):
    """Gemma 3's and 4's generate steps return `images` None for text, which keras-hub's generate could not
    gather from a model without its preprocessor: every rollout stopped with 'Invalid dtype: object' (exit 1)."""
    data, reward_file = files
    out = tmp_path / "run"
    command = [sys.executable, "-m", "finetune", "gemma", *FAST, "--preset", preset, "--method", "grpo", "--data",
               data, "--reward", f"{reward_file}:starts_with_the", "--max-steps", "2", "--output", out]  # fmt: skip
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rollout 2: reward" in done.stdout and json.loads((out / "metrics.json").read_text())["steps"] == 2


@pytest.mark.one_backend  # the prompts are rendered in Python before any rollout
def test_text_prompts_with_held_out_prompts_as_messages_are_refused_before_anything_is_written(files, tmp_path):
    """The template auto picks for text prompts (none) read a message list as its first user text, system turn and
    all dropped: the held-out rewards would score other prompts than those the run trains on."""
    data, _ = files
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": f"Tell me about {s}."}],
                                                  "answer": s} for s in SUBJECTS[:4]])  # fmt: skip
    out = tmp_path / "run"
    refused = invoke("gemma", *FAST, "--method", "grpo", "--reward", "length", "--data", data, "--eval-data", chat, "--eval-fraction", "0",
                     "--max-steps", "1", "--output", out)  # fmt: skip
    assert refused.exit_code == 2, refused.output
    assert (
        "a prompt given as messages needs a chat template" in refused.stderr and "the run's is none" in refused.stderr
    )
    assert not out.exists()


@pytest.mark.backend_neutral  # the sampler with pictures: test_rollouts.py, on every backend
@pytest.mark.parametrize("preset", ["tiny-gemma3-vision", "tiny-gemma3n-vision"])
def test_grpo_learns_from_prompts_with_pictures(tmp_path, preset):
    """Prompts with pictures, as SFT's records hold them, on Gemma 3 and 3n: the rollouts see each prompt's picture
    (the sampler: test_rollouts.py, every backend) and train on it."""
    from test_images import square, write_lines

    reward_file = tmp_path / "rewards.py"
    reward_file.write_text(
        "def chars(prompts, completions, **columns):\n    return [float(len(c)) for c in completions]\n"
    )
    colours = ["red", "green", "blue"]
    lines = [{"prompt": "<image>Tell a story about this colour.", "images": [square(tmp_path / f"{i}.png", c)],
              "answer": c} for i, c in enumerate(colours * 4)]  # fmt: skip
    lines[1::4] = [{"prompt": "Tell a story about a colour.", "answer": "none"}] * 3  # text prompts beside them
    data, out = write_lines(tmp_path / "prompts.jsonl", lines), tmp_path / "run"
    done = grpo("--preset", preset, "--seq-len", "320", "--data", data, "--reward", f"{reward_file}:chars",
                "--max-steps", "2", "--output", out)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["adapter_changed"], metrics
    assert "rollout 2: reward" in done.stdout
