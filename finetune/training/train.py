"""run(cfg): the whole recipe, from seed to saved adapter, top to bottom.

It follows the Keras Gemma LoRA tutorial: load a preset, enable LoRA, compile
AdamW, train, then save the adapter. What it adds: response-only loss on
pre-tokenized batches, evaluation before and after on a held-out split,
checkpoints to resume from after a kill, guards that never publish a broken
run, and a run directory that records everything the run did. Each step is a
call into the module that owns it: prepare.py makes the rows, checkpoint.py
resumes, loop.py trains, outputs.py keeps the run directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import math
import time
import uuid
from dataclasses import dataclass

import numpy as np

from finetune.config import Config, parse_duration
from finetune.data import batching, formats
from finetune.model import attention, builder, distribution, presets
from finetune.platform import backend, platforms
from finetune.platform.errors import UserError
from finetune.platform.version import __version__
from finetune.training import plan
from finetune.training import adapter, callbacks, checkpoint, loop, outputs, prepare, scoring

KAGGLE_TIME_LIMIT = "11h30m"  # Kaggle sessions end at 12 hours: leave time to save and copy out


def run(cfg: Config, resume: bool = False) -> dict:
    """Train a LoRA adapter as `cfg` says; returns the run's metrics (also in metrics.json).

    resume: bool. Continue from the newest valid checkpoint in cfg.output.dir;
        without one, start there afresh.
    """
    phase, deadline = loop.Phases(), _deadline(cfg.train.time_limit)
    tweaks, job = _join(cfg, resume)

    # Check the run: everything a user can get wrong, before the first file is written.
    target = outputs.check_run_target(cfg.output, resume, process=job.process_id if job else 0)
    found = checkpoint.to_resume(target, resume, outputs.read_metrics(target.path))
    source = presets.resolve(cfg.model.preset)
    records = prepare.read(cfg, cfg.data.path)
    fingerprint = formats.fingerprint(records)
    cfg = checkpoint.resumed(found, cfg, fingerprint, target)

    # Set up the devices, then build the model on them: the preset, LoRA, AdamW.
    cfg, distributed, remat = _devices(cfg, tweaks, source)
    built = _build(cfg, source, tweaks, remat, phase)

    # Prepare the data: records -> template -> tokens -> split -> rows, the split `finetune eval` scores again.
    prepared = prepare.prepare(records, built.tokenizer, cfg, packed=built.packed, probe=built.probe_batch_size)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=prepared.batch_size))
    order, total_steps = _train_order(cfg, prepared, built)
    checkpoint.check_resume_end(found, total_steps, target, outputs.read_metrics(target.path))
    outputs.check_free_space(target.path, checkpoint_bytes(built.lm) * (cfg.train.keep_checkpoints + 2))

    # Evaluate before training; a resumed run takes up the scores and the step its checkpoint kept.
    held_out = _held_out(cfg, job, built, prepared)
    config, advice = outputs.run_config(cfg), divergence_advice(cfg, cfg.train.learning_rate)
    start, eval_seconds = _start(found, built.trainer, held_out, phase, config, fingerprint)
    if found is not None:
        print(f"resuming {target} at step {start.progress.step}/{total_steps}")

    # Train with callbacks, in the claimed run directory: checkpoints, and status.json, as it goes.
    with outputs.claim_run(target, cfg.output.overwrite, resume) as claim, contextlib.ExitStack() as stack:
        board = stack.enter_context(callbacks.TensorBoardLog(claim.path / outputs.TENSORBOARD, built.trainer.optimizer))
        if found is None:
            board.on_test_end({"step": 0, **start.eval_before})
        save = functools.partial(claim.checkpoint, built.trainer, start, cfg.train.keep_checkpoints, advice)
        steps = loop.Loop(
            built.trainer, order, total_steps, start.progress, evaluate_held_out=held_out.metrics, deadline=deadline,
            save_checkpoint=save, checkpoint_every=cfg.train.checkpoint_every, last_saved=found.step if found else None,
            eval_seconds=eval_seconds, divergence_advice=advice, callbacks=[board],
            settings=f"batch {cfg.train.batch_size}, seq-len {cfg.model.seq_len}, rank {cfg.lora.rank}",
        )  # fmt: skip
        with claim.training(steps):
            phase(f"training steps {start.progress.step + 1}-{total_steps}")
            steps.run()  # status.json is written with each checkpoint

        # Evaluate after training (the loop scored the held-out split at its last step), then publish.
        with claim.finishing(steps.progress.step):
            generated_after = held_out.generate("after", phase)
            metrics = _metrics(cfg, built, prepared, steps, start, found, tweaks, distributed, phase.seconds())
            config["resolved"] = _resolved(claim, start.run_id, source, tweaks)
            phase(f"saving the adapter and results to {claim}")
            samples = held_out.sample_rows(start.generated_before, generated_after)
            claim.publish_results(_files(built, cfg, source, config, metrics, steps.progress, samples), metrics)
        return metrics


def _deadline(time_limit: str | None) -> float | None:
    """The time.monotonic() instant to stop by, from --time-limit (11h30m by default in a Kaggle notebook)."""
    if time_limit is None and platforms.in_kaggle_notebook():
        time_limit = KAGGLE_TIME_LIMIT
    if time_limit is None or time_limit == "off":
        return None
    return time.monotonic() + parse_duration(time_limit)


def _join(cfg: Config, resume: bool) -> tuple[dict, distribution.Cluster | None]:
    """(the backend's tweaks, the multi-process job this process is part of, joined; None alone)."""
    # finetune.run() and the CLI select the backend before importing this
    # module; selecting again records the tweaks and catches a mismatch.
    tweaks = backend.select(cfg.backend, cfg.train.xla_mem_fraction, presets.frameworks_needed(cfg.model.preset))
    # A multi-process job is joined before anything touches the devices.
    job = distribution.cluster(cfg.distribution)
    if job is not None and resume:
        raise UserError("--resume is not supported in a multi-process job yet; resume on a single host")
    distribution.initialize(job)
    return tweaks, job


def _devices(cfg: Config, tweaks: dict, source: presets.Source) -> tuple[Config, dict | None, bool]:
    """Set up the devices: runtime tweaks, seed, mesh.

    Returns (cfg with its precision, batch size and learning rate decided, the
    distribution as metrics.json records it or None, whether to recompute activations).
    """
    tweaks.update(backend.apply_runtime_tweaks(cfg.model.precision, cfg.train.threads))
    # auto is decided once and saved decided: a run resumed on another machine trains on in the same dtype, and
    # with PyTorch's CPU threads as many as before (its reductions' order, so the last bits, follow the count).
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, precision=tweaks["dtype_policy"]))
    if cfg.train.threads is None and "threads" in tweaks:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads=tweaks["threads"]))
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
    remat, why = plan.remat_for(cfg, tweaks["dtype_policy"], tweaks["device"], backend.device_memory(tweaks["device"]))
    tweaks["remat"] = why
    if remat:
        print(f"remat: {why}")
    learning_rate = cfg.train.learning_rate or source.default_learning_rate
    train = dataclasses.replace(cfg.train, batch_size=batch_size, learning_rate=learning_rate)
    return dataclasses.replace(cfg, train=train), distributed, remat


@dataclass
class Built:
    """The model a run trains, as _build() made it."""

    lm: object
    preprocessor: object
    trainer: object
    """model.compile's training view of `lm`."""
    adapted: int
    """The layers LoRA adapted."""
    packed: bool
    """Whether the training rows are packed (packs())."""
    part: tuple
    """The rows of each batch this process feeds (distribution.data_part)."""
    device: str
    """cpu, gpu or tpu."""

    @property
    def tokenizer(self):
        return self.preprocessor.tokenizer

    def probe_batch_size(self, arrays: dict, rows: int) -> int:
        """`--batch-size auto` (auto_batch_size), for prepare.prepare: trial steps on `arrays`, for data of `rows`."""
        batch_size, why = auto_batch_size(self.trainer, arrays, rows, self.device, builder.input_names(self.lm))
        print(f"batch size auto: {batch_size} ({why})")
        return batch_size


def _build(cfg: Config, source: presets.Source, tweaks: dict, remat: bool, phase) -> Built:
    """The preset's causal LM, LoRA enabled on it, compiled with AdamW."""
    part = distribution.data_part()
    phase(f"loading {cfg.model.preset} on {cfg.backend}: {tweaks['device_name']}, {tweaks['dtype_policy']}")
    lm, preprocessor = builder.build(source, cfg.model.seq_len, tweaks["dtype_policy"], cfg.model.quantize, remat)
    packed = packs(lm, cfg.data.packing)
    adapted = builder.enable_lora(lm, cfg.lora, cfg.train.seed)
    if cfg.train.neftune_alpha:
        builder.add_embedding_noise(lm, cfg.train.neftune_alpha, cfg.train.seed)
    trainer = builder.compile(
        lm, cfg.train.learning_rate, cfg.train.weight_decay, shards=part[2], plus_ratio=cfg.lora.plus_ratio
    )
    return Built(lm, preprocessor, trainer, adapted, packed, part, tweaks["device"])


def _train_order(cfg: Config, prepared: prepare.Prepared, built: Built) -> tuple:
    """(the order the training rows are fed in, batching.TrainOrder; how many steps the run trains).

    In a multi-process job each process feeds its own slice of every global batch.
    """
    step = batching.length_step(cfg.backend, cfg.model.seq_len, built.device)
    inputs = builder.input_names(built.lm)
    order = batching.TrainOrder(
        prepared.rows, prepared.batch_size, cfg.train.seed, part=built.part, length_step=step, inputs=inputs
    )
    return order, min(order.steps_per_epoch * cfg.train.epochs, cfg.train.max_steps or math.inf)


def _held_out(cfg: Config, job, built: Built, prepared: prepare.Prepared) -> scoring.HeldOut:
    """What the run is scored on: the held-out batches, and the first train.samples records to generate for."""
    samples = [r for r, _ in prepared.held_out[: cfg.train.samples]]
    if job is not None and cfg.train.samples:
        # keras-hub's generate() returns the batch sharded over every process, which no single one can read.
        print("note: no sample generations in a multi-process job; run `finetune generate` on the adapter")
        samples = []
    # Keras feeds evaluate() on TensorFlow through a tf.data signature read off its first batches: one length.
    step = None if cfg.backend == "tensorflow" else batching.length_step(cfg.backend, cfg.model.seq_len, built.device)
    batches = batching.Batches(prepared.held_out_rows, prepared.batch_size, part=built.part, length_step=step,
                               inputs=builder.input_names(built.lm))  # fmt: skip
    scorer = builder.scorer(built.lm, prepared.batch_size, shards=built.part[2])
    return scoring.HeldOut(scorer, batches, built.lm, built.preprocessor, samples, prepared.template,
                           cfg.train.max_new_tokens)  # fmt: skip


def _start(found, trainer, held_out: scoring.HeldOut, phase, config: dict, fingerprint: str) -> tuple:
    """(where training starts, checkpoint.RunState; the seconds it took to get there).

    A new run scores the held-out records and generates its samples at step 0;
    a resumed run restores what its checkpoint `found` kept.
    """
    started = time.perf_counter()
    if found is None:
        phase(f"evaluating before training ({held_out.batches.rows} held-out records)")
        before = held_out.metrics()
        print(f"eval loss before training: {before['loss']:.4f}")
        generated = held_out.generate("before", phase)
        start = checkpoint.RunState(uuid.uuid4().hex[:8], loop.Progress(), before, generated, config, fingerprint)
    else:
        start = checkpoint.RunState.resumed(checkpoint.restore(trainer, found), config, fingerprint)
    return start, time.perf_counter() - started


def _metrics(cfg, built, prepared, steps, start, found, tweaks, distributed, seconds) -> dict:
    """metrics.json: what the run trained, on what, how well and how fast."""
    progress, before, after = steps.progress, start.eval_before, steps.progress.evaluations[-1]
    train_losses = [r["train_loss"] for r in progress.rows if "train_loss" in r]
    return {
        "backend": cfg.backend,
        "preset": cfg.model.preset,
        "rank": cfg.lora.rank,
        "alpha": cfg.lora.resolved_alpha(),
        "targets": list(cfg.lora.targets),
        "adapted_layers": built.adapted,
        "trainable_parameters": builder.trainable_parameters(built.lm),
        "train_examples": len(prepared.train),
        "eval_examples": len(prepared.held_out),
        "batch_size": cfg.train.batch_size,
        "seq_len": cfg.model.seq_len,
        "learning_rate": cfg.train.learning_rate,
        "run_id": start.run_id,
        "steps": progress.step,
        "epochs": math.ceil(progress.step / steps.order.steps_per_epoch),
        "resumed_from_step": found.step if found else None,
        "train_loss": train_losses[-1],
        "eval_loss_before": before["loss"],
        "eval_loss": after["loss"],  # the held-out split is evaluated after every epoch and the last step
        "eval_perplexity_before": before["perplexity"],
        "eval_perplexity": after["perplexity"],
        "eval_accuracy_before": before["accuracy"],
        "eval_accuracy": after["accuracy"],
        "packing": prepared.packed,
        "padding_fraction": prepared.padding["padding_fraction"],
        "padding_fraction_unpacked": prepared.padding["unpacked"],
        "trained_tokens": progress.trained_tokens,
        "response_tokens": progress.response_tokens,
        # Non-padding tokens per second of optimizer steps in this session, its first
        # (compiling) step and every evaluation excluded.
        "tokens_per_second": steps.tokens_per_second(),
        "train_seconds": progress.train_seconds,
        "seconds": seconds,
        "peak_memory_mb": backend.peak_memory_mb(),
        "dtype_policy": tweaks["dtype_policy"],
        "device": tweaks["device"],
        "device_name": tweaks["device_name"],
        "distribution": distributed or {"parallel": "none", "devices": 1, "processes": 1},
    }


def _resolved(claim: outputs.Claim, run_id: str, source: presets.Source, tweaks: dict) -> dict:
    """config.yaml's `resolved`: where the run went, and what it ran on."""
    return {
        "output_dir": str(claim) if claim.remote else str(claim.path.resolve()),
        "run_id": run_id,
        "preset_kind": source.kind,
        "preset_family": source.family,
        "backend_tweaks": tweaks,
        "versions": _versions(),
    }


def _files(built: Built, cfg: Config, source, config: dict, metrics: dict, progress, samples: list) -> dict:
    """What a finished run writes: a file name to write(path), for outputs.publish."""
    history = [{"step": 0, "eval_loss": metrics["eval_loss_before"]}] + progress.rows
    title = f"{cfg.model.preset} LoRA rank {cfg.lora.rank} on {cfg.backend}"
    description = adapter.describe(
        built.lm.backbone, preset=cfg.model.preset, family=source.family, lora=cfg.lora,
        template=cfg.data.template, seq_len=cfg.model.seq_len,
        dtype=metrics["dtype_policy"], quantize=cfg.model.quantize, version=__version__,
    )  # fmt: skip
    return {
        outputs.ADAPTER: lambda p: adapter.save(built.lm.backbone, p),
        outputs.ADAPTER_JSON: lambda p: adapter.write(p, description),
        outputs.CONFIG: lambda p: outputs.write_config(p, config),
        outputs.HISTORY: lambda p: outputs.write_history(p, progress.rows),
        outputs.SAMPLES: lambda p: outputs.write_samples(p, samples),
        outputs.LOSS_PLOT: lambda p: outputs.plot_loss(p, history, title),
        outputs.METRICS: lambda p: outputs.write_metrics(p, metrics),
    }


def divergence_advice(cfg: Config, learning_rate: float) -> str:
    lower = f"{learning_rate / 10:g}"
    precision = "" if cfg.model.precision == "float32" else " or --precision float32"
    return f"Try a lower learning rate (--lr {lower}; this run used {learning_rate:g}){precision}."


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
    return 3 * 4 * builder.trainable_parameters(lm) + 2**20


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
