"""run(cfg): the whole recipe, from seed to saved adapter, top to bottom.

It follows the Keras Gemma LoRA tutorial: load a preset, enable LoRA, compile
AdamW, train, then save the adapter. What it adds: response-only loss on
pre-tokenized batches, evaluation before and after on a held-out split,
checkpoints to resume from after a kill, guards that never publish a broken
run, and a run directory that records everything the run did.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from finetune import (
    __version__,
    adapter,
    attention,
    backend,
    batching,
    callbacks,
    checkpoint,
    data,
    distribution,
    families,
    loop,
    model,
    outputs,
    packing,
    plan,
    platforms,
    presets,
    scoring,
    templates,
)
from finetune.config import Config, parse_duration
from finetune.errors import RunStopped, UserError

KAGGLE_TIME_LIMIT = "11h30m"  # Kaggle sessions end at 12 hours: leave time to save and copy out


def run(cfg: Config, resume: bool = False) -> dict:
    """Train a LoRA adapter as `cfg` says; returns the run's metrics (also in metrics.json).

    resume: bool. Continue from the newest valid checkpoint in cfg.output.dir;
        without one, start there afresh.
    """
    started = time.perf_counter()

    def phase(text: str) -> None:
        """A line per phase, with the time since the start: logs without a terminal show where the run is."""
        print(f"[{loop.clock(time.perf_counter() - started)}] {text}", flush=True)

    deadline = _deadline(cfg.train.time_limit)
    # finetune.run() and the CLI select the backend before importing this
    # module; selecting again records the tweaks and catches a mismatch.
    tweaks = backend.select(cfg.backend, cfg.train.xla_mem_fraction)
    # A multi-process job is joined before anything touches the devices.
    job = distribution.cluster(cfg.distribution)
    if job is not None and resume:
        raise UserError("--resume is not supported in a multi-process job yet; resume on a single host")
    distribution.initialize(job)
    writer = job is None or job.process_id == 0

    # Everything a user can get wrong is checked before the first file is written.
    # A gs:// target is written to a local staging directory, target.path, and copied out.
    if writer:
        target = outputs.check_target(cfg.output.dir, cfg.output.overwrite, resume)
    else:  # every process trains and saves alike, but only process 0's files are kept
        scratch = Path(tempfile.gettempdir()) / f"finetune-process-{job.process_id}-{uuid.uuid4().hex[:8]}"
        target = outputs.Target(scratch / "run")  # made when training starts, as a run directory is
    resume_from = checkpoint.newest(target.path) if resume else None
    if resume and resume_from is None:
        if (target.path / outputs.METRICS).exists():
            raise UserError(f"{target} holds a finished run without checkpoints; pass --overwrite to train again")
        print(f"note: no checkpoint in {target} to resume from; starting a new run there")
    source = presets.resolve(cfg.model.preset)
    records = load_records(cfg, cfg.data.path)
    fingerprint = data.fingerprint(records)
    saved = None
    if resume_from is not None:
        saved = resume_from.state()
        cfg = checkpoint.resumed_config(cfg, saved)
        checkpoint.check_compatible(saved, cfg, fingerprint, target)
    tweaks.update(backend.apply_runtime_tweaks(cfg.model.precision, cfg.train.threads))
    # auto is decided once and saved decided: a run resumed on another machine trains on in the same dtype.
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, precision=tweaks["dtype_policy"]))
    backend.set_seed(cfg.train.seed)
    batch_size = cfg.train.batch_size or backend.DEFAULT_BATCH_SIZE[cfg.backend]
    if cfg.train.batch_size is None:  # the user chose none: pick one the mesh's data axis splits
        batch_size, fitted = distribution.fit_to_data_axis(cfg.distribution, batch_size)
        if fitted:
            print(f"note: {fitted}")
    # Set before the model is built, so that weights are created sharded, never whole on one device.
    distributed = None
    if cfg.distribution.parallel != "none":
        distributed = distribution.setup(cfg.distribution, presets.dims(source), batch_size)
    part = distribution.data_part()  # the rows of each batch this process feeds

    remat, why = plan.remat_for(cfg, tweaks["dtype_policy"], tweaks["device"], backend.device_memory(tweaks["device"]))
    tweaks["remat"] = why
    if remat:
        print(f"remat: {why}")
    phase(f"loading {cfg.model.preset} on {cfg.backend}")
    lm, preprocessor = model.build(source, cfg.model.seq_len, tweaks["dtype_policy"], cfg.model.quantize, remat)
    tokenizer = preprocessor.tokenizer
    template = templates.get(cfg.data.template)
    overhead = batching.template_overhead(tokenizer, template)
    if cfg.model.seq_len < overhead + 8:
        raise UserError(
            f"seq-len {cfg.model.seq_len} is too small for the {template.name} template, whose fixed text "
            f"takes {overhead} tokens; use --seq-len {max(64, overhead + 8)} or more"
        )
    usable = usable_examples(records, template, tokenizer, cfg, cfg.data.path)

    packed = packs(lm, cfg.data.packing)
    adapted = model.enable_lora(lm, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets, cfg.train.seed)
    learning_rate = cfg.train.learning_rate or source.default_learning_rate
    trainer = model.compile(lm, learning_rate, cfg.train.weight_decay, shards=part[2])
    if batch_size == "auto":
        probe_rows = batching.pad([e for _, e in usable[:64]], cfg.model.seq_len)
        examples = [e for _, e in usable]
        rows = len(examples)
        if packed:  # packed, the same examples fill fewer rows, hence fewer steps
            rows = len(packing.best_fit_decreasing([len(e.token_ids) - 1 for e in examples], cfg.model.seq_len))
        batch_size, why = auto_batch_size(trainer, probe_rows, rows, tweaks["device"], model.input_names(lm))
        print(f"batch size auto: {batch_size} ({why})")
    train_part, eval_part = split(usable, cfg, batch_size)
    if len(train_part) < batch_size:
        raise UserError(
            f"{len(train_part)} training records are fewer than one batch of {batch_size}; "
            "lower --batch-size or add records"
        )
    eval_records = [r for r, _ in eval_part]
    train_examples = [e for _, e in train_part]
    padded = batching.pad(train_examples, cfg.model.seq_len)
    rows = packing.pack(train_examples, cfg.model.seq_len) if packed else padded
    if len(rows["token_ids"]) < batch_size:
        raise UserError(
            f"{len(train_examples)} training records fill {len(rows['token_ids'])} rows, fewer than one batch of "
            f"{batch_size}; lower --batch-size, add records, or pass --packing off"
        )
    padding = {"padding_fraction": packing.padding_fraction(rows), "unpacked": packing.padding_fraction(padded)}
    if packed:
        print(
            f"packing: {len(train_examples)} examples in {len(rows['token_ids'])} rows of {cfg.model.seq_len} "
            f"tokens; padding {padding['unpacked']:.0%} -> {padding['padding_fraction']:.0%}"
        )
    # In a multi-process job each process feeds its own slice of every global batch.
    inputs = model.input_names(lm)
    step = batching.length_step(cfg.backend, cfg.model.seq_len, tweaks["device"])
    order = batching.TrainOrder(rows, batch_size, cfg.train.seed, part=part, length_step=step, inputs=inputs)
    eval_rows = batching.pad([e for _, e in eval_part], cfg.model.seq_len)
    # Keras feeds evaluate() on TensorFlow through a tf.data signature read off its first batches: one length.
    eval_step = None if cfg.backend == "tensorflow" else step
    eval_batches = batching.Batches(eval_rows, batch_size, part=part, length_step=eval_step, inputs=inputs)
    steps_per_epoch = order.steps_per_epoch
    total_steps = steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)
    if resume_from is not None:
        check_resume_end(resume_from, total_steps, target)
    outputs.check_free_space(target.path, checkpoint_bytes(lm) * (cfg.train.keep_checkpoints + 2))

    resolved = cfg.to_dict()
    resolved["train"]["batch_size"] = batch_size
    resolved["train"]["learning_rate"] = learning_rate
    # A run's config.yaml is a recipe for a new run: it must not name this directory or replace it.
    resolved["output"] = {"dir": None, "overwrite": False}

    samples_wanted = cfg.train.samples
    if job is not None and samples_wanted:
        # keras-hub's generate() returns the batch sharded over every process, which no single one can read.
        print("note: no sample generations in a multi-process job; run `finetune generate` on the adapter")
        samples_wanted = 0
    sample_records = eval_records[:samples_wanted]
    sample_prompts = [template.sample_prompt(r) for r in sample_records]
    scorer = model.scorer(lm, batch_size, shards=part[2])
    eval_started = time.perf_counter()
    if saved is None:
        phase(f"evaluating before training ({len(eval_part)} held-out records)")
        before = scoring.metrics(scorer, eval_batches)
        print(f"eval loss before training: {before['loss']:.4f}")
        if sample_prompts:
            phase(f"generating {len(sample_prompts)} samples before training")
        generated_before = scoring.generate(
            lm, preprocessor, sample_prompts, cfg.train.max_new_tokens, template.stop_tokens
        )
        progress, run_id = loop.Progress(), uuid.uuid4().hex[:8]
    else:
        saved = checkpoint.restore(trainer, resume_from)
        before, generated_before = saved["eval_before"], saved["generated_before"]
        progress, run_id = loop.Progress.from_state(saved["progress"]), saved["run_id"]
        print(f"resuming {target} at step {progress.step}/{total_steps}")
    eval_seconds = time.perf_counter() - eval_started

    claim = outputs.claim(
        target.path,
        default=target.default,
        overwrite=cfg.output.overwrite,
        resume=resume,
        mirror=target.mirror,
        vertex=writer,  # only process 0's checkpoints and logs go to Vertex AI's directories
    )
    board = None
    try:  # every way out lets go of the run directory and closes the TensorBoard log
        run_dir = claim.path
        board = callbacks.TensorBoardLog(run_dir / outputs.TENSORBOARD, trainer.optimizer)
        if saved is None:
            board.on_test_end({"step": 0, **before})

        def save_checkpoint(progress: loop.Progress) -> None:
            weights, optimizer_values, trainable_paths, optimizer_paths = checkpoint.capture(trainer)
            if not all(np.isfinite(w).all() for w in weights):
                raise UserError(
                    f"the LoRA weights are not finite after step {progress.step}: training diverged, so nothing "
                    f"was published.\n{divergence_advice(cfg, learning_rate)}"
                )
            state = {
                "run_id": run_id,
                "step": progress.step,
                "config": resolved,
                "data_fingerprint": fingerprint,
                "eval_before": before,
                "generated_before": generated_before,
                "progress": progress.to_state(),
                "trainable_paths": trainable_paths,
                "optimizer_paths": optimizer_paths,
            }
            try:
                checkpoint.save(run_dir, run_id, progress.step, weights, optimizer_values, state)
                checkpoint.prune(run_dir, run_id, cfg.train.keep_checkpoints)
                outputs.write_status(run_dir, "running", progress.step)
            except OSError as e:
                last = checkpoint.latest(run_dir)
                kept = f"the checkpoint at step {last.step} is intact" if last else "no earlier checkpoint exists"
                raise UserError(
                    f"could not write the checkpoint at step {progress.step} to {run_dir}: {e.strerror or e}; "
                    f"{kept}.\nFree space or fix the directory, then rerun with --resume"
                ) from e
            claim.sync()  # to gs:// and Vertex AI's directories, so a preempted job keeps it

        steps = loop.Loop(
            trainer,
            order,
            total_steps,
            progress,
            evaluate_held_out=lambda: scoring.metrics(scorer, eval_batches),
            save_checkpoint=save_checkpoint,
            checkpoint_every=cfg.train.checkpoint_every,
            deadline=deadline,
            eval_seconds=eval_seconds,
            divergence_advice=divergence_advice(cfg, learning_rate),
            last_saved=resume_from.step if resume_from else None,
            callbacks=[board],
        )
        try:
            phase(f"training steps {progress.step + 1}-{total_steps}")
            steps.run()  # status.json is written with each checkpoint
        except RunStopped as stop:
            outputs.write_status(run_dir, "stopped", progress.step, str(stop))
            claim.sync()
            raise
        except BaseException as error:
            failure = error
            if backend.is_out_of_memory(error):
                failure = UserError(
                    f"out of memory at step {progress.step + 1} with batch {batch_size}, seq-len {cfg.model.seq_len}, "
                    f"rank {cfg.lora.rank}; lower --batch-size or --seq-len"
                    + (f" (the checkpoint at step {steps.last_saved} is kept)" if steps.last_saved else "")
                )
            if steps.last_saved is None:
                claim.abandon()  # nothing worth keeping was written
            else:
                _record_failure(run_dir, progress.step, failure)
            if failure is error:
                raise
            raise failure from error

        after = progress.evaluations[-1]  # the held-out split is evaluated after every epoch and the last step
        if sample_prompts:
            phase(f"generating {len(sample_prompts)} samples after training")
        generated_after = scoring.generate(
            lm, preprocessor, sample_prompts, cfg.train.max_new_tokens, template.stop_tokens
        )
        train_losses = [r["train_loss"] for r in progress.rows if "train_loss" in r]
        metrics = {
            "backend": cfg.backend,
            "preset": cfg.model.preset,
            "rank": cfg.lora.rank,
            "alpha": cfg.lora.alpha if cfg.lora.alpha is not None else cfg.lora.rank,
            "targets": list(cfg.lora.targets),
            "adapted_layers": adapted,
            "trainable_parameters": model.trainable_parameters(lm),
            "train_examples": len(train_part),
            "eval_examples": len(eval_part),
            "batch_size": batch_size,
            "seq_len": cfg.model.seq_len,
            "learning_rate": learning_rate,
            "run_id": run_id,
            "steps": progress.step,
            "epochs": math.ceil(progress.step / steps_per_epoch),
            "resumed_from_step": resume_from.step if resume_from else None,
            "train_loss": train_losses[-1],
            "eval_loss_before": before["loss"],
            "eval_loss": after["loss"],
            "eval_perplexity_before": before["perplexity"],
            "eval_perplexity": after["perplexity"],
            "eval_accuracy_before": before["accuracy"],
            "eval_accuracy": after["accuracy"],
            "packing": packed,
            "padding_fraction": padding["padding_fraction"],
            "padding_fraction_unpacked": padding["unpacked"],
            "trained_tokens": progress.trained_tokens,
            "response_tokens": progress.response_tokens,
            # Non-padding tokens per second of optimizer steps in this session, its first
            # (compiling) step and every evaluation excluded.
            "tokens_per_second": steps.tokens_per_second(),
            "train_seconds": progress.train_seconds,
            "seconds": time.perf_counter() - started,
            "peak_memory_mb": backend.peak_memory_mb(),
            "dtype_policy": tweaks["dtype_policy"],
            "device": tweaks["device"],
            "distribution": distributed or {"parallel": "none", "devices": 1, "processes": 1},
        }
        resolved["resolved"] = {
            "output_dir": str(claim) if claim.remote else str(run_dir.resolve()),
            "run_id": run_id,
            "preset_kind": source.kind,
            "preset_family": source.family,
            "backend_tweaks": tweaks,
            "versions": _versions(),
        }
        samples = [
            {"prompt": p, "reference": r.response, "before": b, "after": a}
            for p, r, b, a in zip(sample_prompts, sample_records, generated_before, generated_after)
        ]
        history = [{"step": 0, "eval_loss": before["loss"]}] + progress.rows
        title = f"{cfg.model.preset} LoRA rank {cfg.lora.rank} on {cfg.backend}"
        description = adapter.describe(
            lm.backbone, preset=cfg.model.preset, family=source.family, rank=cfg.lora.rank, alpha=metrics["alpha"],
            targets=cfg.lora.targets, template=cfg.data.template, seq_len=cfg.model.seq_len,
            dtype=tweaks["dtype_policy"], quantize=cfg.model.quantize, version=__version__,
        )  # fmt: skip
        try:
            phase(f"saving the adapter and results to {claim}")
            outputs.publish(
                run_dir,
                {
                    outputs.ADAPTER: lambda p: lm.backbone.save_lora_weights(str(p)),
                    outputs.ADAPTER_JSON: lambda p: adapter.write(p, description),
                    outputs.CONFIG: lambda p: outputs.write_config(p, resolved),
                    outputs.HISTORY: lambda p: outputs.write_history(p, progress.rows),
                    outputs.SAMPLES: lambda p: outputs.write_samples(p, samples),
                    outputs.LOSS_PLOT: lambda p: outputs.plot_loss(p, history, title),
                    outputs.METRICS: lambda p: outputs.write_metrics(p, metrics),
                },
            )
            checkpoint.remove_others(run_dir, run_id)
            outputs.write_status(run_dir, "finished", progress.step)
        except OSError as e:
            raise UserError(
                f"could not write the results to {run_dir}: {e.strerror or e}; the checkpoint at step {progress.step} "
                "is kept.\nFree space or fix the directory, then rerun with --resume to write them"
            ) from e
        try:
            claim.publish_remote()  # every file, then metrics.json
        except Exception as e:  # noqa: BLE001 - network and auth errors differ by file system
            raise UserError(
                f"could not copy the run to {claim} ({e}); it is staged in {run_dir}.\n"
                "Fix the access, then rerun with --resume to copy it"
            ) from e
        if writer:
            platforms.report_tuning_metric(metrics["eval_loss"], progress.step)
            print(outputs.summary_table(metrics, claim))
        return metrics
    finally:
        if board is not None:
            board.on_train_end()  # closes its writers, also when the run failed or stopped
        claim.release()
        if not writer:
            shutil.rmtree(target.path.parent, ignore_errors=True)


def _deadline(time_limit: str | None) -> float | None:
    """The time.monotonic() instant to stop by, from --time-limit (11h30m by default in a Kaggle notebook)."""
    if time_limit is None and platforms.in_kaggle_notebook():
        time_limit = KAGGLE_TIME_LIMIT
    if time_limit is None or time_limit == "off":
        return None
    return time.monotonic() + parse_duration(time_limit)


def divergence_advice(cfg: Config, learning_rate: float) -> str:
    lower = f"{learning_rate / 10:g}"
    precision = "" if cfg.model.precision == "float32" else " or --precision float32"
    return f"Try a lower learning rate (--lr {lower}; this run used {learning_rate:g}){precision}."


def _record_failure(run_dir, step: int, error: BaseException) -> None:
    if isinstance(error, KeyboardInterrupt):
        state, message = "stopped", "interrupted"
    else:
        state, message = "failed", str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
    try:
        outputs.write_status(run_dir, state, step, message)
    except OSError:
        pass  # the disk that failed the run may refuse this too; the checkpoints are what matter


def check_resume_end(found, total_steps: int, target) -> None:
    """Refuse a resume past the run's new end, or of a run already published from this checkpoint.

    A run whose last checkpoint is its final step but has no results of that
    checkpoint (killed while publishing) is resumed: it only publishes.
    """
    if found.step > total_steps:
        raise UserError(
            f"{target} has trained {found.step} steps, more than the {total_steps} this run asks for; "
            f"raise --max-steps or --epochs to at least that"
        )
    try:
        metrics = json.loads((target.path / outputs.METRICS).read_text(encoding="utf-8"))
        published = metrics.get("run_id") == found.run_id and metrics.get("steps") == found.step
    except (OSError, ValueError, AttributeError):
        published = False
    if found.step == total_steps and published:
        raise UserError(
            f"{target} has already trained {found.step} of {total_steps} steps; "
            "raise --epochs or --max-steps to train further"
        )


def packs(lm, setting: str) -> bool:
    """Whether the run packs rows: `auto` and `on` do, when every decoder block takes the per-example mask."""
    if setting == "off":
        return False
    if attention.packs_exactly(lm.backbone):
        return True
    why = f"{type(lm.backbone).__name__}'s decoder blocks cannot take the per-example mask (attention.py)"
    if setting == "on":
        raise UserError(f"--packing on: {why}; pass --packing off or auto")
    print(f"note: packing off: {why}")
    return False


def checkpoint_bytes(lm) -> int:
    """A checkpoint's size: the trainable weights and AdamW's two moments, in float32."""
    return 3 * 4 * model.trainable_parameters(lm) + 2**20


def load_records(cfg: Config, path: str) -> list[data.Record]:
    """The records of `path`, checked and filtered as the config says.

    Chat records on an instruction-tuned preset take the family's turn format
    (templates.for_data): cfg.data.template is set to it, so the run records it.
    """
    records, found = data.read(path)
    family_chat = families.get(presets.family_of(cfg.model.preset)).chat_template
    cfg.data.template, note = templates.for_data(cfg.data.template, found, family_chat, cfg.model.preset, path)
    if note:
        print(note)
    print(f"read {len(records)} records, {found} format, from {path}")
    return data.filter_records(
        records,
        drop_context=cfg.data.drop_context,
        categories=cfg.data.categories,
        max_records=cfg.data.max_records,
        source=path,
    )


def split(usable, cfg: Config, batch_size: int):
    """(training, held out) examples: the split a run trains on, and the one `finetune eval` scores again."""
    return data.split(usable, cfg.data.eval_fraction, cfg.train.seed, min_eval=batch_size)


def usable_examples(records, template, tokenizer, cfg: Config, source: str) -> list[tuple]:
    """(record, Example) for each record that leaves a response token within seq_len."""
    examples, dropped = batching.tokenize(
        [template.segments(r) for r in records], tokenizer, cfg.model.seq_len, cfg.data.train_on_prompt
    )
    batching.check_fits(examples, dropped, source)
    if dropped:
        print(f"note: {len(dropped)} records skipped: their prompt fills all {cfg.model.seq_len} tokens")
    skipped = set(dropped)
    kept = [r for i, r in enumerate(records) if i not in skipped]
    return list(zip(kept, examples))


AUTO_BATCH_CAP = 64
AUTO_MIN_STEPS = 8  # an epoch of fewer steps barely trains


def auto_batch_size(trainer, arrays, rows: int, device: str, names=batching.INPUTS) -> tuple[int, str]:
    """`--batch-size auto`: (batch size, why), never so large that an epoch has under 8 steps.

    On an accelerator: the largest power of two whose trial step fits in memory.
    On a CPU nothing runs out of memory, so the largest would always be the cap:
    there the trial steps are timed, and the batch grows while doubling it still
    adds 10% to tokens/s. Trial steps change the LoRA weights and the optimizer
    state, so both are put back afterwards: the probe must not leak into the run.
    """
    limit = max(1, min(AUTO_BATCH_CAP, rows // AUTO_MIN_STEPS))
    trainer.optimizer.build(trainer.trainable_variables)
    state = trainer.trainable_variables + list(trainer.optimizer.variables)
    saved = [v.numpy() for v in state]
    best, size, speeds = None, 1, {}
    try:
        while size <= limit:
            x, y, w = batching.inputs(arrays, np.arange(size), 1, batching.target_width(arrays, size), names=names)
            try:
                trainer.train_on_batch(x, y, sample_weight=w)  # the first step of a shape compiles it
                if device == "cpu":
                    started = time.perf_counter()
                    trainer.train_on_batch(x, y, sample_weight=w)
                    speeds[size] = np.count_nonzero(x["padding_mask"]) / (time.perf_counter() - started)
            except Exception as e:  # noqa: BLE001 - each backend raises its own OOM type
                if not backend.is_out_of_memory(e):
                    raise
                break
            if device == "cpu" and best is not None and speeds[size] < 1.1 * speeds[best]:
                break
            best, size = size, size * 2
    finally:
        for variable, value in zip(state, saved):
            variable.assign(value)
        trainer.reset_metrics()
    if best is None:
        raise UserError("one sequence does not fit in memory; lower --seq-len or pick a smaller preset")
    cap = f"the cap: {AUTO_BATCH_CAP}, or 1/{AUTO_MIN_STEPS} of the {rows} rows, so an epoch has steps enough"
    if device == "cpu":
        measured = ", ".join(f"{s}: {v:.0f}" for s, v in speeds.items())
        ending = cap if best == limit else "doubling again added under 10%"
        return best, f"CPU, tokens/s by batch {measured}; {ending}"
    return best, f"the largest that fits in memory, up to {cap}" if best == limit else "the largest that fits in memory"


def _versions() -> dict:
    names = ["finetune", "keras", "keras-hub", "jax", "torch", "tensorflow"]
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out
