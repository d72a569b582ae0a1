"""A reward model (--method reward): LoRA on the body and a score head trained in full on preference pairs, with
TRL's RewardTrainer's Bradley-Terry loss; and a trained one loaded as a GRPO reward (--reward run:DIR).

The pairs, their rows, packing and order are the preference methods' (preference.py): the same records, two
sequences a pair. model/reward_view.py scores each sequence at its last token with a ScoreHead of one output
(model/score_head.py) and trains -log sigmoid(r_chosen - r_rejected). Held out, a run reports the share of pairs
whose chosen answer scores higher (accuracy) and the mean margin. The head's weights are the view's, so
checkpoints keep them; a finished run writes them beside its adapter (HEAD), and `finetune eval` and GRPO's
`--reward run:DIR` read them back.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from finetune import config as config_module
from finetune.data import batching, formats, pair_batches, pairs, templates
from finetune.methods import preference
from finetune.platform.errors import UserError

HEAD = "score_head.npz"
"""The head's weights, beside the adapter in a finished run's directory: `kernel`, (hidden, 1) float32."""
ADAPTER = "adapter.lora.h5"  # training/outputs.ADAPTER, which this layer cannot import (tests/test_reward_model.py)
TOKEN_ROWS = "adapter.tokens.npy"  # training/outputs.TOKEN_ROWS: --add-tokens' rows


class RewardModel(preference.Preference):
    """The reward model: a preference method whose objective is reward_view's, not a log-probability's."""

    held_out = ("accuracy", "margin")
    held_out_history = ("margin",)
    generates = False
    files = (HEAD,)
    head = HEAD
    why = "set"
    uses = "give it to GRPO as --reward run:DIR"

    def head_labels(self, train) -> list[str]:
        return ["LABEL_0"]  # transformers' name for a one-label head, as TRL's reward models load

    def __init__(self):
        super().__init__("reward", "reward model", None, defaults={
            "center_rewards": (0.0, "TRL's RewardConfig: none (its center_rewards_coefficient)"),
        })  # fmt: skip

    def objective(self, train):
        from finetune.model import reward_view  # keras: imported once the backend is chosen

        center = getattr(train, "center_rewards", None)
        return reward_view.Objective(center or 0.0, getattr(train, "seed", 0))

    # === Score ===

    def held_out_scores(self, model, rows, batch_size: int, feed, shards: int = 1):
        batches = pair_batches.Batches(rows, batch_size, feed)
        return lambda after_batch=None: reward_metrics(model.trainer, batches, after_batch)

    def evaluate(self, lm, cfg, rows, directory=None) -> dict:
        """The held-out accuracy and margin of the run in `directory` (its adapter in `lm`, its head read here)."""
        from finetune.model import builder

        view = builder.objective_view(lm, self.objective(cfg.train))
        load_head(view.head, Path(directory) / HEAD)
        batches = pair_batches.Batches(rows, cfg.train.batch_size, batching.Feed(inputs=builder.input_names(lm)))
        return reward_metrics(view, batches)

    def run_metrics(self, train, rows: list) -> dict:
        from finetune.model import reward_view

        last = next((row for row in reversed(rows) if "rewards_chosen" in row), {})
        return {"method": self.name, "center_rewards": train.center_rewards or 0.0,
                **{name: last.get(name) for name in reward_view.METRICS}}  # fmt: skip

    def published(self, trainer) -> dict:
        return {HEAD: lambda path: save_head(trainer.head, path)}

    # === Plan ===

    def plan_note(self, cfg, packed: bool = False) -> str | None:
        return (f"--method reward: each pair is two sequences{' (packed: --batch-size counts rows)' if packed else ''}"
                ", scored at their last token by a head of one output: no vocabulary projection")  # fmt: skip


def reward_metrics(view, batches, after_batch=None) -> dict:
    """The mean of each reward_view.COLUMNS over the held-out pairs: loss, rewards, accuracy, margin."""
    from finetune.model import reward_view

    total, count = 0.0, 0
    for indices, values in preference.pair_outputs(view, batches):
        total, count = total + values[:, : len(reward_view.COLUMNS)].sum(axis=0), count + len(indices)
        if after_batch is not None:  # a run's stop check (loop.check_stop)
            after_batch()
    return {name: float(value) for name, value in zip(reward_view.COLUMNS, total / max(count, 1))}


def save_head(head, path: Path) -> None:
    with open(path, "wb") as f:  # a file object: np.savez would add .npz to the temporary name it is given
        np.savez(f, kernel=np.asarray(head.kernel.numpy(), np.float32))


def load_head(head, path: Path) -> None:
    """Assign a finished run's head weights to `head`, refused unless they are finite and of its shape."""
    head.kernel.assign(read_head(path, tuple(head.kernel.shape)))


def read_head(path: Path, shape: tuple) -> np.ndarray:
    """A finished run's score head (a reward model's or a classifier's), refused unless it is readable, finite and
    of `shape` (hidden, outputs): what loading it (`finetune eval`, predict, a GRPO reward) and exporting it check."""
    fix = "copy it back from the run that made it, or retrain the run"
    try:
        with np.load(path, allow_pickle=False) as stored:
            kernel = np.asarray(stored["kernel"], np.float32)
    except (OSError, KeyError, ValueError) as e:
        raise UserError(f"{path} is not a readable score head ({type(e).__name__}); {fix}") from None
    if kernel.shape != tuple(shape) or not np.isfinite(kernel).all():
        raise UserError(f"{path} holds a head of shape {kernel.shape} (finite: {np.isfinite(kernel).all()}), this "
                        f"model's is {tuple(shape)}; {fix}")  # fmt: skip
    return kernel


# === A trained reward model as a GRPO reward: --reward run:DIR ===


class RewardRun:
    """A finished reward-model run, as GRPO's reward function `f(prompts, completions, **columns) -> floats`:
    each completion's reward, the run's score of the prompt and the completion in its template.

    Checked when named (opened); the model is built on the first call, on the backend the GRPO run uses, in the
    precision the reward run trained in, and beside the policy: a second model in the same process, as TRL's
    GRPOTrainer keeps its reward model.
    """

    __name__ = "reward_model"

    def __init__(self, directory: Path, cfg):
        self.directory, self.cfg = directory, cfg
        self.view = self.tokenizer = None

    @classmethod
    def opened(cls, spec: str) -> RewardRun:
        directory = Path(spec.partition(":")[2]).expanduser()
        if not (directory / "config.yaml").is_file():
            what = "does not exist" if not directory.exists() else "has no config.yaml: it is no finished run"
            raise UserError(f"--reward {spec}: {directory} {what}; give run:DIR of a --method reward run")
        cfg = config_module.from_dict(config_module.read_recipe(directory / "config.yaml"))
        if cfg.train.method != "reward":
            raise UserError(f"--reward {spec}: {directory} is a --method {cfg.train.method} run, not a reward model; "
                            "train one with --method reward on preference pairs")  # fmt: skip
        if cfg.model.full:
            raise UserError(f"--reward {spec}: a --full reward model is not read as a GRPO reward yet; train it with "
                            "LoRA (drop --full)")  # fmt: skip
        missing = [name for name in (ADAPTER, HEAD) if not (directory / name).is_file()]
        if missing:
            raise UserError(f"--reward {spec}: {directory} has no {missing[0]}, so it is not a finished reward "
                            "model; finish it (--resume) or give another run")  # fmt: skip
        if cfg.lora.dora:
            raise UserError(f"--reward {spec}: a DoRA reward model is not read as a GRPO reward yet; train it with "
                            "plain LoRA")  # fmt: skip
        return cls(directory, cfg)

    def check_prompts(self, records) -> None:
        """Refuse GRPO prompts given as messages where the reward run's template, fixed when it trained, renders
        text alone: it could score none of their completions."""
        turned = templates.read_as_text(self.cfg.data.template, records)
        if turned is not None:
            raise UserError(f"--reward run:{self.directory}: the reward model was trained on text pairs (its template "
                            f"is {self.cfg.data.template}) and cannot score prompts given as messages "
                            f"({turned.where or 'the data'}); train it on conversational pairs, or give text prompts")  # fmt: skip

    def load(self) -> None:
        """Build the reward run's model (base, its adapter, its head) on the process's backend."""
        import keras

        from finetune.model import builder, presets, tokens
        from finetune.platform import backend

        cfg = self.cfg
        precision = cfg.model.precision if cfg.model.precision in backend.POLICIES else "float32"
        policy = keras.config.dtype_policy()
        keras.config.set_dtype_policy(backend.POLICIES[precision][1])  # its adapter's, as it trained
        try:
            # The model its adapter trained on (--quantize included), as `finetune eval` rebuilds it; text alone, as
            # GRPO's prompts are.
            as_trained = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, precision=precision))
            recipe = dataclasses.replace(builder.adapter_recipe(as_trained), images=False, image_tokens=None)
            model = builder.build_model(presets.resolve(cfg.model.preset), recipe)
            try:
                builder.load_lora_weights(model.lm.backbone, str(self.directory / ADAPTER))
                if model.added is not None:  # its --add-tokens' rows
                    tokens.assign_rows(model.lm.backbone, np.load(self.directory / TOKEN_ROWS, allow_pickle=False))
            except (OSError, KeyError, ValueError) as e:
                raise UserError(f"--reward run:{self.directory}: its adapter does not load ({e}); retrain it") from None
            self.view = builder.objective_view(model.lm, self.objective())
            load_head(self.view.head, self.directory / HEAD)
        finally:
            keras.config.set_dtype_policy(policy)
        self.tokenizer, self.inputs = model.preprocessor.tokenizer, builder.input_names(model.lm)

    def objective(self):
        """The reward run's objective: its view and head, as it trained them."""
        return REWARD.objective(self.cfg.train)

    def scores(self, prompts: list, completions: list) -> list[float]:
        """Each completion's reward: the head's score of its prompt and it, rendered in the reward run's template."""
        if self.view is None:
            self.load()
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        records = [formats.answered(p, t) for p, t in zip(prompts, texts)]
        seq_len = self.cfg.model.seq_len
        made, _ = pairs.pairs(records, templates.get(self.cfg.data.template), self.tokenizer, seq_len)
        arrays = pair_batches.pad(made, seq_len)
        size = self.cfg.train.batch_size if isinstance(self.cfg.train.batch_size, int) else 4
        batches = pair_batches.Batches(arrays, size, batching.Feed(inputs=self.inputs))
        out = np.zeros(len(records))
        for indices, values in preference.pair_outputs(self.view, batches):
            out[indices] = values[:, 1]  # rewards_chosen: both sides are the completion; the chosen one is read
        return out.tolist()

    def __call__(self, prompts, completions, **columns):
        return self.scores(prompts, completions)


REWARD = RewardModel()
