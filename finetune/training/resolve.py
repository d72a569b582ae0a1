"""resolve(): every setting a run leaves to `auto` or unset, decided once, each with its reason.

A Config is what the user asked for. resolve() turns it into a Resolved run: the same settings with every
`auto` and unset one decided (precision, CPU threads, batch size, learning rate, template, remat, LoRA
alpha, time limit, the mesh), each beside the reason it was decided so. What comes after reads the Resolved
and decides nothing again; the user's Config is never changed. Two values need the built model, whether its
rows pack and `--batch-size auto`: Resolved.settled() fills them in, once, as a second step.

A resumed run inherits what its checkpoint decided (the run goes on as it started, on any machine), and
`finetune eval`, `generate` and `export` rebuild a finished run from what it recorded (finished()).

resolve() also sets the process up for what it decided, because keras reads these globally: the dtype policy,
PyTorch's CPU threads, the seed and the mesh.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from finetune.config import Config, parse_duration
from finetune.data import templates
from finetune.methods import registry
from finetune.model import distribution, families, presets
from finetune.platform import backend, platforms
from finetune.platform.errors import UserError
from finetune.training import loop, plan

KAGGLE_TIME_LIMIT = "11h30m"  # Kaggle sessions end at 12 hours: leave time to save and copy out


@dataclass(frozen=True)
class Decision:
    """A decided setting and why it is what it is."""

    value: Any
    why: str


@dataclass(frozen=True)
class Resolved:
    """A run with every setting decided: what the model is built, trained and recorded as."""

    config: Config
    """The run's settings, each decided one in place: what config.yaml records and a resume compares."""
    decisions: dict = field(hash=False)
    """Setting name -> Decision, in the order the console prints them."""
    source: presets.Source
    device: str
    """cpu, gpu or tpu."""
    device_name: str
    """The device as the console names it: `cpu (AMD EPYC, 2 cores)`."""
    runtime: dict = field(hash=False)
    """What the backend set in this process (backend.select and apply_runtime_tweaks): config.yaml records it."""
    deadline: float | None = None
    """The time.monotonic() instant to stop by."""
    distributed: dict | None = field(default=None, hash=False)
    """The mesh as metrics.json records it; None on one device."""
    part: tuple = (0, 1, 1)
    """The data shards of each batch this process feeds (distribution.data_part)."""

    @property
    def precision(self) -> str:
        return self.config.model.precision

    @property
    def batch_size(self) -> int | str:
        return self.config.train.batch_size

    @property
    def learning_rate(self) -> float:
        return self.config.train.learning_rate

    @property
    def template(self) -> str:
        return self.config.data.template

    @property
    def remat(self) -> bool:
        return self.decisions["remat"].value

    @property
    def alpha(self) -> float:
        return self.decisions["alpha"].value

    @property
    def steps(self) -> int:
        """The optimizer steps the run trains in all; known once settled() has the data's steps per epoch."""
        return self.decisions["steps"].value

    @property
    def warmup_steps(self) -> int:
        return self.decisions["warmup_steps"].value

    @property
    def packed(self) -> bool | None:
        """Whether the training rows pack; None until settled()."""
        decided = self.decisions.get("packing")
        return None if decided is None else decided.value

    @property
    def method(self):
        """The training method (methods/method.Method), as --method named it and decide() checked it."""
        return registry.get(self.config.train.method)

    def recipe(self, train: bool = True):
        """What builder.build_model makes of this run (a builder.Recipe): for training (LoRA fresh, compiled with
        AdamW), or to use a trained adapter (train=False: LoRA in the run's layout, nothing compiled)."""
        from finetune.model import builder  # keras: imported once the backend is chosen

        cfg = self.config
        if not train:
            return dataclasses.replace(builder.adapter_recipe(cfg), remat=self.remat)
        return dataclasses.replace(
            builder.adapter_recipe(cfg),
            remat=self.remat,
            neftune_alpha=cfg.train.neftune_alpha,
            optimizer=builder.Optimizer(
                cfg.train.learning_rate, cfg.train.weight_decay, self.part[2], self.method.objective(cfg.train)
            ),
            keep_base=cfg.model.full and self.method.scores_base(cfg.train),
        )

    def settled(self, **decided: Decision) -> Resolved:
        """This run with the decisions that needed the built model: packing, and batch_size for `auto`."""
        decisions = {**self.decisions, **decided}
        cfg = self.config
        if "batch_size" in decided:
            cfg = _replace(cfg, "train", batch_size=decided["batch_size"].value)
        return dataclasses.replace(self, config=cfg, decisions=decisions)

    def table(self) -> str:
        """The decisions as the console prints them once: setting, value, why."""
        rows = [(name, shown(d.value), d.why) for name, d in self.decisions.items()]
        wide = [max(len(row[i]) for row in rows) for i in range(2)]
        lines = [f"{'setting':<{wide[0]}}  {'value':<{wide[1]}}  why"]
        lines += [f"{name:<{wide[0]}}  {value:<{wide[1]}}  {why}" for name, value, why in rows]
        return "\n".join(lines)

    def recorded(self) -> dict:
        """config.yaml's `resolved` entries: each decided setting as {value, why}."""
        return {name: {"value": d.value, "why": d.why} for name, d in self.decisions.items()}


def resolve(cfg: Config, data_format: str, saved: dict | None = None, images: int = 0, data=None) -> Resolved:
    """Decide every `auto` and unset setting of `cfg` for data of `data_format`, and set the process up for them.

    saved: dict. The config a checkpoint recorded (state.json's), for a resumed run: what it decided then is
        kept, so the run trains on as it started.
    images: int. The most pictures a record of the data holds: what --remat auto's plan counts.
    data: the run's read data (train._read), whose records decide what the method takes from them (a
        classifier's classes: Method.with_data); None leaves those as configured.
    """
    given = cfg.train  # as the user set it: what the method's data decisions (with_data) then fill in
    if data is not None:
        cfg = registry.get(cfg.train.method).with_data(cfg, data.records, data.eval_records)
    source = presets.resolve(cfg.model.preset)
    decisions: dict[str, Decision] = {}
    decisions["template"] = _template(cfg, data_format, saved)
    device = backend.accelerator()
    decisions["precision"] = _precision(cfg, device, saved)
    # select() again: the backend was chosen before keras loaded (it returns what it set, and catches a change)
    runtime = backend.select(cfg.backend, cfg.train.xla_mem_fraction, presets.frameworks_needed(cfg.model.preset))
    runtime.update(backend.apply_runtime_tweaks(decisions["precision"].value, _threads(cfg, saved)))
    if "threads" in runtime:  # PyTorch on a CPU: the count sets the order of its sums, so a resume keeps it
        why = runtime["torch.intra_op_threads"].split(" (", 1)[-1].rstrip(")")
        decisions["threads"] = Decision(runtime["threads"], "resumed: as the run started" if saved else why)
    backend.set_seed(cfg.train.seed)
    decisions["batch_size"] = _batch_size(cfg, saved)
    decisions["learning_rate"] = _learning_rate(cfg, source, saved)
    if images or cfg.data.images is not None:
        decisions["images"] = _images(cfg.data.images, images)
    budget = _image_tokens(cfg, source, saved)
    if budget is not None:
        decisions["image_tokens"] = budget
    if saved is not None:
        _resumed(decisions, saved)
    decided = _decided(cfg, decisions)
    distributed = None
    if cfg.distribution.parallel != "none":  # before the model is built: its weights are made sharded
        distributed = distribution.setup(cfg.distribution, presets.dims(source), decided.train.batch_size)
        mesh = " x ".join(f"{n} {a}" for n, a in zip(distributed["mesh_shape"], distributed["axis_names"]))
        decisions["mesh"] = Decision(mesh, f"--parallel {cfg.distribution.parallel} over {distributed['devices']} "
                                     "devices" + (f" (--mesh {cfg.distribution.mesh})" if cfg.distribution.mesh
                                                  else ""))  # fmt: skip
    decisions["remat"] = Decision(*plan.remat_for(decided, device, backend.device_memory(device)))
    plan.check_full_fits(decided, device, backend.device_memory(device))  # --full: refused where it cannot fit
    decisions["alpha"] = alpha(cfg.lora)
    chosen = registry.get(cfg.train.method)
    for name, (value, why) in registry.decide(cfg.train, data_format).items():
        # A setting the user gave is theirs, whatever the method would have decided from the data (--labels).
        decisions[name] = Decision(value, "set" if name != "method" and getattr(given, name, None) else why)
    decided = _replace(decided, "train", **{name: decisions[name].value for name in chosen.defaults})
    limit, deadline = _time_limit(cfg.train.time_limit)
    decisions["time_limit"] = limit
    return Resolved(decided, decisions, source, device, runtime["device_name"], runtime, deadline, distributed,
                    distribution.data_part())  # fmt: skip


def finished(cfg: Config) -> Resolved:
    """A finished run rebuilt from its config.yaml, which recorded every decision: to evaluate, generate from or
    export its adapter. Only the process is set up again, in the precision and threads the run trained in."""
    source = presets.resolve(cfg.model.preset)
    device = backend.accelerator()
    precision = cfg.model.precision
    if precision == "auto":  # a config.yaml written by hand
        precision = backend.auto_precision(device, families.get(source.family).float16_overflows)
    runtime = backend.apply_runtime_tweaks(precision, cfg.train.threads)
    decisions = {
        "precision": Decision(precision, "as the run trained"),
        "remat": Decision(False, "not training"),
        "alpha": alpha(cfg.lora),
    }
    decided = _replace(cfg, "model", precision=precision)
    return Resolved(decided, decisions, source, device, runtime["device_name"], runtime)


def alpha(lora) -> Decision:
    """LoRA's alpha (the update is scaled by alpha / rank): the user's, or the rank, keras-hub's scale of 1.

    lora: config.LoraConfig.
    """
    if lora.alpha is not None:
        return Decision(lora.resolved_alpha(), "set")
    why = "the rank: a scale of 1/sqrt(rank) with --rslora" if lora.rslora else "the rank: a scale of 1, keras-hub's"
    return Decision(lora.resolved_alpha(), why)


def _threads(cfg: Config, saved: dict | None) -> int | None:
    """PyTorch's CPU threads to ask for: the user's count, else the one a resumed run started with (its sums'
    order follows the count, so a resume keeps it), else None: backend.torch_threads picks the idle cores."""
    if cfg.train.threads is not None:
        return cfg.train.threads
    return _saved(saved, "train", "threads")


def steps(train, steps_per_epoch: int) -> dict:
    """{steps, warmup_steps}: the optimizer steps the run trains and warms up over, for Resolved.settled().

    train: config.TrainConfig. --max-steps is Hugging Face's max_steps: exactly that many steps, over as many
        passes of the data as they take, --epochs unused; without it, every step of --epochs passes.
    steps_per_epoch: int. Optimizer steps in one pass over the training rows (batching.TrainOrder).
    """
    from finetune.model import optimizer

    if train.max_steps is None:
        total = steps_per_epoch * train.epochs
        decided = Decision(total, f"{train.epochs} epochs of {steps_per_epoch} steps")
    else:
        passes = train.max_steps / steps_per_epoch
        decided = Decision(train.max_steps, f"max steps {train.max_steps}: {passes:.3g} passes of {steps_per_epoch} "
                                            "steps; --epochs is ignored")  # fmt: skip
    warmup = optimizer.warmup_steps_for(decided.value, train.warmup_steps, train.warmup_ratio)
    if train.warmup_steps is not None:
        why = "set"
    elif train.warmup_ratio:
        why = f"--warmup-ratio {train.warmup_ratio:g} of {decided.value} steps, rounded up as transformers does"
    else:
        why = "none asked"
    return {"steps": decided, "warmup_steps": Decision(warmup, why)}


def plan_notes(cfg, total: int, warmup: int, steps_per_epoch: int) -> list[str]:
    """What the run's length leaves some controls unable to do, as notes: a warmup as long as the run, an
    --eval-every past its end, an --early-stop or --keep-best with too few evaluations to act on."""
    notes = []
    if warmup >= total > 0:
        notes.append(f"the warmup takes {warmup} steps and the run {total}: the learning rate never reaches --lr "
                     f"(its last step trains at {(total - 1) / max(1, warmup):.2g}x it); lower --warmup-steps or "
                     "--warmup-ratio")  # fmt: skip
    every = cfg.eval.every
    evaluations = sum(loop.evaluates_after(step, every, steps_per_epoch, total) for step in range(1, total + 1))
    if every and every > total:
        notes.append(f"--eval-every {every} is past the run's {total} steps: the held-out split is scored "
                     f"{evaluations} time{'s' * (evaluations != 1)}, at each epoch's end and the last step")  # fmt: skip
    if cfg.eval.early_stop is not None and evaluations <= cfg.eval.early_stop:
        notes.append(f"--early-stop {cfg.eval.early_stop} needs more evaluations than the run's {evaluations} "
                     "to stop it early; lower --eval-every for more")  # fmt: skip
    if cfg.eval.keep_best and evaluations < 2:
        notes.append("--keep-best has one evaluation to choose from: the run publishes its last step's adapter")
    return notes


def replanned(train, saved: dict, steps_per_epoch: int, done: int) -> str | None:
    """What a resume that trains to another end than first planned does to the learning-rate schedule, as a note:
    the decay (linear, cosine) and a --warmup-ratio are planned over the run's steps, so they stretch over the new
    total from the step the checkpoint reached; None where no step's rate changes.

    train: config.TrainConfig. The resumed run's (schedule, warmup and floor are the checkpoint's: RESUME_KEYS).
    saved: dict. The checkpoint's config (state.json's).
    done: int. The steps the checkpoint trained: the next step is optimizer step `done` (from 0).
    """
    from finetune.model import optimizer

    first = steps(dataclasses.replace(train, **{k: saved["train"].get(k) for k in ("epochs", "max_steps")}),
                  steps_per_epoch)  # fmt: skip
    now = steps(train, steps_per_epoch)
    plans = [(d["warmup_steps"].value, d["steps"].value) for d in (first, now)]
    if plans[0] == plans[1] or (train.lr_schedule == "constant" and all(done >= warmup for warmup, _ in plans)):
        return None
    factors = [
        optimizer.lr_factor(done, train.lr_schedule, warmup, total, train.min_lr_ratio) for warmup, total in plans
    ]
    warmup = f", its warmup over {plans[1][0]} steps, not {plans[0][0]}" if plans[0][0] != plans[1][0] else ""
    return (f"the {train.lr_schedule} learning-rate schedule is planned again over {plans[1][1]} steps, not the "
            f"{plans[0][1]} its checkpoint planned{warmup}: step {done + 1} trains at {factors[1]:.3g}x the peak "
            f"rate, where that plan gave {factors[0]:.3g}x")  # fmt: skip


# The decisions a resumed run takes from its checkpoint, and where the checkpoint's config keeps them.
_RESUMED = {"template": ("data", "template"), "precision": ("model", "precision"), "batch_size": ("train", "batch_size"),
            "learning_rate": ("train", "learning_rate"), "image_tokens": ("data", "image_tokens")}  # fmt: skip


def _resumed(decisions: dict, saved: dict) -> None:
    """Say `resumed` beside a decision whose value came from the checkpoint: `--resume` on the command line takes
    the checkpoint's settings as its own (cli: config.load's base), so they reach here as if they were set."""
    for name, (section, key) in _RESUMED.items():
        if name in decisions and decisions[name].why == "set" and decisions[name].value == _saved(saved, section, key):
            decisions[name] = Decision(decisions[name].value, "resumed: as the run started")


def _decided(cfg: Config, decisions: dict) -> Config:
    """`cfg` with the decided values in place of its `auto` and unset ones."""
    value = {name: d.value for name, d in decisions.items()}
    cfg = _replace(cfg, "model", precision=value["precision"])
    data = {key: value[key] for key in ("images", "image_tokens") if key in value}
    cfg = _replace(cfg, "data", template=value["template"], **data)
    train = dict(batch_size=value["batch_size"], learning_rate=value["learning_rate"])
    if "threads" in value:
        train["threads"] = value["threads"]
    return _replace(cfg, "train", **train)


def _replace(cfg: Config, section: str, **values) -> Config:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})


def _saved(saved: dict | None, section: str, key: str):
    return None if saved is None else saved.get(section, {}).get(key)


def _template(cfg: Config, data_format: str, saved: dict | None) -> Decision:
    """The prompt template: the user's, the one auto chose when a resumed run started, or the data's own."""
    if cfg.data.template == "auto" and saved is not None:
        return Decision(_saved(saved, "data", "template") or "dolly", "resumed: auto chose it when the run started")
    family_chat = families.get(presets.family_of(cfg.model.preset)).chat_template
    name, note = templates.for_data(cfg.data.template, data_format, family_chat, cfg.model.preset, cfg.data.path)
    if note is None:
        return Decision(name, "set")
    return Decision(name, f"auto: for {data_format} records (--template names another)")


def _precision(cfg: Config, device: str, saved: dict | None) -> Decision:
    """The base's dtype: the user's, the one auto became when a resumed run started (wherever it resumes), or
    backend.precision_rule's for this device and the preset's family, which never picks float16 for a family whose
    activations pass its range. float16 on such a family is the user's to ask for: it is warned about, once, here."""
    overflows = families.get(presets.family_of(cfg.model.preset)).float16_overflows
    if cfg.model.precision != "auto":
        decided = Decision(cfg.model.precision, "set")
    elif saved is not None:
        decided = Decision(_saved(saved, "model", "precision"), "resumed: auto chose it when the run started")
    else:
        decided = Decision(*backend.auto_precision_why(device, overflows))
        if decided.value == "float16" and cfg.model.quantize == "int8":  # keras' int8 layers refuse float16
            return Decision("float32", f"auto: {decided.why.removeprefix('auto: ')}, but float32 for an int8 base, "
                                       "which keras does not compute in float16")  # fmt: skip
        return Decision(*backend.full_weights_precision(decided.value, decided.why)) if cfg.model.full else decided
    if decided.value == "float16" and overflows:
        print(f"warning: --precision float16: {overflows}; --precision float32 (or bfloat16 on a bf16 device) "
              "computes it right")  # fmt: skip
        return Decision(decided.value, f"{decided.why}; warned: {overflows}")
    return decided


def _batch_size(cfg: Config, saved: dict | None) -> Decision:
    """Rows per step: the user's, the one a resumed run started with, to be probed (`auto`), or the backend's
    default made to split over the mesh's data axis."""
    chosen = cfg.train.batch_size
    if chosen not in (None, "auto"):
        return Decision(chosen, "set")
    if saved is not None:
        return Decision(_saved(saved, "train", "batch_size"), "resumed: as the run started")
    if chosen == "auto":
        return Decision("auto", "probed on the built model")
    batch_size = backend.DEFAULT_BATCH_SIZE[cfg.backend]
    why = f"the {cfg.backend} default"
    batch_size, fitted = distribution.fit_to_data_axis(cfg.distribution, batch_size)
    return Decision(batch_size, f"{why}; {fitted}" if fitted else why)


def _images(chosen: int | None, found: int) -> Decision:
    """Pictures per example, as the plan counts them: the data's, which wins over --images (a setting for plans)."""
    if chosen is None or chosen == found:
        return Decision(found, "the most a record of the data holds")
    return Decision(found, f"the most a record of the data holds; --images {chosen} is for plans without the data")


def _image_tokens(cfg: Config, source: presets.Source, saved: dict | None) -> Decision | None:
    """A picture's soft tokens (--image-tokens): the user's, which the preset's family must take, or the one a
    resumed run started with; None: the preset's own."""
    chosen = cfg.data.image_tokens
    families.get(source.family).check_image_tokens(chosen)
    if chosen is not None:
        return Decision(chosen, "set")
    if _saved(saved, "data", "image_tokens") is not None:
        return Decision(_saved(saved, "data", "image_tokens"), "resumed: as the run started")
    return None


def _learning_rate(cfg: Config, source: presets.Source, saved: dict | None) -> Decision:
    if cfg.train.learning_rate is not None:
        return Decision(cfg.train.learning_rate, "set")
    if saved is not None:
        return Decision(_saved(saved, "train", "learning_rate"), "resumed: as the run started")
    return Decision(*presets.default_learning_rate(source))


def _time_limit(time_limit: str | None) -> tuple[Decision, float | None]:
    """(the time limit and why, the time.monotonic() instant to stop by or None)."""
    why = "set"
    if time_limit is None and platforms.in_kaggle_notebook():
        time_limit, why = KAGGLE_TIME_LIMIT, "a Kaggle notebook: its session ends at 12 hours"
    if time_limit is None or time_limit == "off":
        return Decision("off", "set" if time_limit == "off" else "none asked"), None
    return Decision(time_limit, why), time.monotonic() + parse_duration(time_limit)


def packing(lm, setting: str, method, pictured: bool = False) -> Decision:
    """Whether the run packs rows: `auto` and `on` do, when every decoder block takes the per-example mask, on
    text: SFT's examples several to a row, a preference method's pairs as data/pair_packing.py lays them.

    method: methods.method.Method. The run's; one whose rows cannot pack says why (Method.unpacked_why).
    pictured: bool. The data has images or audio. A model with an encoder takes keras-hub's own mask (attention.py),
        so rows of several examples would attend across them; its rows are not packed.
    Packed rows split over --parallel's data shards as padded ones do (a packed micro-batch of pairs too:
    pair_packing.inputs), so the mesh decides nothing here.
    """
    from finetune.model import attention

    if setting == "off":
        return Decision(False, "set")
    why = method.unpacked_why()
    if why:  # --packing on was refused with the settings (registry.check)
        print(f"note: packing off: {why}")
        return Decision(False, f"auto: {why}")
    sees = any(getattr(lm.backbone, name, None) is not None for name in ("vision_encoder", "audio_encoder"))
    if pictured or sees:
        what = "the data has images or audio, and such a row" if pictured else "a model with an image or audio encoder"
        why = f"{what} takes keras-hub's own mask, not the per-example one"
        if setting == "on":
            raise UserError(f"--packing on: {why}; pass --packing off or auto")
        print(f"note: packing off: {why}")
        return Decision(False, f"auto: {why}")
    if attention.packs_exactly(lm.backbone):
        why = f"auto: the decoder blocks take the per-example mask ({method.examples} packed)"
        return Decision(True, "set" if setting == "on" else why)
    why = f"{type(lm.backbone).__name__}'s decoder blocks cannot take the per-example mask (attention.py)"
    if setting == "on":
        raise UserError(f"--packing on: {why}; pass --packing off or auto")
    print(f"note: packing off: {why}")
    return Decision(False, f"auto: {why}")


def shown(value) -> str:
    """A decided value as the table shows it."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
