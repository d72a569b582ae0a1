"""run(cfg): the whole recipe, from seed to saved adapter, top to bottom.

It follows the Keras Gemma LoRA tutorial: load a preset, enable LoRA, compile
AdamW, fit, then save the adapter. What it adds: response-only loss on
pre-tokenized batches, evaluation before and after on a held-out split,
and a run directory that records everything the run did.
"""

from __future__ import annotations

import importlib.metadata
import math
import sys
import time

import keras

from finetune import backend, batching, data, evaluate, model, outputs, presets, templates
from finetune.config import Config
from finetune.errors import UserError


def run(cfg: Config) -> dict:
    """Train a LoRA adapter as `cfg` says; returns the run's metrics (also in metrics.json)."""
    started = time.perf_counter()
    # finetune.run() and the CLI select the backend before importing this
    # module; selecting again records the tweaks and catches a mismatch.
    tweaks = backend.select(cfg.backend, cfg.train.xla_mem_fraction)

    # Everything a user can get wrong is checked before the first file is written.
    run_dir = outputs.choose_dir(cfg.output.dir, cfg.output.overwrite)
    source = presets.resolve(cfg.model.preset)
    records = load_records(cfg, cfg.data.path)
    tweaks.update(backend.apply_runtime_tweaks(cfg.model.precision))
    keras.utils.set_random_seed(cfg.train.seed)

    lm, preprocessor = model.build(source, cfg.model.seq_len)
    tokenizer = preprocessor.tokenizer
    template = templates.get(cfg.data.template)
    overhead = batching.template_overhead(tokenizer, template)
    if cfg.model.seq_len < overhead + 8:
        raise UserError(
            f"seq-len {cfg.model.seq_len} is too small for the {template.name} template, whose fixed text "
            f"takes {overhead} tokens; use --seq-len {max(64, overhead + 8)} or more"
        )
    usable = usable_examples(records, template, tokenizer, cfg, cfg.data.path)

    adapted = model.enable_lora(lm, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets)
    learning_rate = cfg.train.learning_rate or source.default_learning_rate
    model.compile(lm, learning_rate, cfg.train.weight_decay)
    batch_size = cfg.train.batch_size or backend.DEFAULT_BATCH_SIZE[cfg.backend]
    if batch_size == "auto":
        # Capped so that a held-out batch and a training batch both remain.
        probe_rows = batching.pad([e for _, e in usable[:64]], cfg.model.seq_len)
        batch_size = largest_batch_size(lm, probe_rows, limit=min(64, len(usable) // 2))
        print(f"batch size auto: {batch_size}")
    train_part, eval_part = data.split(usable, cfg.data.eval_fraction, cfg.train.seed, min_eval=batch_size)
    if len(train_part) < batch_size:
        raise UserError(
            f"{len(train_part)} training records are fewer than one batch of {batch_size}; "
            "lower --batch-size or add records"
        )
    train_examples = [e for _, e in train_part]
    eval_examples = [e for _, e in eval_part]
    eval_records = [r for r, _ in eval_part]
    train_batches = batching.Batches(
        batching.pad(train_examples, cfg.model.seq_len), batch_size, shuffle=True, seed=cfg.train.seed
    )
    eval_batches = batching.Batches(batching.pad(eval_examples, cfg.model.seq_len), batch_size)

    sample_records = eval_records[: cfg.train.samples]
    sample_prompts = [template.apply(r)[0] for r in sample_records]
    evaluator = model.evaluator(lm)
    before = evaluate.metrics(evaluator, eval_batches)
    print(f"eval loss before training: {before['loss']:.4f}")
    generated_before = evaluate.generate(
        lm, preprocessor, sample_prompts, cfg.train.max_new_tokens, template.stop_tokens
    )

    steps_per_epoch = len(train_batches)
    epochs = cfg.train.epochs
    if cfg.train.max_steps is not None:
        epochs = min(epochs, math.ceil(cfg.train.max_steps / steps_per_epoch))
        # A run shorter than an epoch declares it, so the progress bar counts to max_steps.
        steps_per_epoch = min(steps_per_epoch, cfg.train.max_steps)
    recorder = StepRecorder(train_batches, cfg.train.max_steps, lambda: evaluate.metrics(evaluator, eval_batches))
    train_started = time.perf_counter()
    # keras-hub's CausalLM.fit wraps its input in a tf.data/grain pipeline for
    # string preprocessing; these batches are token ids already, so use
    # Keras' own fit, which takes a PyDataset on every backend.
    history = keras.Model.fit(
        lm,
        train_batches,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        callbacks=[recorder],
        # A live progress bar in a terminal or notebook; one line per epoch in logs.
        verbose=1 if sys.stdout.isatty() or "ipykernel" in sys.modules else 2,
    )
    train_seconds = time.perf_counter() - train_started
    after = recorder.evaluations[-1]  # the held-out split is evaluated after every epoch
    generated_after = evaluate.generate(
        lm, preprocessor, sample_prompts, cfg.train.max_new_tokens, template.stop_tokens
    )

    metrics = {
        "backend": cfg.backend,
        "preset": cfg.model.preset,
        "rank": cfg.lora.rank,
        "alpha": cfg.lora.alpha if cfg.lora.alpha is not None else cfg.lora.rank,
        "targets": list(cfg.lora.targets),
        "adapted_layers": adapted,
        "trainable_parameters": model.trainable_parameters(lm),
        "train_examples": len(train_examples),
        "eval_examples": len(eval_examples),
        "batch_size": batch_size,
        "seq_len": cfg.model.seq_len,
        "learning_rate": learning_rate,
        "steps": recorder.step,
        "epochs": epochs,
        "train_loss": float(history.history["loss"][-1]),
        "eval_loss_before": before["loss"],
        "eval_loss": after["loss"],
        "eval_perplexity_before": before["perplexity"],
        "eval_perplexity": after["perplexity"],
        "eval_accuracy_before": before["accuracy"],
        "eval_accuracy": after["accuracy"],
        "trained_tokens": recorder.total_tokens,
        "response_tokens": recorder.total_response_tokens,
        "tokens_per_second": recorder.tokens_per_second(),
        "train_seconds": train_seconds,
        "seconds": time.perf_counter() - started,
        "peak_memory_mb": backend.peak_memory_mb(),
        "dtype_policy": tweaks["dtype_policy"],
        "device": tweaks["device"],
    }
    resolved = cfg.to_dict()
    resolved["train"]["batch_size"] = batch_size
    resolved["train"]["learning_rate"] = learning_rate
    resolved["output"]["dir"] = str(run_dir)
    resolved["resolved"] = {
        "preset_kind": source.kind,
        "preset_family": source.family,
        "backend_tweaks": tweaks,
        "versions": _versions(),
    }
    samples = [
        {"prompt": p, "reference": r.response, "before": b, "after": a}
        for p, r, b, a in zip(sample_prompts, sample_records, generated_before, generated_after)
    ]

    writer = outputs.RunWriter(run_dir)
    try:
        lm.backbone.save_lora_weights(str(writer.path(outputs.ADAPTER)))
        outputs.write_config(writer.path("config.yaml"), resolved)
        outputs.write_history(writer.path("history.csv"), recorder.rows)
        outputs.write_samples(writer.path("samples.md"), samples)
        outputs.plot_loss(
            writer.path("loss.png"),
            [{"step": 0, "eval_loss": before["loss"]}] + recorder.rows,
            f"{cfg.model.preset} LoRA rank {cfg.lora.rank} on {cfg.backend}",
        )
        metrics["seconds"] = time.perf_counter() - started
        outputs.write_metrics(writer.path("metrics.json"), metrics)
        writer.publish()
    except BaseException:
        writer.discard()
        raise
    print(outputs.summary_table(metrics, run_dir))
    return metrics


def load_records(cfg: Config, path: str) -> list[data.Record]:
    """The records of `path`, checked and filtered as the config says."""
    return data.filter_records(
        data.load_records(path),
        drop_context=cfg.data.drop_context,
        categories=cfg.data.categories,
        max_records=cfg.data.max_records,
        source=path,
    )


def usable_examples(records, template, tokenizer, cfg: Config, source: str) -> list[tuple]:
    """(record, Example) for each record that leaves a response token within seq_len."""
    examples, dropped = batching.tokenize(
        [template.apply(r) for r in records], tokenizer, cfg.model.seq_len, cfg.data.train_on_prompt
    )
    batching.check_fits(examples, dropped, source)
    if dropped:
        print(f"note: {len(dropped)} records skipped: their prompt fills all {cfg.model.seq_len} tokens")
    skipped = set(dropped)
    kept = [r for i, r in enumerate(records) if i not in skipped]
    return list(zip(kept, examples))


def largest_batch_size(lm, arrays, limit: int) -> int:
    """Double the batch from 1 until a trial step runs out of memory or `limit` is hit.

    The trial steps change the LoRA weights and the optimizer state, so both
    are put back afterwards: the probe must not leak into the run.
    """
    lm.optimizer.build(lm.trainable_variables)
    saved = [v.numpy() for v in lm.trainable_variables + list(lm.optimizer.variables)]
    best, size = None, 1
    while size <= limit:
        x, y, w = batching.Batches(arrays, size)[0]
        try:
            lm.train_on_batch(x, y, sample_weight=w)
        except Exception as e:  # noqa: BLE001 - each backend raises its own OOM type
            if not backend.is_out_of_memory(e):
                raise
            break
        best, size = size, size * 2
    for variable, value in zip(lm.trainable_variables + list(lm.optimizer.variables), saved):
        variable.assign(value)
    lm.reset_metrics()
    if best is None:
        raise UserError("one sequence does not fit in memory; lower --seq-len or pick a smaller preset")
    return best


def _versions() -> dict:
    names = ["finetune", "keras", "keras-hub", "jax", "torch", "tensorflow"]
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


class StepRecorder(keras.callbacks.Callback):
    """Per-step train loss, throughput and the max-steps stop.

    Keras reports a running mean of the epoch's batch losses; with equal
    batch sizes, step k's own loss is k * mean_k - (k - 1) * mean_(k-1).
    """

    def __init__(self, batches, max_steps, evaluate_held_out):
        super().__init__()
        self.batches = batches
        self.max_steps = max_steps
        self.evaluate_held_out = evaluate_held_out
        self.evaluations: list[dict] = []
        self.rows: list[dict] = []
        self.step = 0
        self.total_tokens = 0
        self.total_response_tokens = 0
        self._times: list[float] = []
        self._tokens: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch + 1
        self._mean = 0.0
        self._epoch_start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        mean = float(logs["loss"])
        loss = (batch + 1) * mean - batch * self._mean
        self._mean = mean
        self.step += 1
        tokens, response_tokens = self.batches.tokens(batch)
        self.total_tokens += tokens
        self.total_response_tokens += response_tokens
        self._tokens.append(tokens)
        self._times.append(time.perf_counter())
        self.rows.append({"step": self.step, "epoch": self.epoch, "train_loss": loss})
        if self.max_steps is not None and self.step >= self.max_steps:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        # Keras has written the trained weights back to the variables by now
        # (JAX holds them apart during the epoch), so the evaluator sees them.
        result = self.evaluate_held_out()
        self.evaluations.append(result)
        self.rows.append(
            {"step": self.step, "epoch": epoch + 1, "eval_loss": result["loss"], "eval_accuracy": result["accuracy"]}
        )

    def tokens_per_second(self) -> float:
        """Over steps 2..N: the first step includes compilation."""
        if len(self._times) < 2:
            return float("nan")
        return sum(self._tokens[1:]) / (self._times[-1] - self._times[0])
