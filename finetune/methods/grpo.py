"""GRPO: online RL on prompts. The model samples completions of each prompt, reward functions score them, and the
clipped policy-gradient objective moves it toward the completions that scored above their group's mean.

Records are prompts alone (TRL's prompt-only form, formats.PROMPT_FORMATS); their
other keys go to the reward functions (rewards.py). The rows come from the
model's own samples (rollouts.py), made by the order as the loop asks for each
step's micro-batches, and model/grpo_view.py trains TRL's per-token loss on them.
The constants, their names and defaults are TRL's GRPOConfig's (docs/rl.md).
The held-out score is the mean reward of one seeded completion of each
held-out prompt.
"""

from __future__ import annotations

from finetune.data import batching, templates
from finetune.methods import prepare, rewards, rollouts
from finetune.methods.method import Method
from finetune.platform.errors import UserError


class GRPO(Method):
    name = "grpo"
    title = "GRPO"
    prompted = True
    sequences_per_example = 8  # --num-generations' default: each prompt is G rows
    why = "set"
    held_out = ("reward", "accuracy")  # the share of prompts whose completion scored above 0
    held_out_history = ("reward",)
    held_out_moves = False  # rewards of sampled text: the same mean says little (Method.held_out_moves)
    loss_named = False  # the negated mean reward: the summary says the reward

    def held_out_words(self, result: dict) -> str:
        # Its held-out loss is the negated mean reward (lower is better for --keep-best): the log says the reward.
        return f"eval reward {result['reward']:.4f}, {result['accuracy']:.0%} of the prompts above 0"

    def better_words(self, best: dict) -> str:
        return f"a higher held-out reward than {best['reward']:.4f}"

    examples = "prompts"
    defaults = {
        "beta": (0.0, "TRL's GRPOConfig: no KL term, so no reference pass"),
        "num_generations": (8, "TRL's GRPOConfig"),
        "max_completion_length": (256, "half of TRL's 512: a LoRA run on one device"),
        "temperature": (1.0, "TRL's GRPOConfig"),
        "top_p": (1.0, "TRL's GRPOConfig"),
        "epsilon": (0.2, "TRL's GRPOConfig"),
        "epsilon_high": (None, "--epsilon's, as TRL's"),
        "num_iterations": (1, "TRL's GRPOConfig"),
        "loss_type": ("dapo", "TRL's GRPOConfig's default"),
        "scale_rewards": ("group", "TRL's GRPOConfig"),
    }

    def decide(self, train) -> dict:
        decided = super().decide(train)
        if decided["epsilon_high"][0] is None:
            decided["epsilon_high"] = (decided["epsilon"][0], "--epsilon's, as TRL's")
        rewards.load(train.reward, train.reward_weights, decided["max_completion_length"][0])  # refused here, early
        decided["reward"] = (list(train.reward), "set")
        return decided

    def refusal(self, cfg) -> str | None:
        train = cfg.train
        refused = rewards.refused(train.reward, train.reward_weights)
        if refused:
            return refused
        rollouts.prompt_room(cfg.model.seq_len, self.constants(train)["max_completion_length"])  # raises
        if train.batch_size == "auto":
            return (f"--method {self.name}: --batch-size counts prompts, each --num-generations rows; give a number "
                    "(auto is not probed for rollouts yet)")  # fmt: skip
        return None

    def unpacked_why(self) -> str | None:
        return f"--method {self.name}: each rollout (a prompt and one completion) is a row of its own"

    def ungrouped_why(self) -> str | None:
        return (f"{self.title} pads every prompt to the widest (its sampler's one compiled shape), so their lengths "
                "set nothing")  # fmt: skip

    def constants(self, train) -> dict:
        """This method's constants as decided (unset ones take their defaults)."""
        out = {name: getattr(train, name, None) for name in self.defaults}
        out = {name: value if value is not None else self.defaults[name][0] for name, value in out.items()}
        out["epsilon_high"] = out["epsilon_high"] if out["epsilon_high"] is not None else out["epsilon"]
        return out

    def scores_base(self, train) -> bool:
        return self.constants(train)["beta"] != 0.0

    def objective(self, train):
        from finetune.model import grpo_view  # keras: imported once the backend is chosen

        c = self.constants(train)
        return grpo_view.Objective(c["beta"], c["epsilon"], c["epsilon_high"], c["temperature"],
                                   fresh=c["num_iterations"] == 1)  # fmt: skip

    # === Prepare ===

    def prepare(self, records, preprocessor, cfg, *, packed=None, probe=None, every_record_of=None):
        """records -> the template's prompt -> ids -> split. The batch size counts prompts."""
        template = templates.get(cfg.data.template)
        tokenizer = prepare.tokenizer_of(preprocessor)
        media = _media(records, preprocessor, cfg, cfg.data.path)
        usable = [(record, None) for record in records]
        train, held_out = prepare.split(usable, cfg, every_record_of)
        sampling = self.sampling(cfg, template, tokenizer)
        rows = rollouts.prompts_of(
            train, template, tokenizer, sampling, cfg.model.seq_len, rollouts.Layout(media=media)
        )
        held_out_rows = rollouts.prompts_of(held_out, template, tokenizer, sampling, cfg.model.seq_len,
                                            rollouts.Layout(rows.ids.shape[1] if train else None, media))  # fmt: skip
        prepared = prepare.Prepared(template, train, held_out, cfg.train.batch_size, held_out_rows, packed=False)
        if packed is not None:
            if not train:
                raise UserError("no training prompts are left once the held-out ones are taken; add prompts")
            prepared.rows = rows
            prepared.padding = {"padding_fraction": None, "unpacked": None}  # the rollouts' own, not known before
        return prepared

    def sampling(self, cfg, template, tokenizer) -> rollouts.Sampling:
        c = self.constants(cfg.train)
        loaded = rewards.load(cfg.train.reward, cfg.train.reward_weights, c["max_completion_length"])
        stop_ids = template.stop_ids(tokenizer)
        batch = cfg.train.batch_size if isinstance(cfg.train.batch_size, int) else 1
        return rollouts.Sampling(c["num_generations"], c["max_completion_length"], c["temperature"], c["top_p"],
                                 cfg.train.seed, tuple(loaded), stop_ids, batch * cfg.train.grad_accum)  # fmt: skip

    def evaluated_on(self, prepared, records, preprocessor, cfg):
        tokenizer = prepare.tokenizer_of(preprocessor)
        pairs = [(record, None) for record in records]
        sampling = self.sampling(cfg, prepared.template, tokenizer)
        prepared.held_out = pairs
        width = prepared.rows.ids.shape[1] if prepared.rows is not None else None
        media = _media(records, preprocessor, cfg, cfg.eval.data or cfg.data.path)
        prepared.held_out_rows = rollouts.prompts_of(pairs, prepared.template, tokenizer, sampling, cfg.model.seq_len,
                                                     rollouts.Layout(width, media))  # fmt: skip
        return prepared

    def order(self, prepared, cfg, feed, model=None):
        if feed.part[1] - feed.part[0] != feed.part[2]:
            raise UserError(f"--method {self.name} samples its rollouts in one process; run it on one host")
        constants = self.constants(cfg.train)
        return self.rollout_order(prepared.rows, prepared.batch_size, cfg, feed, model, constants)

    rollout_order = rollouts.RolloutOrder
    """The order of its rollouts (rollouts.RolloutOrder): how a batch's advantages and loss weights are made."""
    bench_peer = True
    """`finetune bench --recipes hf` has its TRL trainer as a peer (tools/peer_grpo.py: TRL's GRPOTrainer)."""

    # === Score ===

    def held_out_scores(self, model, rows, batch_size: int, feed, shards: int = 1):
        sampler = rollouts.Sampler(model.lm, rows.sampling)
        return lambda after_batch=None: rollouts.held_out_reward(sampler, rows, after_batch)

    def evaluate(self, lm, cfg, rows, directory=None) -> dict:
        return rollouts.held_out_reward(rollouts.Sampler(lm, rows.sampling), rows)

    def sample_scores(self, cfg, samples: list, tokenizer):
        """samples.md's rewards: each greedy generation scored by the run's reward functions, with the records'
        columns, as a rollout is."""
        c = self.constants(cfg.train)
        loaded = rewards.load(cfg.train.reward, cfg.train.reward_weights, c["max_completion_length"])
        keys = sorted({key for record in samples for key in record.columns})
        columns = {key: [record.columns.get(key) for record in samples] for key in keys}
        conversational = bool(samples) and bool(samples[0].turns)
        shown = [rollouts.messages_of(r) if conversational else r.instruction for r in samples]

        def score(generations: list[str]) -> list[str]:
            made = [[{"role": "assistant", "content": g}] if conversational else g for g in generations]
            ids = batching.leading_ids(tokenizer, generations, 10**6) if generations else []
            try:
                table = rewards.score(loaded, shown, made, {**columns, "completion_ids": ids}, None)
            except UserError as e:  # after training too: the run's results stand; the line says why
                return [f"not scored: {e}"] * len(generations)
            return [rewards.line(loaded, row) for row in table]

        return score

    def sample_tokens(self, cfg) -> int:
        """A rollout's budget: the samples are scored by the rewards as rollouts are, so they are as long."""
        return self.constants(cfg.train)["max_completion_length"]

    def run_metrics(self, train, rows: list) -> dict:
        last = next((row for row in reversed(rows) if "reward" in row and "train_loss" in row), {})
        shown = ("reward", "reward_std", "completion_length", "kl", "clip_ratio_region", "entropy")
        return {**super().run_metrics(train, rows), "reward": list(train.reward),
                **{f"train_{name}": last.get(name) for name in shown}}  # fmt: skip

    # === Plan ===

    def sequences_per_entry(self, packed: bool, train=None) -> int:
        return self.constants(train)["num_generations"] if train is not None else self.sequences_per_example

    def plan_transient(self, cfg, dims, value_bytes: int, entries: int, backend: str) -> dict[str, float]:
        """The rollout's sampling, before the step: keras-hub's KV cache, (rows, layers, 2, positions, kv heads,
        head dim) in the compute dtype, and the copy each loop step makes of it (the layers' caches stacked
        anew); and where run eagerly (PyTorch) the first pass's logits, at every prompt position in the compute
        dtype (XLA drops them: only the cache is kept). The positions are --seq-len: the widest prompt and the
        completion."""
        rows = entries * self.constants(cfg.train)["num_generations"]
        positions = cfg.model.seq_len
        cache = rows * dims.num_layers * 2 * positions * dims.num_key_value_heads * dims.head_dim * value_bytes
        out = {"rollout_kv_cache": 2 * cache}
        if backend == "torch":
            out["rollout_prompt_logits"] = rows * positions * dims.vocabulary_size * value_bytes
        return out

    def plan_note(self, cfg, packed: bool = False) -> str | None:
        c = self.constants(cfg.train)  # never packed: each rollout is a row of its own
        return (f"--method {self.name}: each prompt of a batch is {c['num_generations']} rows (--num-generations), each "
                f"up to --max-completion-length {c['max_completion_length']} sampled tokens with keras-hub's KV "
                "cache; " + ("no reference pass (--beta 0)" if not c["beta"] else self.kl_words))  # fmt: skip

    kl_words = "the KL's reference is the base with LoRA off, one more forward pass per rollout, no second model"
    """What the plan says of the KL's passes where --beta is not 0."""


GRPO_METHOD = GRPO()


def _media(records, preprocessor, cfg, source: str):
    """The prompts' pictures and clips (prepare.Media), refused where the preset has no encoder for them; None for
    text."""
    if not any(r.images or r.audios for r in records):
        return None
    return prepare.Media.of(records, preprocessor, cfg.model.preset, source)
