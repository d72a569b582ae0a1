"""Save, find, check and load a run's trainable state, for an exact resume after a kill.

A checkpoint holds only what training changes: the LoRA weights, the optimizer's
variables (its iteration count included) and the loop's position and records.
The frozen base is never written; a resume rebuilds it from the preset.

    <run>/checkpoints/step-00000100-<run_id>/
        weights.npz     trainable variables, in order; their paths are in state.json
        optimizer.npz   optimizer variables, in order
        state.json      step, config, data fingerprint, history and metrics so far
        best.npz        with --keep-best: the trainable variables at the best evaluation so far
        order.npz       what the data order needs to go on exactly (GRPO's batch of rollouts part way through
                        the --num-iterations steps that train on it), where it needs anything
        manifest.json   size and sha256 of the files above: written last

Writes are atomic the way Orbax's are: the files go into a hidden temporary
directory beside the final one, each flushed and fsynced, the manifest last;
then the directory is renamed into place and its parent fsynced. A crash at any
instant leaves the previous checkpoint or the new one, and a directory without a
manifest that matches its files is never loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from finetune import config as config_module
from finetune.methods import registry
from finetune.platform import storage
from finetune.platform.errors import UserError
from finetune.platform.version import __version__
from finetune.training import loop

DIRECTORY = "checkpoints"
MANIFEST = "manifest.json"
FILES = ("weights.npz", "optimizer.npz", "state.json")
BEST = "best.npz"
ORDER = "order.npz"
FORMAT = 1


@dataclass
class RunState:
    """What a checkpoint keeps of a run beside its weights (state.json), and what a resume takes up again.

    Args:
        run_id: str. Names the run's checkpoints, so that a replaced run's are told apart.
        progress: loop.Progress. Where training is; the loop advances it.
        eval_before: dict. The held-out metrics before training.
        generated_before: list of str. The samples' generations before training.
        config: dict. The run's settings (outputs.run_config): a resume checks its own against them.
        data_fingerprint: str. The records' (data.fingerprint): a resume refuses data that changed.
        reference: dict. DPO's reference log-probabilities, {"train": [[chosen, rejected], ...], "held_out": ...},
            computed once before training: a resumed run reads them here and never recomputes them (its adapter
            is no longer the base's). None for the other methods.
        eval_data_fingerprint: str. The --eval-data file's records' (None without one): a resume refuses a
            held-out set that changed, since the scores before and after would not compare.
        packed: bool. Whether the rows packed, as --packing decided on the built model: a resume compares what
            its own setting decides with this, not with the setting (auto packs one method's rows and not another's).
    """

    run_id: str
    progress: loop.Progress
    eval_before: dict
    generated_before: list
    config: dict
    data_fingerprint: str
    reference: dict | None = None
    eval_data_fingerprint: str | None = None
    packed: bool | None = None

    @classmethod
    def resumed(cls, state: dict, config: dict, fingerprints: tuple) -> RunState:
        """A checkpoint's state, taken up with this session's config (it may train further) and records
        (fingerprints: the training records' and the --eval-data records', as check_compatible compared them)."""
        progress = loop.Progress.from_state(state["progress"])
        progress.best_weights = state.get("best_weights")
        progress.order_arrays = state.get("order_arrays")
        return cls(state["run_id"], progress, state["eval_before"], state["generated_before"], config, fingerprints[0],
                   state.get("reference"), fingerprints[1])  # fmt: skip

    def to_state(self, progress: loop.Progress) -> dict:
        """state.json at `progress` (self.progress, as the loop passes it), less the variables' paths; with the
        best weights (--keep-best), which save() writes to best.npz."""
        best = {} if progress.best_weights is None else {"best_weights": progress.best_weights}
        order = {} if progress.order_arrays is None else {"order_arrays": progress.order_arrays}
        return (
            best
            | order
            | {
                "run_id": self.run_id,
                "finetune_version": __version__,
                "step": progress.step,
                "config": self.config,
                "data_fingerprint": self.data_fingerprint,
                "eval_data_fingerprint": self.eval_data_fingerprint,
                "eval_before": self.eval_before,
                "generated_before": self.generated_before,
                "progress": progress.to_state(),
            }
            | ({} if self.reference is None else {"reference": self.reference})
            | ({} if self.packed is None else {"packed": self.packed})
        )


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded: torn, corrupt or from another format."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    run_id: str
    created: float

    def state(self) -> dict:
        return json.loads((self.path / "state.json").read_text(encoding="utf-8"))


def save(run_dir: Path, run_id: str, step: int, weights, optimizer, state: dict) -> Checkpoint:
    """Write one checkpoint atomically; returns it. Raises OSError (disk full, unwritable).

    state: dict. state.json's; its `best_weights` and `order_arrays`, when there, go to best.npz and order.npz.
    """
    state = dict(state)
    best = state.pop("best_weights", None)
    order = state.pop("order_arrays", None)
    parent = Path(run_dir) / DIRECTORY
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / f"step-{step:08d}-{run_id}"
    n = 1
    while final.exists():  # the same step saved again (an evaluation added on resume): never replace one
        n += 1
        final = parent / f"step-{step:08d}-{run_id}-{n}"
    temporary = parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        contents = {
            "weights.npz": _npz(weights),
            "optimizer.npz": _npz(optimizer),
            "state.json": json.dumps(state, allow_nan=False, indent=1).encode("utf-8"),
        }
        if best is not None:
            contents[BEST] = _npz(best)
        if order is not None:
            buffer = io.BytesIO()
            np.savez(buffer, **order)
            contents[ORDER] = buffer.getvalue()
        for name, payload in contents.items():
            storage.write_synced(temporary / name, payload)
        created = time.time()
        manifest = {
            "format": FORMAT,
            "step": step,
            "run_id": run_id,
            "created": created,
            "files": {name: {"bytes": len(p), "sha256": hashlib.sha256(p).hexdigest()} for name, p in contents.items()},
        }
        storage.write_synced(temporary / MANIFEST, json.dumps(manifest, indent=1).encode("utf-8"))
        storage.fsync_directory(temporary)
        os.rename(temporary, final)
        storage.fsync_directory(parent)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return Checkpoint(final, step, run_id, created)


def find(run_dir: Path, verify: bool = False) -> list[Checkpoint]:
    """The run's checkpoints whose manifest matches their files, oldest first.

    verify: bool. Also check every file's sha256, not only its size.
    """
    parent = Path(run_dir) / DIRECTORY
    if not parent.is_dir():
        return []
    found = []
    for path in parent.iterdir():
        if path.name.startswith(".") or not path.is_dir():
            continue  # a temporary directory left by a crash
        try:
            found.append(_checked(path, verify))
        except CheckpointError:
            continue
    return sorted(found, key=lambda c: (c.created, c.step))


def problems(run_dir: Path, after: int = -1) -> list[str]:
    """Why each checkpoint directory that cannot be loaded is refused, for messages, oldest first.

    after: int. Only those named with a later step (a resume from that step skips them).
    """
    parent = Path(run_dir) / DIRECTORY
    found = []
    for path in sorted(parent.iterdir()) if parent.is_dir() else []:
        named = re.match(r"step-(\d+)-", path.name)  # save()'s name: a damaged one's step is read from it
        step = int(named.group(1)) if named else -1
        if path.name.startswith(".") or not path.is_dir() or (after >= 0 and step <= after):
            continue
        try:
            _checked(path, verify=True)
        except CheckpointError as e:
            found.append(str(e))
    return found


def latest(run_dir: Path) -> Checkpoint | None:
    """The newest checkpoint that is whole, checksums included."""
    for candidate in reversed(find(run_dir)):
        try:
            return _checked(candidate.path, verify=True)
        except CheckpointError:
            continue
    return None


def load(checkpoint: Checkpoint) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
    """(trainable values, optimizer values, state), checked against the manifest."""
    _checked(checkpoint.path, verify=True)
    weights = _arrays(checkpoint.path / "weights.npz")
    optimizer = _arrays(checkpoint.path / "optimizer.npz")
    state = checkpoint.state()
    if (checkpoint.path / BEST).is_file():
        state["best_weights"] = _arrays(checkpoint.path / BEST)
    if (checkpoint.path / ORDER).is_file():
        with np.load(checkpoint.path / ORDER, allow_pickle=False) as stored:
            state["order_arrays"] = {name: stored[name] for name in stored.files}
    return weights, optimizer, state


def prune(run_dir: Path, run_id: str, keep: int) -> None:
    """Delete this run's checkpoints but the newest `keep`, and any left by a replaced run."""
    found = find(run_dir)
    ours = [c for c in found if c.run_id == run_id]
    for checkpoint in ours[:-keep]:
        _remove(checkpoint.path)
    for path in (Path(run_dir) / DIRECTORY).glob(".tmp-*"):
        shutil.rmtree(path, ignore_errors=True)


def remove_others(run_dir: Path, run_id: str) -> None:
    """Delete checkpoints of other runs once this one has finished in their place (--overwrite)."""
    for checkpoint in find(run_dir):
        if checkpoint.run_id != run_id:
            _remove(checkpoint.path)


def _remove(path: Path) -> None:
    """Delete a checkpoint: renamed out of sight first, so a kill part way leaves a hidden .tmp- directory, which
    the next prune removes, not a torn checkpoint that find() skips and nothing would ever remove."""
    hidden = path.parent / f".tmp-gone-{path.name}"
    try:
        os.rename(path, hidden)
    except OSError:
        hidden = path
    shutil.rmtree(hidden, ignore_errors=True)


def _checked(path: Path, verify: bool) -> Checkpoint:
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
        if not set(FILES) <= set(manifest["files"]):
            raise CheckpointError(f"{path}: its manifest lists no {sorted(set(FILES) - set(manifest['files']))[0]}")
        for name in manifest["files"]:
            if name not in (*FILES, BEST, ORDER):
                raise CheckpointError(f"{path}: its manifest lists an unknown file {name!r}")
            expected = manifest["files"][name]
            file = path / name
            if file.stat().st_size != expected["bytes"]:
                raise CheckpointError(f"{file} is {file.stat().st_size} bytes, its manifest says {expected['bytes']}")
            if verify and hashlib.sha256(file.read_bytes()).hexdigest() != expected["sha256"]:
                raise CheckpointError(f"{file} does not match its checksum")
        return Checkpoint(path, int(manifest["step"]), str(manifest["run_id"]), float(manifest["created"]))
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not a whole checkpoint ({type(e).__name__})") from e


def _npz(arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, *[np.asarray(a) for a in arrays])
    return buffer.getvalue()


def _arrays(path: Path) -> list[np.ndarray]:
    with np.load(path, allow_pickle=False) as stored:
        return [stored[f"arr_{i}"] for i in range(len(stored.files))]


# Settings a resumed run must share with its checkpoint: anything else would not continue
# the same training. epochs, max_steps, checkpointing and the output settings may change.
RESUME_KEYS = (
    ("model", "preset"), ("model", "seq_len"), ("model", "precision"), ("model", "quantize"), ("model", "full"), ("lora", "rank"), ("lora", "alpha"),
    ("lora", "targets"), ("data", "template"), ("data", "drop_context"), ("data", "categories"),
    ("data", "max_records"), ("data", "eval_fraction"), ("data", "train_on_prompt"), ("data", "packing"), ("data", "image_tokens"),
    ("train", "batch_size"), ("train", "learning_rate"), ("train", "weight_decay"), ("train", "seed"),
    ("train", "lr_schedule"), ("train", "warmup_steps"), ("train", "warmup_ratio"), ("train", "min_lr_ratio"),
    ("train", "grad_accum"), ("train", "max_grad_norm"), ("train", "method"), ("train", "beta"), ("train", "label_smoothing"),
    ("train", "simpo_gamma"), ("train", "num_generations"), ("train", "max_completion_length"), ("train", "temperature"),
    ("train", "top_p"), ("train", "epsilon"), ("train", "epsilon_high"), ("train", "num_iterations"),
    ("train", "loss_type"), ("train", "scale_rewards"), ("train", "reward"), ("train", "reward_weights"), ("train", "center_rewards"),
    ("train", "group_by_length"), ("eval", "keep_best"),  # the best so far is kept from the start, or there is none to publish
    ("lora", "dropout"), ("lora", "rslora"), ("lora", "dora"), ("lora", "plus_ratio"), ("model", "add_tokens"),
    ("train", "neftune_alpha"), ("train", "embedding_lr"), ("train", "labels"), ("train", "normalize_advantages"),
)  # fmt: skip
# Keys RESUME_KEYS gained after checkpoints were written without them: such a checkpoint's value is unknown.
# (--reward compares the functions' names, not their bodies: the same FILE.py:FUNCTION, fixed, resumes.)
_LATER_KEYS = {"dropout", "rslora", "dora", "plus_ratio", "add_tokens", "neftune_alpha", "embedding_lr", "labels",
               "reward", "normalize_advantages"}  # fmt: skip


def check_method(found: Checkpoint | None, cfg, target) -> None:
    """Refuse a resume under another method first: the checkpoint's settings are its method's (a DPO run's
    label_smoothing), which another method's checks would name as if the user had passed them."""
    if found is None:
        return
    then = found.state()["config"].get("train", {}).get("method") or "sft"
    if then != cfg.train.method:
        raise UserError(
            f"cannot resume {target}: its checkpoint was trained with train.method={then!r}, this run asks for "
            f"{cfg.train.method!r}; drop that setting to continue, or start a new run with another --output"
        )


def to_resume(target, output, resume: bool, published: dict | None) -> Checkpoint | None:
    """The checkpoint a run continues from: with --resume, the newest valid one in `target`.

    Without one the run starts afresh in `target`, with a note, unless a finished
    run is there: that one has nothing to resume, and is refused without --overwrite.

    Args:
        target: outputs.Target. The run directory.
        output: config.OutputConfig. Its --overwrite.
        published: dict. The metrics.json in `target` (outputs.read_metrics); None when there is none.
    """
    if not resume:
        return None
    found = newest(target.path)
    if found is None:
        if published is not None and not output.overwrite:
            raise UserError(f"{target} holds a finished run without checkpoints; pass --overwrite to train again")
        replacing = ", replacing the finished one (--overwrite)" if published is not None else ""
        print(f"note: no checkpoint in {target} to resume from; starting a new run there{replacing}")
    for reason in problems(target.path, after=found.step) if found is not None else ():
        print(
            f"note: a later checkpoint cannot be loaded ({reason}); resuming from step {found.step}, so the steps "
            "after it train again"
        )
    return found


def check_resume_end(found: Checkpoint | None, total_steps: int, target, published: dict | None) -> str | None:
    """Refuse a resume past the run's new end; say why there is nothing to do for a run already published from
    this checkpoint at its end (finished, or stopped early): a job restarted from the top with `--resume` then
    ends as its first attempt did, exit 0, its results as they were. None: the resume trains.

    A run whose last checkpoint is its final step but has no results of that
    checkpoint (killed while publishing) is resumed: it only publishes.

    published: dict. The metrics.json in `target` (outputs.read_metrics); None when there is none.
    """
    if found is None:
        return None
    if found.step > total_steps:
        raise UserError(
            f"{target} has trained {found.step} steps, more than the {total_steps} this run asks for; "
            f"raise --max-steps or --epochs to at least that"
        )
    published = published or {}
    if (
        published.get("run_id") == found.run_id
        and published.get("steps") == found.step
        and published.get("stopped_early")
    ):
        return (f"{target} stopped early at step {found.step} (--early-stop) and is finished: nothing to do; start a "
                "new run to train further")  # fmt: skip
    if found.step == total_steps and published.get("run_id") == found.run_id and published.get("steps") == found.step:
        return (f"{target} has already trained {found.step} of {total_steps} steps and is finished: nothing to do; "
                "raise --epochs or --max-steps to train further")  # fmt: skip
    return None


def newest(run_dir: Path) -> Checkpoint | None:
    """The checkpoint a --resume continues from; None if `run_dir` has none; refuses if none can be loaded."""
    found = latest(run_dir)
    if found is None:
        broken = problems(run_dir)
        if broken:
            raise UserError(
                f"cannot resume {run_dir}: no checkpoint there can be loaded ({broken[-1]}); "
                "pass --overwrite to start again"
            )
    return found


def check_compatible(found: Checkpoint | None, cfg, fingerprints: tuple, target: Path) -> None:
    """Refuse a resume from `found` that would not continue the same training: `cfg` (the resolved run's, which
    took up what the checkpoint decided) must ask for the same, on the same records and held-out records.

    fingerprints: (the training records', the --eval-data records' or None), formats.fingerprint's.
    """
    if found is None:
        return
    saved = found.state()
    if "lr_schedule" not in saved["config"].get("train", {}):
        # finetune 0.1.0 wrote checkpoints before learning-rate schedules and clipping: its optimizer state is
        # another optimizer's, so no setting could make this run continue it.
        raise UserError(
            f"cannot resume {target}: its checkpoint was written by finetune 0.1.0, whose optimizer state this "
            f"version ({__version__}) cannot continue; start a new run with another --output"
        )
    ours = cfg.to_dict()
    for section, key in RESUME_KEYS:
        then, now = saved["config"].get(section, {}).get(key), ours[section][key]  # .get: keys added since
        if key in _LATER_KEYS and key not in saved["config"].get(section, {}):
            continue
        if key in ("keep_best", "full", "group_by_length"):  # from before the setting: no best, LoRA, shuffled
            then = bool(then)
        if key == "method":  # a checkpoint from before preference methods trained SFT
            then = then or "sft"
        if key == "reward" and isinstance(then, list):  # written before reward files were kept absolute
            then = [config_module.absolute_reward(spec) for spec in then]
        if key == "packing":
            then, now = _packing(saved, then, now, registry.get(cfg.train.method))
        if then != now:
            raise UserError(
                f"cannot resume {target}: its checkpoint was trained with {section}.{key}={then!r}, this run asks "
                f"for {now!r}; drop that setting to continue, or start a new run with another --output"
            )
    if saved["data_fingerprint"] != fingerprints[0]:
        raise UserError(
            f"cannot resume {target}: the records in {cfg.data.path} differ from those the checkpoint was trained "
            "on; restore that data, or start a new run with another --output"
        )
    # A checkpoint from before this was recorded has no key: its held-out records cannot be checked.
    if "eval_data_fingerprint" in saved and saved["eval_data_fingerprint"] != fingerprints[1]:
        now = (
            f"the records in --eval-data {cfg.eval.data}"
            if cfg.eval.data
            else "this run's held-out records (no --eval-data)"
        )
        raise UserError(
            f"cannot resume {target}: {now} differ from those its checkpoint was evaluated on; "
            "restore that data, or start a new run with another --output"
        )


def _packing(saved: dict, then: str | None, now: str, method) -> tuple[str, str]:
    """(how the checkpoint's rows were laid, how this run's --packing would lay them), each "on" or "off".

    A checkpoint keeps what its setting decided (RunState.packed): auto packs the same rows again, so only a
    setting that says otherwise differs. One from before it was kept is taken as its setting said: auto is on.
    method: methods.method.Method. The run's: auto never packs rows it cannot (Method.unpacked_why).
    """
    packed = saved.get("packed")
    if packed is None:
        return ("off" if then == "off" else "on"), ("off" if now == "off" else "on")
    then = "on" if packed else "off"
    if now == "auto" and saved["config"]["data"].get("packing") != "off":
        return then, then  # decides as the run's own auto did
    if now == "auto":  # after a run set off, auto packs where the method's rows can pack
        return then, "off" if method.unpacked_why() else "on"
    return then, now


def kept(lm) -> list:
    """The model's variables a checkpoint holds: the trainable ones, and the state of its random seeds (LoRA
    dropout's, NEFTune's), so that a resumed run draws the masks and noise the whole run would have."""
    seeds = [v for v in lm.non_trainable_variables if v.path.endswith("seed_generator_state")]
    return list(lm.trainable_variables) + seeds


def capture(lm) -> tuple[list[np.ndarray], list[np.ndarray], list[str], list[str]]:
    """(model values, optimizer values, their paths): what a checkpoint holds of the model (kept)."""
    weights = [np.asarray(v.numpy()) for v in kept(lm)]
    optimizer = [np.asarray(v.numpy()) for v in lm.optimizer.variables]
    return weights, optimizer, [v.path for v in kept(lm)], [v.path for v in lm.optimizer.variables]


def save_trainer(run_dir: Path, trainer, state: dict, divergence_advice: str = "") -> Checkpoint:
    """Checkpoint the trainer's LoRA weights and optimizer state beside `state` (with its run_id and step).

    Weights that are not finite are refused: training diverged, and a checkpoint
    of them would resume nothing. Raises OSError as save() does.
    """
    weights, optimizer, trainable_paths, optimizer_paths = capture(trainer)
    if not all(np.isfinite(w).all() for w in weights):
        raise UserError(
            f"the LoRA weights are not finite after step {state['step']}: training diverged, so nothing "
            f"was published.\n{divergence_advice}"
        )
    state = {**state, "trainable_paths": trainable_paths, "optimizer_paths": optimizer_paths}
    return save(run_dir, state["run_id"], state["step"], weights, optimizer, state)


def restore(lm, found: Checkpoint) -> dict:
    """Put a checkpoint's LoRA weights and optimizer state back, after checking they fit; returns its state."""
    try:
        weights, optimizer, state = load(found)
    except CheckpointError as e:  # e.g. pruned by a run that held the directory meanwhile
        raise UserError(f"cannot resume from {found.path}: {e}; rerun --resume") from e
    lm.optimizer.build(lm.trainable_variables)
    pairs = [
        (kept(lm), weights, state["trainable_paths"]),
        (lm.optimizer.variables, optimizer, state["optimizer_paths"]),
    ]
    for variables, values, paths in pairs:
        # Paths carry per-instance suffixes (adamw_1/...), so compare their last part, in order.
        leaves = [p.rsplit("/", 1)[-1] for p in paths]
        if len(variables) != len(values) or [v.path.rsplit("/", 1)[-1] for v in variables] != leaves:
            raise UserError(f"checkpoint {found.path} does not match this model's variables; start a new run")
        for variable, value in zip(variables, values):
            if tuple(variable.shape) != value.shape:
                raise UserError(
                    f"checkpoint {found.path}: {variable.path} has shape {value.shape}, the model "
                    f"{tuple(variable.shape)}; start a new run"
                )
            variable.assign(value)
    return state
