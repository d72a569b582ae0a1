"""The run directory: checked before any work, claimed for training, published file by file.

Before training nothing is written. When training starts the directory is
created and locked (an flock, released by the kernel even on SIGKILL), so two
runs can never write into one directory. Checkpoints go into it as training
goes (checkpoint.py). The results are written at the end, each file under a
temporary name, fsynced and renamed, with metrics.json last: its presence marks
a finished run, and --overwrite replaces the old run's results only once the
new run has finished training.

A remote --output (gs://, /gcs/) is staged in a local directory (storage.py) and
copied out by a Mirror: checkpoints as they are saved, and the results once the
run is published, metrics.json last, so the remote run too is finished only
when metrics.json is there. On Vertex AI the environment (platforms.py) names
the output, and further places for checkpoints and TensorBoard logs.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune.methods import registry
from finetune.platform import documents, platforms, storage
from finetune.platform.errors import RunStopped, UserError
from finetune.training import checkpoint, full_model, loop

ADAPTER = "adapter.lora.h5"
TOKEN_ROWS = "adapter.tokens.npy"
"""--add-tokens' embedding rows (new tokens x width, float32), in adapter.json's added_tokens order."""
ADAPTER_JSON = "adapter.json"  # what the adapter was trained on (adapter.py)
METRICS = "metrics.json"
CONFIG = "config.yaml"
STATUS = "status.json"
TENSORBOARD = "tensorboard"
MLRUNS, WANDB = "mlruns", "wandb"  # --report-to mlflow's local store, and W&B's offline runs
LOCK = ".lock"
MARKER = "finetune-run.json"
"""Written first into every directory a run claims: what tells finetune's run directory from a user's folder."""
HISTORY, SAMPLES, LOSS_PLOT = "history.csv", "samples.md", "loss.png"
WEIGHTS, WEIGHTS_JSON = full_model.WEIGHTS, full_model.DESCRIPTION  # a --full run's model, in place of an adapter
RUN_MARKERS = (CONFIG, METRICS, ADAPTER, WEIGHTS)
# Every name a run writes at the top of its directory (checkpoint.DIRECTORY holds the checkpoints).
OWN_NAMES = (ADAPTER, ADAPTER_JSON, WEIGHTS, WEIGHTS_JSON, TOKEN_ROWS, METRICS, CONFIG, STATUS, TENSORBOARD, LOCK, MARKER, HISTORY, SAMPLES, LOSS_PLOT,
             checkpoint.DIRECTORY, MLRUNS, WANDB, *registry.FILES)  # fmt: skip
# The longest name a run writes inside its directory, a checkpoint's temporary file, with room to spare.
INSIDE = len(f"{checkpoint.DIRECTORY}/.tmp-step-000000000-00000000/optimizer.npz") + 32

try:
    import fcntl
except ImportError:  # Windows: no flock; runs still work, unguarded against a second writer.
    fcntl = None


@dataclass
class Target:
    """Where a run goes: `path` is written locally; for a remote --output, `mirror` copies it there."""

    path: Path
    mirror: storage.Mirror | None = None
    default: bool = False
    """The default runs/<timestamp>: claim() may take the next free name."""
    scratch: bool = False
    """A process other than 0 of a multi-process job: its files are not kept (check_run_target)."""

    def __str__(self) -> str:
        return self.mirror.url if self.mirror else str(self.path)


def check_run_target(output, resume: bool, process: int = 0) -> Target:
    """check_target for the process that keeps the run: the only one, or process 0 of a multi-process job.

    Every other process trains and saves alike, into a scratch directory that
    goes when it lets go of its claim: only process 0's files are kept.

    Args:
        output: config.OutputConfig. The --output and --overwrite asked for.
        process: int. This process' index in a multi-process job; 0 alone.
    """
    if process == 0:
        return check_target(output.dir, output.overwrite, resume)
    scratch = Path(tempfile.gettempdir()) / f"finetune-process-{process}-{uuid.uuid4().hex[:8]}"
    return Target(scratch / "run", scratch=True)  # made when training starts, as a run directory is


def check_target(requested: str | None, overwrite: bool, resume: bool) -> Target:
    """The run directory to use; refuses, before any work, one the run could not or must not write to.

    Without --output, a Vertex AI job writes to its AIP_MODEL_DIR. With
    --resume, a remote run's checkpoints are first copied to its staging directory.
    """
    requested = requested if requested is not None else platforms.vertex_model_dir()
    if requested is None and resume:
        raise UserError("--resume needs --output DIR, the run directory to continue")
    if requested is not None and not requested.strip():
        raise UserError("--output is empty (an unset shell variable?); pass the run directory, e.g. --output runs/a")
    for url in [requested, *platforms.vertex_mirror_dirs()]:
        if storage.is_staged(url):
            storage.check_writable(url)  # a bucket we cannot write to is refused now, not after training
    if requested is None:
        return Target(default_dir(), default=True)
    if storage.is_staged(requested):
        return _check_remote(requested, overwrite, resume)
    storage.check_output(requested, "--output", directory=True, inside=INSIDE)
    path = Path(requested)
    if is_locked(path):
        raise UserError(f"another finetune run is writing to {path}; wait for it to end or choose another --output")
    refuse_foreign(path, overwrite, resume)
    if not resume and not overwrite:
        refuse_existing_run(path)
    return Target(path)


def is_run_directory(path: Path) -> bool:
    """Whether `path` is a directory finetune made: its marker, or (made before the marker) a checkpoint or a
    finished run's adapter beside its metrics."""
    if (path / MARKER).exists() or checkpoint.find(path):
        return True
    return (path / METRICS).exists() and ((path / ADAPTER).exists() or (path / WEIGHTS).exists())


def refuse_foreign(path: Path, overwrite: bool, resume: bool) -> None:
    """A folder of the user's is never written into unasked, and a file of theirs is never replaced.

    An existing, non-empty --output that is not a finetune run is refused; with
    --overwrite, finetune writes its files beside the user's, unless one of
    theirs has the name of one of finetune's (samples.md, history.csv, ...):
    that one would be replaced, so the run is refused still.
    """
    if not path.is_dir() or is_run_directory(path):
        return
    present = sorted(entry.name for entry in path.iterdir() if entry.name != LOCK)  # a lock alone is a claim's
    if not present:
        return
    if resume:
        raise UserError(f"--resume: {path} is not a finetune run directory (no {MARKER}); pass the run's --output")
    clashing = [name for name in present if name in OWN_NAMES]
    shown = ", ".join(present[:3]) + (", ..." if len(present) > 3 else "")
    if not overwrite:
        raise UserError(
            f"output directory {path} is not a finetune run and holds files ({shown}); choose a new or empty "
            "--output, or pass --overwrite to write finetune's files beside them"
        )
    if clashing:
        raise UserError(
            f"output directory {path} is not a finetune run, and its {', '.join(clashing)} would be replaced by "
            "the run's; move them or choose another --output (--overwrite replaces only a run's own files)"
        )


def write_marker(path: Path) -> None:
    """Mark `path` as a finetune run directory (claim() writes it first)."""
    from finetune.platform.version import __version__

    body = {"finetune": __version__, "started": _now()}
    write_atomic(path / MARKER, lambda p: p.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8"))


def _check_remote(url: str, overwrite: bool, resume: bool) -> Target:
    """A gs:// or /gcs/ --output: not holding a run we must not replace; staged in a local directory."""
    staging = storage.staging_dir(url)
    if is_locked(staging):
        raise UserError(f"another finetune run is writing to {url}; wait for it to end or choose another --output")
    mirror = run_mirror(staging, url)
    if not resume and not overwrite:
        refuse_existing_remote_run(mirror)
    if resume:
        pull_checkpoints(mirror)
        return Target(staging, mirror)
    # A staging directory is removed once its run is copied out: one still here holds work the bucket lacks.
    if not overwrite and (any((staging / name).exists() for name in RUN_MARKERS) or checkpoint.find(staging)):
        raise UserError(
            f"{staging} holds a run for {url} that was never copied there; pass --resume to finish copying it, "
            "or --overwrite to discard it"
        )
    storage.remove_staging(staging)
    return Target(staging, mirror)


def run_mirror(staging: Path, url: str) -> storage.Mirror:
    # metrics.json marks a finished run and manifest.json a whole checkpoint: each goes after the rest.
    return storage.Mirror(staging, url, last=(METRICS, checkpoint.MANIFEST), prune=checkpoint.DIRECTORY)


def pull_checkpoints(mirror: storage.Mirror) -> None:
    """Copy a remote run's checkpoints and metrics.json to its staging directory, for --resume."""
    try:
        mirror.pull(checkpoint.DIRECTORY, names=(METRICS,))
    except OSError as e:
        raise UserError(f"could not copy the checkpoints of {mirror.url} to {mirror.local}: {e}") from e


def refuse_existing_remote_run(mirror: storage.Mirror) -> None:
    """The remote counterpart of refuse_existing_run."""
    if any(mirror.exists(name) for name in RUN_MARKERS):
        raise UserError(
            f"output {mirror.url} already holds a run; pass --overwrite to replace it or choose another --output"
        )
    found = (
        re.search(r"step-(\d+)", n)
        for n in mirror.remote_files(checkpoint.DIRECTORY)
        if n.endswith(f"/{checkpoint.MANIFEST}")
    )
    steps = [int(m.group(1)) for m in found if m]  # stray files named otherwise are not checkpoints
    if steps:
        step = max(steps)
        raise UserError(
            f"output {mirror.url} holds an unfinished run, checkpointed at step {step}; "
            "pass --resume to continue it, --overwrite to start again, or choose another --output"
        )


def default_dir() -> Path:
    """runs/<timestamp>, under /kaggle/working in a Kaggle notebook (platforms.runs_root)."""
    path = platforms.runs_root() / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    storage.check_output(str(path), "--output", directory=True, beside=4, inside=INSIDE)  # runs/<time>-2 beside it
    return path


def refuse_existing_run(path: Path) -> None:
    """A run (finished, or checkpointed and unfinished) in `path` is never silently replaced."""
    if any((path / name).exists() for name in RUN_MARKERS):
        raise UserError(
            f"output directory {path} already holds a run; pass --overwrite to replace it or choose another --output"
        )
    found = checkpoint.find(path)
    if found:
        raise UserError(
            f"output directory {path} holds an unfinished run, checkpointed at step {found[-1].step}; "
            "pass --resume to continue it, --overwrite to start again, or choose another --output"
        )


def check_free_space(path: Path, needed_bytes: int) -> None:
    """Refuse a run whose checkpoints and adapter would not fit on the disk."""
    existing = storage.nearest_existing(path.resolve())
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise UserError(
            f"{existing} has {free / 2**20:.1f} MB free, and this run needs about {needed_bytes / 2**20:.1f} MB "
            "for its checkpoints and adapter; free some space or pass another --output"
        )


class Claim:
    """A run directory held by this process: created if needed and locked until release().

    remote: Mirror. The remote --output this directory stages, if any.
    mirrors: Mirrors of parts of the directory: on Vertex AI, its checkpoints
        and TensorBoard logs.
    """

    def __init__(self, path: Path, created: bool, lock_file, had_lock: bool = False, remote=None, scratch=False):
        self.path = path
        self.scratch = scratch
        self.created = created
        self.had_lock = had_lock
        self.remote = remote
        # A scratch run's checkpoints and logs are not copied to Vertex AI's directories: its files are not kept.
        mirrors = [] if scratch else vertex_mirrors(path)
        self.mirrors = [m for m in (remote, *mirrors) if m is not None]
        self.had_tensorboard = (path / TENSORBOARD).exists()
        self.tensorboard_files = _files_under(path / TENSORBOARD)  # an --overwrite of a run: its old logs
        self.checkpoints_before = _names_in(path / checkpoint.DIRECTORY)
        self.published = False
        self.finished = False
        """The results are written and status.json says finished: nothing that follows may say otherwise."""
        self._lock_file = lock_file

    def __str__(self) -> str:
        """Where the run is, for people: the remote URL when there is one."""
        return self.remote.url if self.remote else str(self.path)

    def sync(self) -> None:
        """Copy what changed (checkpoints, status, TensorBoard logs) out; a failure is a note, retried next time."""
        for mirror in self.mirrors:
            try:
                mirror.push()
            except Exception as e:  # noqa: BLE001 - network and auth errors differ by file system
                print(f"note: could not copy {mirror.local} to {mirror.url} ({e}); retrying at the next checkpoint")

    def publish_remote(self) -> None:
        """Copy the finished run out: every file, then metrics.json; old checkpoints are pruned after."""
        if self.remote is not None:
            self.remote.delete(METRICS)  # old results are never marked finished beside new files
        for mirror in self.mirrors:
            mirror.push(final=True)
        self.published = True

    def release(self) -> None:
        """Let go of the directory; a staging directory goes too once its run is published remotely."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
        if self.published and self.remote is not None:
            storage.remove_staging(self.path)
        if self.scratch:
            shutil.rmtree(self.path.parent, ignore_errors=True)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def checkpoint(self, trainer, run, keep: int, divergence_advice: str, progress) -> None:
        """Checkpoint `trainer` with the run's state, keep this run's newest `keep`, mark it running in
        status.json, and copy it all out. A disk that is full or will not be written is a UserError that names
        the checkpoint still kept.

        Args:
            run: checkpoint.RunState. The run's state, saved beside the weights.
            divergence_advice: str. What to try when the weights are not finite.
            progress: loop.Progress. Where training is, as the loop passes it.
        """
        try:
            checkpoint.save_trainer(self.path, trainer, run.to_state(progress), divergence_advice)
            checkpoint.prune(self.path, run.run_id, keep)
            write_status(self.path, "running", progress.step)
        except OSError as e:
            last = checkpoint.latest(self.path)
            kept = f"the checkpoint at step {last.step} is intact" if last else "no earlier checkpoint exists"
            raise UserError(
                f"could not write the checkpoint at step {progress.step} to {self.path}: {e.strerror or e}; "
                f"{kept}.\nFree space or fix the directory, then rerun with --resume"
            ) from e
        self.sync()  # to gs:// and Vertex AI's directories, so a preempted job keeps it

    @contextlib.contextmanager
    def training(self, steps):
        """Around the training loop `steps` (loop.Loop): how it ended goes into status.json.

        A stop (a signal, the time limit) is recorded and copied out. Any other
        failure is recorded too; before the first checkpoint, nothing worth
        keeping was written, and the claim is abandoned instead.
        """
        try:
            yield
        except RunStopped as stop:
            write_status(self.path, "stopped", steps.progress.step, str(stop))
            self.sync()
            raise
        except BaseException as error:
            if steps.last_saved is None:
                self.abandon()  # nothing worth keeping was written
            else:
                record_failure(self.path, steps.progress.step, error)
            raise

    @contextlib.contextmanager
    def finishing(self, step: int):
        """Around what follows training (the last samples, the results written): how it ended goes into status.json.

        There is no step to stop after any more, so SIGTERM or Ctrl-C stops at once (RunStopped), leaving no
        result half-written (write_atomic removes its temporary file) and status.json `stopped` at the final
        checkpoint, `step`: --resume writes the results from it. Any other failure is recorded as in training().
        """
        try:
            with _stopping_at_once(step):
                yield
        except RunStopped as stop:
            if not self.finished:
                write_status(self.path, "stopped", step, str(stop))
                self.sync()
            raise
        except BaseException as error:
            if not self.finished:
                record_failure(self.path, step, error)
            raise

    def publish_results(self, files: dict, metrics: dict) -> None:
        """Write the results (publish()), drop the checkpoints of the runs this one replaced, mark it finished,
        copy it out to a remote --output, and report it.

        files: dict. A name to write(path), as publish() takes them.
        """
        step = metrics["steps"]
        try:
            publish(self.path, files)
            checkpoint.remove_others(self.path, metrics["run_id"])
            write_status(self.path, "finished", step)
            self.finished = True
        except OSError as e:
            raise UserError(
                f"could not write the results to {self.path}: {e.strerror or e}; the checkpoint at step {step} "
                "is kept.\nFree space or fix the directory, then rerun with --resume to write them"
            ) from e
        try:
            self.publish_remote()  # every file, then metrics.json
        except Exception as e:  # noqa: BLE001 - network and auth errors differ by file system
            raise UserError(
                f"could not copy the run to {self} ({e}); it is staged in {self.path}.\n"
                "Fix the access, then rerun with --resume to copy it"
            ) from e
        if not self.scratch:
            if metrics["eval_loss"] is not None:  # None: the run held nothing out
                platforms.report_tuning_metric(metrics["eval_loss"], step)
            print(summary_table(metrics, self))

    def abandon(self) -> None:
        """Undo the claim of a run that wrote nothing worth keeping: remove only what it created.

        The removal happens while the lock is still held, so no other run can
        claim the directory in between and lose it.
        """
        try:
            if checkpoint.find(self.path) and _names_in(self.path / checkpoint.DIRECTORY) - self.checkpoints_before:
                return  # a checkpoint of its own: the run resumes from it
            if self.created:
                shutil.rmtree(self.path, ignore_errors=True)
                return
            if not self.had_lock:
                (self.path / LOCK).unlink(missing_ok=True)
            if not self.had_tensorboard:
                shutil.rmtree(self.path / TENSORBOARD, ignore_errors=True)
            for file, size in _files_under(self.path / TENSORBOARD).items():  # beside or after an old run's logs
                if file not in self.tensorboard_files:
                    file.unlink(missing_ok=True)
                elif size > self.tensorboard_files[file]:  # events appended to an old run's file: cut back
                    os.truncate(file, self.tensorboard_files[file])
            empty = self.path / checkpoint.DIRECTORY  # left by a first save that failed
            if empty.is_dir() and not any(empty.iterdir()):
                empty.rmdir()
        finally:
            self.release()


def _files_under(path: Path) -> dict:
    """Every file under `path`, with its size; none where it is no directory."""
    return {p: p.stat().st_size for p in path.rglob("*") if p.is_file()} if path.is_dir() else {}


def _names_in(path: Path) -> set:
    """The names of `path`'s entries; none where it is no directory."""
    return {p.name for p in path.iterdir()} if path.is_dir() else set()


def _stopping_at_once(step: int):
    """The run's signals (loop.StopSignals) while its results are written: SIGTERM and Ctrl-C raise RunStopped where
    the main thread is, and a second signal, while the first stops it, is ignored."""

    def stopped(name: str) -> str:
        return (
            f"{name}: stopped while writing the results of step {step}, whose checkpoint is kept; rerun the same "
            "command with --resume to write them (in Python: finetune.run(cfg, resume=True))"
        )

    return loop.StopSignals.mode(stopped, again=False)


def claim_run(target: Target, overwrite: bool, resume: bool) -> Claim:
    """claim() the target's directory; a scratch run's checkpoints and logs are not copied to Vertex AI's."""
    return claim(
        target.path,
        default=target.default,
        overwrite=overwrite,
        resume=resume,
        mirror=target.mirror,
        scratch=target.scratch,
    )


def claim(
    path: Path, *, default: bool, overwrite: bool, resume: bool, mirror: storage.Mirror | None = None, scratch=False
) -> Claim:
    """Create and lock the run directory; re-checks under the lock that it is still free.

    default: bool. `path` is the default runs/<timestamp>: if another run took
        that name in the same second, use the next free one (-2, -3, ...).
    mirror: Mirror. The remote --output that `path` stages.
    scratch: bool. `path` is the scratch run of a process other than 0 in a multi-process job, whose files are
        not kept: its checkpoints and logs are not copied to Vertex AI's directories, and its parent, made for
        it, goes on release(). Any other run copies them there when Vertex AI sets them.
    """
    created = False
    if default:
        base, n = path, 1
        while True:
            try:
                path.mkdir(parents=True)
                created = True
                break
            except FileExistsError:
                n += 1
                path = base.with_name(f"{base.name}-{n}")
    elif not path.exists():
        path.mkdir(parents=True, exist_ok=True)
        created = True
    had_lock = (path / LOCK).exists()
    held = Claim(path, created, _lock(path), had_lock, remote=mirror, scratch=scratch)
    try:
        refuse_foreign(path, overwrite, resume)  # the user may have put files there since check_target
        if not resume and not overwrite:
            refuse_existing_run(path)  # another run may have finished here since check_target
    except UserError:
        held.abandon()
        raise
    for name in OWN_NAMES:  # a result half-written when a run was killed while publishing
        (path / f".partial.{name}").unlink(missing_ok=True)
    if not (path / MARKER).exists():
        write_marker(path)
    return held


def _lock(path: Path):
    """The open lock file of `path`, flocked; None where locks are not offered (Windows, Cloud Storage FUSE)."""
    if fcntl is None:
        return None
    lock_file = open(path / LOCK, "a+")  # noqa: SIM115 - held open until release()
    for attempt in range(20):  # `finetune runs` probes the lock for an instant: let it pass
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock_file
        except BlockingIOError:
            if attempt == 19:
                lock_file.close()
                raise UserError(
                    f"another finetune run is writing to {path}; wait for it to end or choose another --output"
                ) from None
            time.sleep(0.05)
        except OSError:
            # FUSE mounts such as gcsfuse have no flock: run unguarded rather than not at all.
            lock_file.close()
            print(f"note: {path} cannot be locked (a FUSE mount?); a second run writing there would not be stopped")
            return None


class Reservation:
    """A local run directory held from the run's first check to its end, before the directory's own lock.

    The directory's lock (claim()) is taken once training starts, so that a run refused before then writes
    nothing where it goes; two runs started together into one new directory both evaluated before the second was
    refused. take() flocks a file named for the directory in the temp directory instead, which writes nothing
    there: the second run is refused at once.
    """

    def __init__(self):
        self._file = None

    def take(self, target: Target) -> None:
        """Hold `target`'s directory; a UserError where another run holds it. A default runs/<timestamp> (claim()
        takes the next free name), a scratch or a remote run's staging directory is not held."""
        if fcntl is None or target.default or target.scratch or target.mirror is not None:
            return
        named = hashlib.sha256(str(target.path.expanduser().resolve()).encode()).hexdigest()[:24]
        try:
            folder = Path(tempfile.gettempdir()) / f"finetune-runs-{os.getuid()}"
            folder.mkdir(mode=0o700, exist_ok=True)
            self._file = open(folder / f"{named}.lock", "a+")  # noqa: SIM115 - held open until __exit__
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.__exit__()
            raise UserError(f"another finetune run is writing to {target.path}; wait for it to end or choose another "
                            "--output") from None  # fmt: skip
        except OSError:  # a temp directory that takes no locks: the directory's own lock still guards it
            self.__exit__()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def vertex_mirrors(run_dir: Path) -> list[storage.Mirror]:
    """On Vertex AI: the run's checkpoints copied to AIP_CHECKPOINT_DIR, its TensorBoard logs to AIP_TENSORBOARD_LOG_DIR."""
    found = []
    if platforms.vertex_checkpoint_dir():
        found.append(
            storage.Mirror(
                run_dir / checkpoint.DIRECTORY,
                platforms.vertex_checkpoint_dir(),
                last=(checkpoint.MANIFEST,),
                prune="",
            )
        )
    if platforms.vertex_tensorboard_dir():
        found.append(storage.Mirror(run_dir / TENSORBOARD, platforms.vertex_tensorboard_dir()))
    return found


def is_locked(path: Path) -> bool:
    """Whether a live process holds the run directory `path`."""
    if fcntl is None or not (path / LOCK).exists():
        return False
    try:
        with open(path / LOCK) as f:  # read-only: run directories may be on read-only copies
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return False
    return False


def write_atomic(path: Path, write) -> None:
    """Call write(temporary_path), fsync the result and rename it over `path`."""
    temporary = path.with_name(f".partial.{path.name}")
    try:
        write(temporary)
        storage.fsync_file(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_status(run_dir: Path, state: str, step: int, message: str = "") -> None:
    """status.json: running, stopped, failed or finished, for `finetune runs`."""
    status = {"state": state, "step": step, "message": message, "pid": os.getpid(), "time": _now()}
    write_atomic(run_dir / STATUS, lambda p: p.write_text(json.dumps(status, indent=1) + "\n", encoding="utf-8"))


def record_failure(run_dir: Path, step: int, error: BaseException) -> None:
    """status.json of a run that failed (or was interrupted) after its first checkpoint."""
    if isinstance(error, KeyboardInterrupt):
        state, message = "stopped", "interrupted"
    else:
        state, message = "failed", str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
    try:
        write_status(run_dir, state, step, message)
    except OSError:
        pass  # the disk that failed the run may refuse this too; the checkpoints are what matter


STATES = ("running", "stopped", "failed", "finished")


def read_status(run_dir: Path) -> dict:
    """status.json, checked (checked_status); {} when there is none or it is broken."""
    try:
        return checked_status(run_dir) or {}
    except documents.DocumentError:
        return {}


def read_metrics(run_dir: Path) -> dict | None:
    """The metrics.json of a finished run in `run_dir`: None when there is none, {} when it cannot be read."""
    if not (run_dir / METRICS).exists():
        return None
    try:
        return _document(run_dir / METRICS).value
    except documents.DocumentError:
        return {}


def checked_status(run_dir: Path) -> dict | None:
    """status.json as write_status writes it; None when there is none. A DocumentError names a broken field."""
    found = _document(run_dir / STATUS)
    if found is None:
        return None
    found.field("state", str, check=documents.one_of(*STATES))
    found.field("step", int, check=documents.at_least(0))
    found.field("message", str, required=False)
    return found.value


def checked_metrics(run_dir: Path) -> dict | None:
    """metrics.json, with the fields `finetune runs` shows checked; None when there is none."""
    found = _document(run_dir / METRICS)
    if found is None:
        return None
    found.field("steps", int, check=documents.at_least(0))
    found.field("eval_loss", float, required=found.value.get("eval_examples") != 0)  # 0: nothing held out
    return found.value


def checked_marker(run_dir: Path) -> dict | None:
    """finetune-run.json as write_marker writes it; None when there is none."""
    found = _document(run_dir / MARKER)
    if found is None:
        return None
    found.field("finetune", str, required=False)
    found.field("started", str, required=False)
    return found.value


def _document(path: Path) -> documents.Document | None:
    """A JSON object a run wrote at `path`, named by its file name; None when there is none."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise documents.DocumentError(path.name, f"cannot be read ({e.strerror or e})") from None
    return documents.Document(documents.parse_json(text, path.name), path.name)


def run_config(cfg) -> dict:
    """config.yaml's settings: the run's config as resolved, a recipe for a new run."""
    config = cfg.to_dict()
    # A run's config.yaml is a recipe for a new run: it must not name this directory or replace it. Its trackers
    # stay: a resumed run (whose base this is) reports where it began, and so does a run made from the recipe.
    config["output"] = {**config["output"], "dir": None, "overwrite": False}
    return config


def publish(run_dir: Path, files: dict) -> None:
    """Write the results: `files` maps a name to write(path); metrics.json goes last.

    The old metrics.json goes first, so a crash halfway never leaves old results
    marked as the finished run beside new ones.
    """
    (run_dir / METRICS).unlink(missing_ok=True)
    for name in sorted(files, key=lambda n: n == METRICS):
        write_atomic(run_dir / name, files[name])
    storage.fsync_directory(run_dir)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def write_config(path: Path, config: dict) -> None:
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


def write_metrics(path: Path, metrics: dict) -> None:
    # allow_nan=False: a NaN can never reach a finished run's metrics as a bare `NaN`.
    path.write_text(json.dumps(metrics, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def write_history(path: Path, rows: list[dict]) -> None:
    columns = ["step", "epoch", "train_loss", "learning_rate", "grad_norm", "eval_loss", "eval_accuracy"]
    # A preference run's metrics (data/pair_batches.METRICS and their held-out ones), in the order they come.
    columns += [name for name in dict.fromkeys(key for row in rows for key in row) if name not in columns]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in columns})


SAMPLE_SECTIONS = (("Prompt", "prompt"), ("Reference", "reference"), ("Before training", "before"),
                   ("After training", "after"))  # fmt: skip


def write_samples(path: Path, samples: list[dict], none_why: str = "") -> None:
    """samples.md: each held-out prompt's generations before and after training; none_why: why there are none."""
    lines = ["# Generations on held-out prompts", "", "Greedy decoding, before and after training.", ""]
    if not samples:
        lines += [f"None: {none_why or 'the run generated none'}.", ""]
    for i, sample in enumerate(samples, start=1):
        lines += [f"## Sample {i}", ""]
        for title, key in SAMPLE_SECTIONS:
            if key == "reference" and not sample[key]:  # prompts alone (GRPO): nothing to compare with
                continue
            if sample[key] is None:  # a sample added when the run was resumed: none before training
                lines += [
                    f"**{title}**",
                    "",
                    "(none: the run was resumed asking for more samples than it started with)",
                    "",
                ]
                continue
            lines += [f"**{title}**", "", _fence(sample[key]), ""]
            if f"{key}_score" in sample:  # the method's score of the generation (GRPO's rewards)
                lines += [sample[f"{key}_score"], ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def _fence(text: str) -> str:
    return "````text\n" + text.rstrip("\n") + "\n````"


def plot_loss(path: Path, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["train_loss"]) for r in rows if r.get("train_loss") not in (None, "")]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") not in (None, "")]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss (per step)", color="tab:blue", alpha=0.6, linewidth=1)
    if evals:
        ax.plot(*zip(*evals), label="eval loss (held out)", color="tab:orange", marker="o")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss per response token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summary_table(metrics: dict, run_dir) -> str:
    rows = [
        ("run", str(run_dir)),
        ("backend", metrics["backend"]),
        ("device", f"{metrics['device_name']}, {metrics['dtype_policy']}"),
        ("preset", metrics["preset"]),
        ("trained", "every weight (--full)") if metrics.get("full") else ("LoRA rank", _lora(metrics)),
        ("train steps", str(metrics["steps"])),
        ("padding", _padding(metrics)),
        ("train loss", f"{metrics['train_loss']:.4f}"),
        *_eval_rows(metrics),
        # False: the warning below says why; None: a run from before the guards (guards.py) recorded it.
        *([("adapter", "did not change")] if metrics.get("adapter_changed") is False else []),
        # None when this session trained a single step: that step compiles, so it is not timed.
        ("tokens/s", "n/a" if metrics["tokens_per_second"] is None else f"{metrics['tokens_per_second']:.0f}"),
        ("seconds", f"{metrics['seconds']:.1f}"),
        ("peak memory", f"{metrics['peak_memory_mb']:.0f} MB"),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line] + [f"{k.ljust(width)} | {v}" for k, v in rows] + [line] + _guard_warnings(metrics))


def _lora(metrics: dict) -> str:
    """The LoRA row: its rank, then what it is beside (DoRA, rsLoRA, LoRA+, dropout, a quantized base)."""
    return ", ".join(filter(None, [str(metrics["rank"]), metrics.get("lora_variant")]))


def _guard_warnings(metrics: dict) -> list[str]:
    """The summary's closing warnings: what the guards (guards.py) found, each with its reason."""
    warnings = []
    if metrics.get("adapter_changed") is False:
        warnings.append(f"warning: the adapter did not change: {metrics['adapter_changed_why']}")
    if metrics.get("forward_warning"):
        warnings.append(f"warning: {metrics['forward_warning']}")
    if metrics.get("held_out_warning"):
        warnings.append(f"warning: {metrics['held_out_warning']}")
    return warnings


def _eval_rows(metrics: dict) -> list[tuple[str, str]]:
    """The summary's held-out rows: the loss before and after (of the best step with --keep-best), or why none."""
    if metrics.get("eval_loss") is None:
        return [("eval", "skipped: nothing held out (--eval-fraction 0)")]
    best = f" (best, step {metrics['best_step']})" if metrics.get("best_step") is not None else ""
    method = registry.get(metrics.get("method", "sft"))  # a run from before methods trained SFT
    rows = (
        [("eval loss", f"{metrics['eval_loss_before']:.4f} -> {metrics['eval_loss']:.4f}")] if method.loss_named else []
    )
    digits = {"perplexity": 2}
    for name in method.held_out:
        before, after = metrics.get(f"eval_{name}_before"), metrics.get(f"eval_{name}")
        if after is None:  # a metric the method gained since the run (GRPO's eval_accuracy)
            continue
        shown = [f"{value:.{digits.get(name, 3)}f}" for value in (before, after) if value is not None]
        rows.append((f"eval {name.replace('_', ' ')}", " -> ".join(shown)))
    rows[0] = (rows[0][0], rows[0][1] + best)
    if metrics.get("stopped_early"):
        rows.append(("stopped early", f"at step {metrics['stopped_early']['at_step']}"))
    return rows


def _padding(metrics: dict) -> str:
    """The share of trained positions that were padding, and what packing saved: of the positions the steps
    computed where the loop counted them (padding_computed), else of the prepared rows."""
    computed = metrics.get("padding_computed")
    if metrics.get("packing") and metrics.get("padding_fraction") is not None:
        now = metrics["padding_fraction"] if computed is None else computed
        return f"{metrics['padding_fraction_unpacked']:.0%} -> {now:.0%} (packed)"
    if computed is not None:  # rows cut to each batch's longest: grouped by length, fewer positions
        return f"{computed:.0%} of the positions computed (not packed)"
    if metrics.get("padding_fraction") is None:  # a run from before it was measured
        return "n/a"
    return f"{metrics['padding_fraction']:.0%} (not packed)"


def settings_to_resume(output: str | None) -> dict | None:
    """The config of the newest checkpoint in `output`; None when it has none. No keras: the CLI reads it first.

    A gs:// run's checkpoints are copied to its staging directory here, and found there again by the run.
    """
    from finetune import config as config_module
    from finetune.platform.version import __version__

    found = checkpoint.newest(check_target(output, False, True).path)
    if found is None:
        return None
    state = found.state()
    try:
        config_module.from_dict(state["config"])
    except UserError as e:  # a key or value of another version's (a newer one's setting)
        written = state.get("finetune_version")
        by = f"finetune {written}" if written else "a version of finetune from before checkpoints named theirs"
        raise UserError(f"cannot resume {output}: its checkpoint was written by {by}, and this version "
                        f"({__version__}) cannot take its settings ({e}); resume it with the version that wrote it, "
                        "or start a new run with another --output") from None  # fmt: skip
    return state["config"]
