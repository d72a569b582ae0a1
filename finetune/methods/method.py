"""Method: what a training method is, as the run asks for it. Each family of methods is a module of its own
(supervised.py, preference.py), and the registry (registry.py) names them.

A run decides its method once (training/resolve.py) and then asks this object
for everything that differs between methods: its constants and their reasons,
the objective it compiles, how records become examples and rows, the order the
rows train in (filler rows included), the held-out scorer, the reference pass
before training, the metrics metrics.json keeps, what `finetune eval` reports,
and the plan's terms. Nothing outside finetune/methods/ asks which method runs.

What does not depend on the method is written once, below it, and holds for
every method: the split across processes and data shards (batching.Feed), the
held-out split (prepare.split), gradient accumulation, remat, dropout, NEFTune,
checkpoints and resume.
"""

from __future__ import annotations


class Method:
    """One training method. The defaults here are what most methods share; a family's module overrides the rest.

    name: str. As --method names it, and config.yaml records it.
    title: str. As people write it (DPO, SFT), in messages.
    paired: bool. It trains on preference pairs ({prompt, chosen, rejected} records), not SFT records.
    prompted: bool. It trains on prompts alone (formats.PROMPT_FORMATS) and writes its own completions (GRPO).
    sequences_per_example: int. The sequences each entry of a batch computes (a pair is two): the plan's
        activations, and what --batch-size counts.
    defaults: dict. The train settings this method decides (beta, ...), each name to (default, why).
    """

    name = ""
    title = ""
    paired = False
    prompted = False
    sequences_per_example = 1
    defaults: dict = {}
    held_out = ("perplexity", "accuracy")
    """The held-out metrics beside the loss that metrics.json (eval_NAME, eval_NAME_before), the summary and
    `finetune eval` report, in order."""
    held_out_history = ()
    """The held-out metrics history.csv keeps beside eval_loss and eval_accuracy, as eval_NAME."""
    examples = "examples"
    """What the method's held-out examples are called where they are counted."""
    generates = True
    """The model it trains writes text: a run generates its samples (samples.md). A reward model scores text."""
    files: tuple = ()
    """The files a finished run writes beside its adapter (published), by name: a reward model's head."""
    labelled = False
    """It trains on records with a `label` (a classifier): --labels is its."""
    held_out_moves = True
    """Its held-out loss moves with any change of the weights (a mean of continuous scores), so the same loss before
    and after says the adapter did not change (guards.adapter_unchanged). GRPO's is a mean reward of sampled text,
    which a small held-out set can leave the same while the adapter moved."""
    loss_named = True
    """Its held-out loss is a score of its own that the summary shows; GRPO's is its negated mean reward (lower is
    better, for --keep-best and --early-stop), which the summary shows as the reward."""

    @property
    def takes(self) -> str:
        """The records it trains on, as formats.kind names their kind: data of another kind is refused wherever
        the method meets it (training, eval, predict)."""
        return "preference pairs" if self.paired else "prompts alone" if self.prompted else "records with answers"

    prompt_loss = False
    """Its loss can take the prompt's tokens too (--train-on-prompt): SFT's cross-entropy. A preference loss
    compares answers, GRPO's its completions, a classifier's and a reward model's a score."""
    uses = ""
    """What a finished run of a method that writes no text is for, beside `finetune eval` (refusals say it)."""
    head = ""
    """The file of the score head a finished run writes beside its adapter (its `kernel`, hidden x outputs); "":
    none. `finetune export --format hf` writes it as transformers' ...ForSequenceClassification's `score`."""

    def held_out_words(self, result: dict) -> str:
        """An evaluation's scores (the held-out metrics, `result`) as the run's log says them: the loss and the
        method's first held-out rate (SFT's accuracy, a preference method's reward accuracy)."""
        rate = next(name for name in self.held_out if name != "perplexity")
        return f"eval loss {result['loss']:.4f}, {rate.replace('_', ' ')} {result[rate]:.3f}"

    def better_words(self, best: dict) -> str:
        """What an evaluation must score to beat `best`, the best one so far (--early-stop's reason)."""
        return f"a lower held-out loss than {best['loss']:.4f}"

    def head_labels(self, train) -> list[str]:
        """The names of the score head's outputs, in order: transformers' id2label."""
        return []

    def __repr__(self) -> str:
        return f"<method {self.name}>"

    # === Resolve ===

    def decide(self, train) -> dict:
        """{setting: (value, why)}: the method and its constants, each with its reason (registry.decide checks the
        data's form and the other methods' constants first).

        train: config.TrainConfig.
        """
        decided = {"method": (self.name, self.why)}
        for name, (default, why) in self.defaults.items():
            given = getattr(train, name, None)
            decided[name] = (given, "set") if given is not None else (default, why)
        return decided

    why = ""
    """The method's line in the run's table of decisions."""

    def with_data(self, cfg, records: list, eval_records: list | None = None):
        """`cfg` with what this method decides from the training records (and the --eval-data ones), before the
        run resolves: a classifier's classes. Unchanged for most methods."""
        return cfg

    def refusal(self, cfg) -> str | None:
        """What this method refuses of the settings alone, before data or weights load (registry.check); None when
        nothing. cfg: config.Config."""
        return None

    def unpacked_why(self) -> str | None:
        """Why this method's rows cannot be packed; None when they can (resolve.packing decides the rest)."""
        return None

    def ungrouped_why(self) -> str | None:
        """Why grouping this method's rows by length (--group-by-length) would change nothing; None when it can."""
        return None

    def objective(self, train):
        """What the run minimises, for builder.Optimizer: an object whose view(lm, chunk, shards) trains it.

        train: config.TrainConfig, with this method's constants decided (None ones take their defaults).
        """
        raise NotImplementedError

    # === Prepare ===

    def prepare(self, records, preprocessor, cfg, *, packed=None, probe=None, every_record_of=None):
        """records -> examples -> split -> rows: a prepare.Prepared of what the run trains on and holds out.

        packed: bool. Make the training rows, packed or not; None makes none (`finetune eval`).
        probe: callable(batch_of, rows) -> (batch size, why), for --batch-size auto: trial steps on
            batch_of(size, input names) -> (x, y, sample weights), the method's batch of `size` of its first usable
            examples, for data that fills `rows` batch entries (train.auto_batch_size).
        every_record_of: str. Hold out every record, of this file (`finetune eval --data`).
        """
        raise NotImplementedError

    def evaluated_on(self, prepared, records, preprocessor, cfg):
        """`prepared` with every record of --eval-data (`records`) as its held-out set, in the run's template."""
        raise NotImplementedError

    def order(self, prepared, cfg, feed, model=None):
        """The order the training rows go in: every optimizer step's micro-batches, a function of (seed, step).

        model: builder.Model. The run's model, for a method whose rows are its own samples (GRPO's rollouts).
        """
        raise NotImplementedError

    # === Score ===

    def held_out_scores(self, model, rows, batch_size: int, feed, shards: int = 1):
        """callable(after_batch=None) -> dict: the held-out metrics (loss, accuracy, and the method's own) as the
        model stands; after_batch() is called after each batch (a run's stop check).

        model: builder.Model of the run (its trainer compiled).
        """
        raise NotImplementedError

    def scores_base(self, train) -> bool:
        """Whether the method scores the untrained base beside the model it trains (builder.lora_off: a DPO
        reference, GRPO's KL term): a --full run then keeps a copy of the base's weights to score it with.

        train: config.TrainConfig, with this method's constants decided.
        """
        return False

    def reference(self, trainer, sets: dict, batch_size: int, feed, saved: dict | None, phase) -> dict | None:
        """Whatever the method scores once before training (DPO's reference log-probabilities), into the rows of
        `sets` (name -> rows); read back from `saved` (a checkpoint's) when a run resumes. None: nothing.

        phase: loop.Phases. Says the pass's line, and guards each batch (Phases.guarded: a stop between batches).
        """
        return None

    def evaluate(self, lm, cfg, rows, directory=None) -> dict:
        """`finetune eval`'s metrics of a trained run's `lm` (adapter loaded) on the held-out `rows`.

        directory: Path. The run's directory, where the method's own files are (`files`).
        """
        raise NotImplementedError

    def predict(self, lm, preprocessor, cfg, records, directory) -> list[dict]:
        """`finetune predict`: one dict a record, what the finished run in `directory` makes of it."""
        from finetune.platform.errors import UserError

        raise UserError(f"a --method {self.name} run predicts no labels; `finetune predict` takes a --method "
                        "classify run")  # fmt: skip

    def published(self, trainer) -> dict:
        """The method's own files of a finished run (`files`), each name to write(path), beside the adapter."""
        return {}

    def run_metrics(self, train, rows: list) -> dict:
        """metrics.json's entries of this method: its name and constants, and its last step's own metrics.

        rows: history.csv's rows (loop.Progress.rows).
        """
        return {"method": self.name, **{name: getattr(train, name) for name in self.defaults}}

    def sample_scores(self, cfg, samples: list, tokenizer):
        """A callable(generations) -> one line per sample, shown under each generation in samples.md; None: the
        method scores no generation."""
        return None

    def sample_tokens(self, cfg) -> int:
        """The longest sample generation (samples.md): --max-new-tokens."""
        return cfg.train.max_new_tokens

    # === Plan ===

    def sequences_per_entry(self, packed: bool, train=None) -> int:
        """The sequences of seq_len each entry of --batch-size computes: the method's per example, or one where the
        rows are packed (--batch-size then counts rows, whole examples laid in them). train: the run's TrainConfig,
        where the count is a setting."""
        return 1 if packed else self.sequences_per_example

    def plan_transient(self, cfg, dims, value_bytes: int, entries: int, backend: str) -> dict[str, float]:
        """Bytes this method holds outside the training step, at a time of its own (GRPO's sampling), by name;
        the plan counts what exceeds the step's activations and logits. dims: the model's (plan.Dims); entries:
        --batch-size's entries on a device; value_bytes: the compute dtype's."""
        return {}

    def plan_note(self, cfg, packed: bool = False) -> str | None:
        """What `finetune plan` says of this method's memory, with its rows packed or not; None: nothing."""
        return None
