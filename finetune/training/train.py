"""run(cfg): the whole recipe, from seed to saved adapter, top to bottom.

It follows the Keras Gemma LoRA tutorial: load a preset, enable LoRA, compile
AdamW, train, then save the adapter. What it adds: response-only loss on
pre-tokenized batches, evaluation before and after on a held-out split,
checkpoints to resume from after a kill, guards that never publish a broken
run, and a run directory that records everything the run did. Each step is a
call into the module that owns it: the method (methods/) makes the rows, checkpoint.py
resumes, loop.py trains, outputs.py keeps the run directory.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import math
import time
import uuid
from dataclasses import dataclass

import numpy as np

from finetune.config import Config
from finetune.data import batching, formats
from finetune.methods import prepare, registry
from finetune.model import builder, distribution, optimizer, presets
from finetune.platform import backend
from finetune.platform.errors import UserError
from finetune.platform.version import __version__
from finetune.training import adapter, checkpoint, full_model, guards, loop, outputs, resolve, scoring, tracking


def run(cfg: Config, resume: bool = False) -> dict:
    """Train a LoRA adapter as `cfg` says; returns the run's metrics (also in metrics.json).

    resume: bool. Continue from the newest valid checkpoint in cfg.output.dir;
        without one, start there afresh.

    SIGTERM and Ctrl-C stop it at any moment (loop.StopSignals): at once with nothing written before training, after
    the step under way with a checkpoint from the claimed run directory on, at once while the results are written.
    """
    with loop.StopSignals(), outputs.Reservation() as reservation:
        return _run(cfg, resume, reservation)


def _run(cfg: Config, resume: bool, reservation: outputs.Reservation) -> dict:
    phase = loop.Phases()
    job = _join(cfg, resume)
    tracking.check(cfg.output.report_to)

    # Check the run: everything a user can get wrong, before the first file is written.
    target = outputs.check_run_target(cfg.output, resume, process=job.process_id if job else 0)
    reservation.take(target)  # a second run into it is refused now, not after its first evaluation
    found = checkpoint.to_resume(target, cfg.output, resume, outputs.read_metrics(target.path))
    checkpoint.check_method(found, cfg, target)  # before the method's checks read the checkpoint's settings
    registry.check(cfg)  # the settings alone, before the data is read or a file written
    data = _read(cfg)

    # Decide every auto setting once, with its reason (a resumed run keeps its checkpoint's), on these devices.
    decided = resolve.resolve(
        cfg,
        data.format,
        found.state()["config"] if found else None,
        max((len(r.images) for r in data.records), default=0),
        data,
    )  # the most pictures a record holds
    checkpoint.check_compatible(found, decided.config, data.fingerprints, target)

    # Build the model, then prepare the data: records -> template -> tokens -> split -> rows.
    session = _session(decided, data, job, found, phase)
    finished = checkpoint.check_resume_end(found, session.total_steps, target, outputs.read_metrics(target.path))
    if finished is not None:  # a repeated --resume of a finished run: its results stand, untouched
        print(f"note: {finished}")
        return outputs.read_metrics(target.path)
    outputs.check_free_space(target.path, (cfg.train.keep_checkpoints + 2) * checkpoint_bytes(
        builder.trainable_parameters(session.model.trainer), cfg.train.grad_accum, cfg.eval.keep_best))  # fmt: skip

    # Evaluate before training; a resumed run takes up the scores and the step its checkpoint kept.
    start = _start(session, data.fingerprints, target)

    # Train with callbacks, in the claimed run directory: checkpoints, and status.json, as it goes. From here on,
    # SIGTERM and Ctrl-C stop the run after a training step, with a checkpoint; until here they stopped it at once.
    loop.stop_after_steps()
    with outputs.claim_run(target, cfg.output.overwrite, resume) as claim, contextlib.ExitStack() as stack:
        steps = _train(session, claim, start, stack)

        # Evaluate after training (the loop scored the held-out split at its last step), then publish.
        with claim.finishing(steps.progress.step):
            return _publish(session, claim, start, steps)


def _join(cfg: Config, resume: bool) -> distribution.Cluster | None:
    """The multi-process job this process is part of, joined; None alone."""
    # finetune.run() and the CLI select the backend before importing this
    # module; selecting again catches a mismatch.
    backend.select(cfg.backend, cfg.train.xla_mem_fraction, presets.frameworks_needed(cfg.model.preset))
    # A multi-process job is joined before anything touches the devices.
    job = distribution.cluster(cfg.distribution)
    if job is not None and resume:
        raise UserError("--resume is not supported in a multi-process job yet; resume on a single host")
    distribution.initialize(job)
    return job


@dataclass
class Data:
    """What the run reads before it decides anything: its records, their format, the --eval-data records."""

    records: list
    format: str
    fingerprint: str
    """formats.fingerprint of the records: a resume must train on the same."""
    eval_records: list | None = None

    @property
    def fingerprints(self) -> tuple:
        """The records' fingerprint and the --eval-data records' (None without them): a resume checks both."""
        return self.fingerprint, formats.fingerprint(self.eval_records) if self.eval_records is not None else None


def _read(cfg: Config) -> Data:
    """The training records and any --eval-data file's, read and checked before anything is written."""
    records, data_format = prepare.read(cfg, cfg.data.path)
    eval_records = None
    if cfg.eval.data:
        eval_records, eval_format = prepare.read(cfg, cfg.eval.data)
        if formats.kind(eval_format) != formats.kind(data_format):
            raise UserError(f"--eval-data {cfg.eval.data} holds {formats.kind(eval_format)} ({eval_format}), and "
                            f"--data {formats.kind(data_format)} ({data_format}); hold out records of the kind the run "
                            "trains on")  # fmt: skip
    return Data(records, data_format, formats.fingerprint(records), eval_records)


@dataclass
class Session:
    """One run as its stages make it: the resolved run, the model, the data and what it is scored on."""

    run: resolve.Resolved
    model: builder.Model
    prepared: prepare.Prepared
    order: object
    """The order the training rows are fed in (the method's: batching.TrainOrder, pair_batches.PairOrder); in a
    multi-process job, this process's slice of every batch."""
    total_steps: int
    held_out: scoring.HeldOut | None
    """None when nothing is held out (--eval-fraction 0 without --eval-data)."""
    found: checkpoint.Checkpoint | None
    """The checkpoint a resumed run continues from."""
    phase: loop.Phases
    eval_seconds: float = 0.0
    """How long getting to the first step took (the evaluation before training): the loop's time budget."""


def _session(decided: resolve.Resolved, data: Data, job, found, phase) -> Session:
    """Build the model, decide what needed it (packing, `--batch-size auto`, the steps and the warm-up), print
    every decision once, and prepare the rows, the order they train in and the held-out split."""
    cfg = decided.config
    phase(f"loading {cfg.model.preset} on {cfg.backend}: {decided.device_name}, {decided.precision}")
    model = builder.build_model(decided.source, decided.recipe())
    method = decided.method
    packing = resolve.packing(model.lm, cfg.data.packing, method, any(r.images or r.audios for r in data.records))
    probe = functools.partial(
        auto_batch_size, model.trainer, device=decided.device, names=builder.input_names(model.lm)
    )
    prepared = method.prepare(data.records, model.preprocessor, cfg, packed=packing.value, probe=probe)
    if data.eval_records is not None:
        prepared = method.evaluated_on(prepared, data.eval_records, model.preprocessor, cfg)
    if packing.value and not prepared.packed:  # auto, and the method found its rows do not pack (batch 1)
        packing = resolve.Decision(False, "auto: the method's rows do not pack at this --batch-size")
    settled = {"packing": packing}
    if cfg.train.compile:  # after the batch size's probe, which stays eager
        settled["compile"] = resolve.Decision(*builder.compile_step(model, packing.value))
    if cfg.train.batch_size == "auto":
        settled["batch_size"] = resolve.Decision(prepared.batch_size, prepared.batch_size_why)
    step = batching.length_step(cfg.backend, cfg.model.seq_len, decided.device, compiled=cfg.train.compile)
    grouped = cfg.train.group_by_length and not packing.value
    if cfg.train.group_by_length and packing.value:
        print("note: --group-by-length leaves packed rows as they are (each near --seq-len); pass --packing off "
              "to batch examples of like length")  # fmt: skip
    feed = batching.Feed(decided.part, step, builder.input_names(model.lm), grouped)
    order = method.order(prepared, cfg, feed, model)
    settled.update(resolve.steps(cfg.train, order.steps_per_epoch))
    if cfg.train.grad_accum > 1 and order.steps_per_epoch == 1:
        print(f"note: one optimizer step of --batch-size {prepared.batch_size} x --grad-accum {cfg.train.grad_accum} "
              "takes every training row or more: each step is one pass over the data; lower --grad-accum for more "
              "steps an epoch")  # fmt: skip
    for note in resolve.plan_notes(cfg, settled["steps"].value, settled["warmup_steps"].value, order.steps_per_epoch):
        print(f"note: {note}")
    changed = found and resolve.replanned(cfg.train, found.state()["config"], order.steps_per_epoch, found.step)
    if changed:
        print(f"note: {changed}")
    run = decided.settled(**settled)
    print(run.table())
    _optimize(run, model.trainer)
    return Session(run, model, prepared, order, run.steps, _held_out(run, job, model, prepared), found, phase)


def _lora_variant(cfg) -> str:
    """What the run's LoRA is beside its rank, in words (the summary's): DoRA, rsLoRA, LoRA+, dropout, and the
    quantized base it adapts; "" for plain LoRA on a float base."""
    lora = cfg.lora
    parts = [name for name, on in (("DoRA", lora.dora), ("rsLoRA", lora.rslora)) if on]
    parts += [f"LoRA+ ratio {lora.plus_ratio:g}"] if lora.plus_ratio else []
    parts += [f"dropout {lora.dropout:g}"] if lora.dropout else []
    parts += [f"on an {cfg.model.quantize} base"] if cfg.model.quantize else []
    return ", ".join(parts)


def _optimize(run: resolve.Resolved, trainer) -> None:
    """Give the trainer the run's optimizer (model/optimizer.py): its schedule, clipping and accumulation."""
    train = run.config.train
    controls = optimizer.Controls(train.learning_rate, train.weight_decay, train.lr_schedule, run.warmup_steps,
                                  run.steps, train.grad_accum, train.clip_norm(), train.min_lr_ratio,
                                  run.config.lora.plus_ratio,
                                  builder.embedding_ratio(train.embedding_lr, train.learning_rate))  # fmt: skip
    builder.train_with(trainer, controls)


def _held_out(run: resolve.Resolved, job, model: builder.Model, prepared: prepare.Prepared) -> scoring.HeldOut | None:
    """What the run is scored on: the held-out batches, and the first train.samples records to generate for;
    None when nothing is held out."""
    cfg = run.config
    if not prepared.held_out:
        print("note: evaluation skipped: --eval-fraction 0 holds no records out and there is no --eval-data")
        return None
    samples = [r for r, _ in prepared.held_out[: cfg.train.samples]] if run.method.generates else []
    if job is not None and cfg.train.samples:
        # keras-hub's generate() returns the batch sharded over every process, which no single one can read.
        print("note: no sample generations in a multi-process job; run `finetune generate` on the adapter")
        samples = []
    # Keras feeds evaluate() on TensorFlow through a tf.data signature read off its first batches: one length.
    step = None if cfg.backend == "tensorflow" else batching.length_step(cfg.backend, cfg.model.seq_len, run.device,
                                                                         compiled=cfg.train.compile)  # fmt: skip
    feed = batching.Feed(run.part, step, builder.input_names(model.lm))
    rows = prepared.held_out_rows
    scores = run.method.held_out_scores(model, rows, prepared.batch_size, feed, shards=run.part[2])
    # The records held out, as the line before the first evaluation counts them (rows is a dict of arrays for SFT).
    held_out = scoring.HeldOut(scores, len(prepared.held_out), model, samples, prepared.template,
                               run.method.sample_tokens(cfg))  # fmt: skip
    if samples:
        held_out.judge = run.method.sample_scores(cfg, samples, prepare.tokenizer_of(model.preprocessor))
    return held_out


def _start(session: Session, fingerprints: tuple, target: outputs.Target) -> checkpoint.RunState:
    """Where training starts: a new run scores the held-out records and generates its samples at step 0; a
    resumed run restores what its checkpoint kept."""
    started = time.perf_counter()
    config = outputs.run_config(session.run.config)
    reference = _reference(session, session.found.state().get("reference") if session.found else None)
    if session.found is None and session.held_out is None:
        start = checkpoint.RunState(uuid.uuid4().hex[:8], loop.Progress(), None, [], config, fingerprints[0],
                                    reference, fingerprints[1])  # fmt: skip
    elif session.found is None:
        session.phase(f"evaluating before training ({session.held_out.records} held-out records)")
        before = session.held_out.metrics()
        print(f"{session.run.method.held_out_words(before)} before training")
        warning = _broken_forward(session, before)
        if warning:
            print(f"warning: {warning}")
        generated = session.held_out.generate("before", session.phase)
        start = checkpoint.RunState(uuid.uuid4().hex[:8], loop.Progress(), before, generated, config, fingerprints[0],
                                    reference, fingerprints[1])  # fmt: skip
    else:
        restored = checkpoint.restore(session.model.trainer, session.found)
        start = checkpoint.RunState.resumed(restored, config, fingerprints)
        print(f"resuming {target} at step {start.progress.step}/{session.total_steps}")
    start.packed = session.run.packed
    session.eval_seconds = time.perf_counter() - started
    return start


def _broken_forward(session: Session, before: dict | None) -> str | None:
    """guards.broken_forward of the held-out loss before training, for a pretrained preset (presets.pretrained) whose
    method's loss is the tokens' cross-entropy (it reports perplexity); None otherwise."""
    run = session.run
    if before is None or not presets.pretrained(run.source) or "perplexity" not in run.method.held_out:
        return None
    return guards.broken_forward(before["loss"], session.model.preprocessor.tokenizer.vocabulary_size())


def _reference(session: Session, saved: dict | None) -> dict | None:
    """What the method scores once before training (DPO's reference log-probabilities of every training and
    held-out pair), or reads back from the checkpoint a resumed run continues from; None for most methods."""
    sets = {"train": session.prepared.rows, "held_out": session.prepared.held_out_rows}
    # session.phase.guarded: a stop asked for during the pass is taken after the batch under way.
    return session.run.method.reference(session.model.trainer, sets, session.prepared.batch_size, session.order.feed,
                                        saved, session.phase)  # fmt: skip


def _train(session: Session, claim: outputs.Claim, start: checkpoint.RunState, stack) -> loop.Loop:
    """The loop, run to its end in `claim`: the trackers' logs (TensorBoard by default), checkpoints and
    status.json as it goes."""
    run, trainer = session.run, session.model.trainer
    cfg = run.config
    about = {"name": start.run_id, "params": start.config, "resumed": session.found.step if session.found else None}
    trackers = tracking.open_trackers(cfg.output.report_to, stack, claim.path, trainer.optimizer, about)
    if session.found is None and start.eval_before:  # None: nothing held out
        for tracker in trackers:
            tracker.on_test_end({"step": 0, **start.eval_before})
    advice = divergence_advice(run)
    plan = loop.Plan(session.total_steps, cfg.train.checkpoint_every, run.deadline, advice,
                     f"batch {cfg.train.batch_size}, seq-len {cfg.model.seq_len}, {_trains(cfg)}",
                     release_host_memory=run.device == "cpu" and bool(cfg.data.images))  # fmt: skip
    scores = session.held_out.metrics if session.held_out else None
    hooks = loop.Hooks(
        evaluation=loop.Evaluation(
            scores, cfg.eval.every, cfg.eval.keep_best, cfg.eval.early_stop, run.method.held_out_history, run.method
        ),
        save_checkpoint=functools.partial(claim.checkpoint, trainer, start, cfg.train.keep_checkpoints, advice),
        callbacks=trackers,
        last_saved=session.found.step if session.found else None,
        eval_seconds=session.eval_seconds,
    )
    steps = loop.Loop(trainer, session.order, start.progress, plan, hooks)
    with claim.training(steps):
        session.phase(f"training steps {start.progress.step + 1}-{session.total_steps}")
        steps.run()  # status.json is written with each checkpoint
    return steps


def _publish(session: Session, claim: outputs.Claim, start: checkpoint.RunState, steps: loop.Loop) -> dict:
    """Generate the samples after training, then write the adapter and the results as one published run."""
    steps.restore_best()  # --keep-best: the samples and the adapter are the best evaluation's
    held_out = session.held_out
    generated_after = held_out.generate("after", session.phase) if held_out else []
    metrics = _metrics(session, steps, start)
    start.config["resolved"] = _resolved(session.run, claim, start.run_id)
    session.phase(f"saving the {'model' if session.run.config.model.full else 'adapter'} and results to {claim}")
    samples = held_out.sample_rows(start.generated_before, generated_after) if held_out else []
    claim.publish_results(_files(session, start.config, metrics, steps.progress, samples), metrics)
    tracking.published(
        steps.callbacks, metrics, claim.path / (outputs.WEIGHTS if session.run.config.model.full else outputs.ADAPTER)
    )
    return metrics


def _metrics(session: Session, steps: loop.Loop, start: checkpoint.RunState) -> dict:
    """metrics.json: what the run trained, on what, how well and how fast."""
    run, prepared, found = session.run, session.prepared, session.found
    cfg, progress, before = run.config, steps.progress, start.eval_before
    # The published adapter's: with --keep-best the best evaluation's, else the last's (None: nothing held out).
    after = progress.best() if cfg.eval.keep_best else (progress.evaluations or [None])[-1]
    train_losses = [r["train_loss"] for r in progress.rows if "train_loss" in r]
    trained = [r for r in progress.rows if "train_loss" in r]
    # Where the held-out loss need not move with the weights (Method.held_out_moves), the B factors alone say.
    losses = [e["loss"] if e and run.method.held_out_moves else None for e in (before, after)]
    unchanged = guards.adapter_unchanged(
        guards.b_factors_all_zero(session.model.lm.backbone), *losses, trained, progress.response_tokens,
        cfg.train.learning_rate,
    )  # fmt: skip
    return {
        "backend": cfg.backend,
        "preset": cfg.model.preset,
        "full": cfg.model.full,  # every weight trained: no LoRA, so no rank, alpha or targets
        "rank": None if cfg.model.full else cfg.lora.rank,
        "lora_variant": None if cfg.model.full else _lora_variant(cfg),
        "alpha": None if cfg.model.full else run.alpha,
        "targets": [] if cfg.model.full else list(cfg.lora.targets),
        "adapted_layers": session.model.adapted,
        "trainable_parameters": builder.trainable_parameters(session.model.trainer),  # with a reward model's head
        "train_examples": len(prepared.train),
        "eval_examples": len(prepared.held_out),
        "batch_size": cfg.train.batch_size,
        "seq_len": cfg.model.seq_len,
        "learning_rate": cfg.train.learning_rate,
        "lr_schedule": cfg.train.lr_schedule,
        "grad_accum": cfg.train.grad_accum,
        "run_id": start.run_id,
        # The records read (formats.fingerprint): `finetune eval` scores its held-out split of the same ones.
        "data_fingerprint": start.data_fingerprint,
        "eval_data_fingerprint": start.eval_data_fingerprint,
        "steps": progress.step,
        "epochs": math.ceil(progress.step / steps.order.steps_per_epoch),
        "resumed_from_step": found.step if found else None,
        "train_loss": train_losses[-1],
        **scoring.eval_metrics(before, after, run.method.held_out),
        **run.method.run_metrics(cfg.train, progress.rows),
        "best_step": after["step"] if cfg.eval.keep_best else None,
        "stopped_early": progress.stopped_early,
        # The guards against a run that trains and learns nothing (guards.py), each with its reason.
        "adapter_changed": unchanged is None,
        "adapter_changed_why": unchanged or "the LoRA B factors moved and the held-out loss changed",
        "forward_warning": _broken_forward(session, before),
        "held_out_warning": guards.held_out_worse(
            *losses, after["step"] if cfg.eval.keep_best and after else None, cfg.train.learning_rate
        ),
        "packing": prepared.packed,
        "padding_fraction": prepared.padding["padding_fraction"],
        "padding_fraction_unpacked": prepared.padding["unpacked"],
        "padding_computed": _share(progress.computed_padding, progress.computed_positions),
        "trained_tokens": progress.trained_tokens,
        "response_tokens": progress.response_tokens,
        # Non-padding tokens per second of optimizer steps in this session, its first
        # (compiling) step and every evaluation excluded.
        "tokens_per_second": steps.tokens_per_second(),
        "train_seconds": progress.train_seconds,
        "seconds": session.phase.seconds(),
        "peak_memory_mb": backend.peak_memory_mb(),
        "dtype_policy": run.precision,
        "device": run.device,
        "device_name": run.device_name,
        "distribution": run.distributed or {"parallel": "none", "devices": 1, "processes": 1},
    }


def _resolved(run: resolve.Resolved, claim: outputs.Claim, run_id: str) -> dict:
    """config.yaml's `resolved`: each decided setting as {value, why}, where the run went and what it ran on."""
    return {
        **run.recorded(),
        "output_dir": str(claim) if claim.remote else str(claim.path.resolve()),
        "run_id": run_id,
        "preset_kind": run.source.kind,
        "preset_family": run.source.family,
        "backend_tweaks": run.runtime,
        "versions": _versions(),
    }


def _no_samples_why(session: Session) -> str:
    """Why a run's samples.md holds no generation, as _held_out decided it."""
    run = session.run
    if not run.method.generates:
        return f"a {run.method.title} run writes no text"
    if not run.config.train.samples:
        return "train.samples is 0"
    if not session.prepared.held_out:
        return "no records were held out to prompt with"
    return "a job of several processes generates none; run `finetune generate` on the adapter"


def _files(session: Session, config: dict, metrics: dict, progress, samples: list) -> dict:
    """What a finished run writes: a file name to write(path), for outputs.publish."""
    run, backbone = session.run, session.model.lm.backbone
    history = [{"step": 0, "eval_loss": metrics["eval_loss_before"]}] + progress.rows
    title = f"{run.config.model.preset} {_trains(run.config)} on {run.config.backend}"
    return {
        **_model_files(run, backbone),
        outputs.CONFIG: lambda p: outputs.write_config(p, config),
        outputs.HISTORY: lambda p: outputs.write_history(p, progress.rows),
        outputs.SAMPLES: lambda p: outputs.write_samples(p, samples, _no_samples_why(session)),
        outputs.LOSS_PLOT: lambda p: outputs.plot_loss(p, history, title),
        outputs.METRICS: lambda p: outputs.write_metrics(p, metrics),
        **run.method.published(session.model.trainer),  # a reward model's head
        **({outputs.TOKEN_ROWS: lambda p: adapter.save_token_rows(backbone, p)} if session.model.added else {}),
    }


def _model_files(run: resolve.Resolved, backbone) -> dict:
    """What a run trained, as files: the adapter and adapter.json; a --full run's whole model (full_model.py),
    whose model.json follows model.weights.h5 (outputs.publish writes them in this order) and records its
    checksum."""
    if not run.config.model.full:
        description = adapter.describe(backbone, run, __version__)
        return {
            outputs.ADAPTER: lambda p: adapter.save(backbone, p),
            outputs.ADAPTER_JSON: lambda p: adapter.write(p, description),
        }
    digest = {}

    def weights(path):
        digest["sha256"] = full_model.save(backbone, path)

    return {
        outputs.WEIGHTS: weights,
        outputs.WEIGHTS_JSON: lambda p: adapter.write(
            p, full_model.describe(backbone, run, __version__, digest["sha256"])
        ),
    }


def _trains(cfg: Config) -> str:
    """What the run trains, in a few words: `LoRA rank 4`, or `every weight` (--full)."""
    return "every weight" if cfg.model.full else f"LoRA rank {cfg.lora.rank}"


def divergence_advice(run: resolve.Resolved) -> str:
    """What to try when the loss is not finite."""
    lower = f"{run.learning_rate / 10:g}"
    precision = "" if run.precision == "float32" else " or --precision float32"
    return f"Try a lower learning rate (--lr {lower}; this run used {run.learning_rate:g}){precision}."


def checkpoint_bytes(trainable: int, grad_accum: int = 1, keep_best: bool = False) -> int:
    """A checkpoint's size, in float32: the `trainable` weights and AdamW's two moments, the gradients summed so
    far with --grad-accum above 1 (keras keeps them in the optimizer's state), and the best weights with
    --keep-best (best.npz); 1 MiB for the rest."""
    copies = 3 + (grad_accum > 1) + bool(keep_best)
    return copies * 4 * trainable + 2**20


AUTO_BATCH_CAP = 64
AUTO_MIN_STEPS = 8  # an epoch of fewer steps barely trains


def auto_batch_size(trainer, batch_of, rows: int, *, device: str, names=batching.INPUTS) -> tuple[int, str]:
    """`--batch-size auto`: (batch size, why), never so large that an epoch has under 8 steps.

    On an accelerator: the largest power of two whose trial step fits in memory.
    On a CPU nothing runs out of memory, so the largest would always be the cap:
    there the trial steps are timed, and the batch grows while doubling it still
    adds 10% to tokens/s. Trial steps change the LoRA weights, the optimizer
    state and what the random draws come from (LoRA dropout's count of training
    passes, NEFTune's seed), so all are put back afterwards (what a checkpoint
    keeps): the probe must not leak into the run.
    """
    limit = max(1, min(AUTO_BATCH_CAP, rows // AUTO_MIN_STEPS))
    trainer.optimizer.build(trainer.trainable_variables)
    state = checkpoint.kept(trainer) + list(trainer.optimizer.variables)
    saved = [v.numpy() for v in state]
    best, size, speeds = None, 1, {}
    try:
        while size <= limit:
            x, y, w = batch_of(size, names)
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


def _share(part: int, whole: int) -> float | None:
    """part / whole; None where nothing was counted (a run resumed from a checkpoint that did not count it)."""
    return part / whole if whole else None
