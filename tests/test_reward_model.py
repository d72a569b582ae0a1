"""--method reward end to end (methods/reward.py, model/reward_view.py, model/score_head.py): a reward model learns a
preference from the command line in a fresh process, `finetune eval` reports its accuracy, a GRPO run takes it as
its reward (`--reward run:DIR`) and gets the model's own scores; its loss is TRL's RewardTrainer's; the refusals.

The pairs are learnable by the tiny model: the chosen answer holds the word "thanks" somewhere among three random
words, the rejected answer three random words without it.
"""

import csv
import json
import random
import subprocess
import sys
import types

import numpy as np
import pytest
from conftest import BACKEND, invoke, write_jsonl

from finetune.methods import reward

WORDS = ["apple", "river", "stone", "cloud", "green", "music", "paper", "light", "table", "glass"]
MARKER = "thanks"


def marked_pairs(n=96, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        chosen, rejected = [rng.choice(WORDS) for _ in range(3)], [rng.choice(WORDS) for _ in range(3)]
        chosen.insert(rng.randint(0, 3), MARKER)
        out.append({"prompt": f"Tell me about {rng.choice(WORDS)}.", "chosen": " ".join(chosen),
                    "rejected": " ".join(rejected)})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory):
    """`finetune gemma --method reward` as typed, in a fresh process: float32, 40 steps of 4 pairs, a quarter of
    the 96 pairs held out."""
    root = tmp_path_factory.mktemp("reward")
    data = write_jsonl(root / "pairs.jsonl", marked_pairs())
    out = root / "run"
    args = [sys.executable, "-m", "finetune", "gemma", "--preset", "tiny", "--backend", BACKEND, "--precision",
            "float32", "--method", "reward", "--data", str(data), "--seq-len", "32", "--batch-size", "4",
            "--max-steps", "40", "--lr", "1e-2", "--eval-fraction", "0.25", "--output", str(out)]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "metrics.json").read_text()), done.stdout


def test_a_reward_model_learns_a_preference_from_the_command_line(reward_run):
    """Held-out pair accuracy near chance before training, above 0.75 after; TRL's metrics in history.csv and
    metrics.json; the head beside the adapter; no samples generated (a reward model writes no text)."""
    out, metrics, stdout = reward_run
    assert metrics["method"] == "reward" and metrics["center_rewards"] == 0.0 and metrics["eval_examples"] == 24
    assert metrics["eval_accuracy"] > 0.75 and metrics["eval_accuracy"] > metrics["eval_accuracy_before"]
    assert metrics["eval_loss"] < metrics["eval_loss_before"]
    assert metrics["eval_margin"] > metrics["eval_margin_before"]
    assert "eval accuracy" in stdout and "eval margin" in stdout
    with (out / "history.csv").open() as f:
        rows = list(csv.DictReader(f))
    for name in ("accuracy", "margin", "rewards_chosen", "rewards_rejected", "eval_accuracy", "eval_margin"):
        assert name in rows[0], name
    assert metrics["accuracy"] is not None and metrics["margin"] is not None
    head = np.load(out / reward.HEAD)["kernel"]
    assert head.shape == (128, 1) and np.isfinite(head).all()  # the tiny preset's hidden size
    adapter = json.loads((out / "adapter.json").read_text())["adapted"]
    lora = sum(np.prod(entry[name]) for entry in adapter for name in ("lora_kernel_a", "lora_kernel_b"))
    assert metrics["trainable_parameters"] == lora + 128
    assert "generating" not in stdout


def test_finetune_eval_of_a_reward_run_reports_its_accuracy(reward_run):
    out, metrics, _ = reward_run
    evaluated = invoke("eval", "--run", out)
    assert evaluated.exit_code == 0, evaluated.output
    assert f"eval_accuracy {metrics['eval_accuracy']:.4f}" in evaluated.output
    assert f"eval_margin {metrics['eval_margin']:.4f}" in evaluated.output and "pairs 24" in evaluated.output


def direct_scores(run_dir, prompts, completions) -> list[float]:
    """The reward run's scores, made here without its pairs, rows or view: the run's base and adapter as
    `finetune eval` loads them, `<bos> prompt completion` tokenized part by part, the backbone's last hidden state
    times the head's kernel."""
    from keras import ops

    from finetune.training import runs

    run = runs.open_on(run_dir)
    lm, preprocessor = runs.load_model(run)
    kernel = np.load(run_dir / reward.HEAD)["kernel"]
    tokenizer = preprocessor.tokenizer
    out = []
    for prompt, completion in zip(prompts, completions):
        ids = [2] + [int(i) for i in tokenizer.tokenize(prompt)] + [int(i) for i in tokenizer.tokenize(completion)]
        x = {"token_ids": np.array([ids], np.int32), "padding_mask": np.ones((1, len(ids)), np.int32)}
        hidden = np.asarray(ops.convert_to_numpy(lm.backbone(x)), np.float64)
        out.append(float(hidden[0, -1] @ kernel[:, 0]))
    return out


def test_a_grpo_run_takes_the_reward_model_as_its_reward(reward_run, tmp_path, monkeypatch):
    """`--reward run:DIR`: two GRPO steps train, and every reward is the reward model's score of the prompt and
    the completion, as scored here directly; the rollouts' mean reward in history.csv is theirs."""
    out, _, _ = reward_run
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Tell me about {w}."} for w in WORDS[:8]])
    calls = []
    scores = reward.RewardRun.scores

    def recorded(self, prompts, completions):
        values = scores(self, prompts, completions)
        calls.append((list(prompts), list(completions), values))
        return values

    monkeypatch.setattr(reward.RewardRun, "scores", recorded)
    grpo = tmp_path / "grpo"
    result = invoke("gemma", "--preset", "tiny", "--backend", BACKEND, "--precision", "float32", "--method", "grpo",
                    "--data", prompts, "--reward", f"run:{out}", "--num-generations", "4",
                    "--max-completion-length", "4", "--seq-len", "32", "--batch-size", "2", "--max-steps", "2",
                    "--set", "train.samples=0", "--output", grpo)  # fmt: skip
    assert result.exit_code == 0, result.output
    with (grpo / "history.csv").open() as f:
        rollouts = [r for r in csv.DictReader(f) if r["train_loss"]]
    trained = [call for call in calls if len(call[2]) == 8]  # 2 prompts x 4 completions a step
    assert len(rollouts) == 2 and len(trained) == 2
    for row, (_, _, values) in zip(rollouts, trained):
        assert float(row["reward_reward_model"]) == pytest.approx(np.mean(values), abs=1e-6)
    texts, completions, values = trained[-1]
    assert values == pytest.approx(direct_scores(out, texts, completions), abs=1e-4)
    assert len(set(np.round(values, 4))) > 1  # the completions score apart
    # Prompts as messages: this reward model, trained on text pairs, could score none of them (it failed at the
    # first rollout, naming the GRPO run's template); refused before anything is written, naming its own.
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": f"Tell me about {w}."}]}
                                                 for w in WORDS[:8]])  # fmt: skip
    refused = invoke("gemma", "--preset", "tiny", "--backend", BACKEND, "--method", "grpo", "--data", chat, "--reward",
                     f"run:{out}", "--max-completion-length", "4", "--seq-len", "32", "--max-steps", "1", "--output",
                     tmp_path / "chat-run")  # fmt: skip
    assert refused.exit_code == 2 and "the reward model was trained on text pairs" in refused.stderr, refused.output
    assert not (tmp_path / "chat-run").exists()


@pytest.mark.backend_neutral  # the recipe is Python; quantized layers on every backend: test_quantized.py
def test_a_quantized_reward_model_scores_grpo_s_completions_on_its_quantized_base(tmp_path):
    """A reward model trained on an int8 base scores GRPO's completions on that base (resolve.adapter_recipe, as
    `finetune eval` builds it), not on a float one its adapter and head never saw."""
    data = write_jsonl(tmp_path / "pairs.jsonl", marked_pairs(24))
    out = tmp_path / "run"
    args = [sys.executable, "-m", "finetune", "gemma", "--preset", "tiny", "--backend", BACKEND, "--precision",
            "float32", "--quantize", "int8", "--method", "reward", "--data", str(data), "--seq-len", "32",
            "--batch-size", "4", "--max-steps", "6", "--lr", "1e-2", "--set", "train.samples=0",
            "--output", str(out)]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    prompts = [f"Tell me about {w}." for w in WORDS[:4]]
    completions = ["thanks apple river", "stone cloud green", "music thanks paper", "light table glass"]
    scored = reward.RewardRun.opened(f"run:{out}").scores(prompts, completions)
    assert scored == pytest.approx(direct_scores(out, prompts, completions), abs=1e-4)


@pytest.mark.backend_neutral  # the reward run above trained on every backend; this reads its files
def test_the_reward_model_scores_a_conversational_prompt_in_its_chat_template(reward_run, tmp_path):
    """A prompt of messages (TRL's conversational prompt form) and a completion message are scored in a chat
    template's turns; a model trained without one refuses them, naming the template."""
    import shutil

    import yaml

    out, _, _ = reward_run
    messages = [[{"role": "user", "content": "Tell me about apple."}]] * 2
    said = [[{"role": "assistant", "content": "apple thanks river"}], [{"role": "assistant", "content": ""}]]
    with pytest.raises(reward.UserError, match="chat records .* not none"):
        reward.RewardRun.opened(f"run:{out}")(prompts=messages, completions=said)
    chat = tmp_path / "chat"
    shutil.copytree(out, chat)
    config = yaml.safe_load((chat / "config.yaml").read_text())
    config["data"]["template"] = "gemma-chat"
    (chat / "config.yaml").write_text(yaml.safe_dump(config))
    values = reward.RewardRun.opened(f"run:{chat}")(prompts=messages, completions=said)
    assert len(values) == 2 and all(np.isfinite(values)) and values[0] != values[1]


# === The loss, against TRL's RewardTrainer ===


class _Accelerator:
    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


@pytest.mark.backend_neutral  # keras ops on numpy rewards; the views run on every backend above
@pytest.mark.parametrize("center", [None, 0.01])
def test_the_loss_is_trl_s_reward_trainer_s(center):
    """TRL 1.16's RewardTrainer.compute_loss on rewards a stub model returns, against reward_view.pair_values on
    the same rewards: the loss (with and without center_rewards_coefficient), the accuracy and the margin."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    from trl.trainer.reward_trainer import RewardTrainer

    from finetune.model import reward_view

    rng = np.random.default_rng(0)
    rewards = rng.normal(0, 2, 16).astype(np.float32)  # 8 pairs: the chosen rows, then the rejected
    trainer = object.__new__(RewardTrainer)
    settings = dict(model=types.SimpleNamespace(training=True), accelerator=_Accelerator(), _tp_size=1,
                    _total_train_tokens=0, args=types.SimpleNamespace(center_rewards_coefficient=center),
                    _metrics={"train": __import__("collections").defaultdict(list)})  # fmt: skip
    for name, value in settings.items():
        object.__setattr__(trainer, name, value)

    def model(**inputs):
        return types.SimpleNamespace(logits=torch.tensor(rewards)[:, None])

    inputs = {"input_ids": torch.zeros((16, 3), dtype=torch.long), "attention_mask": torch.ones((16, 3))}
    theirs = float(trainer.compute_loss(model, inputs))
    from keras import ops

    values = ops.convert_to_numpy(reward_view.pair_values(ops.convert_to_tensor(rewards), center or 0.0))
    values = np.asarray(values, np.float64)
    assert values[:, 0].mean() == pytest.approx(theirs, rel=1e-6)
    assert values[:, 3].mean() == pytest.approx(trainer._metrics["train"]["accuracy"][0], abs=1e-7)
    assert values[:, 4].mean() == pytest.approx(trainer._metrics["train"]["margin"][0], rel=1e-6)
    assert values.shape == (8, len(reward_view.COLUMNS) + 2) and not values[:, 5:].any()


# === Refusals: exit 2, nothing written ===


@pytest.mark.backend_neutral
def test_prompts_alone_are_refused_for_a_reward_model(tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Tell me about apple."}] * 8)
    result = invoke("gemma", "--preset", "tiny", "--method", "reward", "--data", prompts, "--output", tmp_path / "r")
    assert result.exit_code == 2 and "prompts alone" in result.output, result.output
    assert not (tmp_path / "r").exists()


@pytest.mark.backend_neutral
def test_center_rewards_is_the_reward_model_s_alone(tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", marked_pairs(8))
    result = invoke("gemma", "--preset", "tiny", "--method", "dpo", "--data", pairs, "--center-rewards", "0.01",
                    "--output", tmp_path / "r")  # fmt: skip
    assert result.exit_code == 2 and "--center-rewards is reward model's" in result.output, result.output
    assert not (tmp_path / "r").exists()


@pytest.mark.backend_neutral
@pytest.mark.parametrize("which", ["missing", "not a run", "another method", "no head"])
def test_a_grpo_reward_that_names_no_reward_model_is_refused(which, reward_run, tmp_path):
    import shutil

    import yaml

    out, _, _ = reward_run
    target, said = tmp_path / "target", {
        "missing": "does not exist", "not a run": "has no config.yaml", "another method": "is a --method sft run",
        "no head": f"has no {reward.HEAD}",
    }[which]  # fmt: skip
    if which == "not a run":
        target.mkdir()
    elif which != "missing":
        shutil.copytree(out, target)
    if which == "another method":
        config = yaml.safe_load((target / "config.yaml").read_text())
        config["train"]["method"] = "sft"
        (target / "config.yaml").write_text(yaml.safe_dump(config))
    if which == "no head":
        (target / reward.HEAD).unlink()
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Tell me about apple."}] * 8)
    result = invoke("gemma", "--preset", "tiny", "--method", "grpo", "--data", prompts, "--reward", f"run:{target}",
                    "--max-completion-length", "8", "--output", tmp_path / "g")  # fmt: skip
    assert result.exit_code == 2 and said in result.output, result.output
    assert not (tmp_path / "g").exists()


@pytest.mark.backend_neutral
@pytest.mark.parametrize("command", [["generate", "--prompt", "Tell me about apple."],
                                     ["export", "--format", "peft", "--output", "{tmp}/peft"]])  # fmt: skip
def test_generate_and_export_of_a_reward_model_are_refused(command, reward_run, tmp_path):
    """Its LoRA adapter alone would be a language model that learned to score, without the head that scores."""
    out, _, _ = reward_run
    result = invoke(command[0], "--run", out, *[a.format(tmp=tmp_path) for a in command[1:]])
    assert result.exit_code == 2 and "scores text and writes none" in result.output, result.output
    assert not (tmp_path / "peft").exists()


@pytest.mark.one_backend
def test_the_adapter_name_is_the_run_directory_s():
    from finetune.training import outputs

    assert reward.ADAPTER == outputs.ADAPTER and reward.HEAD in outputs.OWN_NAMES


@pytest.mark.skipif(BACKEND != "torch", reason="transformers and PEFT are checked in the PyTorch suite")
def test_the_hf_export_is_transformers_one_label_classifier_scoring_as_the_run(reward_run, tmp_path):
    """`finetune export --format hf` of a reward model: transformers' GemmaForSequenceClassification of one label
    (as TRL's reward models load), whose score of a prompt and answer is the run's (`--reward run:DIR`'s)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from finetune.data import formats, pairs, templates

    out, _, _ = reward_run
    exported = tmp_path / "hf"
    result = invoke("export", "--run", out, "--format", "hf", "--output", exported, "--backend", BACKEND)
    assert result.exit_code == 0, result.output
    model = transformers.AutoModelForSequenceClassification.from_pretrained(exported, dtype=torch.float32)
    assert model.config.num_labels == 1 and model.config.id2label == {0: "LABEL_0"}
    scorer = reward.RewardRun.opened(f"run:{out}")
    held = marked_pairs(4, seed=1)
    prompts, answers = [p["prompt"] for p in held] * 2, [p["chosen"] for p in held] + [p["rejected"] for p in held]
    ours = scorer.scores(prompts, answers)
    records = [formats.answered(p, a) for p, a in zip(prompts, answers)]
    made, _ = pairs.pairs(records, templates.get(scorer.cfg.data.template), scorer.tokenizer, 32)
    rows = [pair.chosen.token_ids[:-1] for pair in made]  # the inputs: the last id is the last input's label
    width = max(map(len, rows))
    pad = model.config.pad_token_id
    ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    with torch.no_grad():
        theirs = model(input_ids=ids, attention_mask=(ids != pad).long()).logits[:, 0].numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)
    assert np.mean(theirs[:4] > theirs[4:]) >= 0.75  # it prefers the marked answers, as it learned
