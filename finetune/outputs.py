"""The run directory: checked before any work, claimed for training, published file by file.

Before training nothing is written. When training starts the directory is
created and locked (an flock, released by the kernel even on SIGKILL), so two
runs can never write into one directory. Checkpoints go into it as training
goes (checkpoint.py). The results are written at the end, each file under a
temporary name, fsynced and renamed, with metrics.json last: its presence marks
a finished run, and --overwrite replaces the old run's results only once the
new run has finished training.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import shutil
import time
from pathlib import Path

import yaml

from finetune import checkpoint, storage
from finetune.errors import UserError

ADAPTER = "adapter.lora.h5"
ADAPTER_JSON = "adapter.json"  # what the adapter was trained on (adapter.py)
METRICS = "metrics.json"
CONFIG = "config.yaml"
STATUS = "status.json"
LOCK = ".lock"
RUN_MARKERS = (CONFIG, METRICS, ADAPTER)
# A single path component longer than this is refused by most file systems (ext4, xfs, APFS).
NAME_MAX = 255

try:
    import fcntl
except ImportError:  # Windows: no flock; runs still work, unguarded against a second writer.
    fcntl = None


def check_target(requested: str | None, overwrite: bool, resume: bool) -> Path:
    """The run directory to use; refuses, before any work, one the run could not or must not write to."""
    if requested is None:
        if resume:
            raise UserError("--resume needs --output DIR, the run directory to continue")
        return default_dir()
    if not requested.strip():
        raise UserError("--output is empty (an unset shell variable?); pass the run directory, e.g. --output runs/a")
    path = Path(requested)
    for part in path.parts:
        if len(part.encode("utf-8")) > NAME_MAX - 16:  # room for temporary names beside it
            raise UserError(f"output name {part[:40]}... is {len(part)} characters, too long; use a shorter --output")
    if path.exists() and not path.is_dir():
        raise UserError(f"output {path} is a file, not a directory; pass another --output")
    if is_locked(path):
        raise UserError(f"another finetune run is writing to {path}; wait for it to end or choose another --output")
    if not resume and not overwrite:
        refuse_existing_run(path)
    _check_writable(path)
    return path


def default_dir() -> Path:
    path = Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    _check_writable(path)
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


def _check_writable(path: Path) -> None:
    """Refuse now, not after hours of training, a place the run could not be written to."""
    existing = _nearest_existing(path)
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write the run to {path}: {existing} is not a writable directory; pass another --output"
        )


def _nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists: where the run's directory would be made."""
    existing = path.resolve()
    while not existing.exists():
        existing = existing.parent
    return existing


def check_free_space(path: Path, needed_bytes: int) -> None:
    """Refuse a run whose checkpoints and adapter would not fit on the disk."""
    existing = _nearest_existing(path)
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise UserError(
            f"{existing} has {free / 2**20:.1f} MB free, and this run needs about {needed_bytes / 2**20:.1f} MB "
            "for its checkpoints and adapter; free some space or pass another --output"
        )


class Claim:
    """A run directory held by this process: created if needed and locked until release()."""

    def __init__(self, path: Path, created: bool, lock_file, had_lock: bool = False):
        self.path = path
        self.created = created
        self.had_lock = had_lock
        self._lock_file = lock_file

    def release(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def abandon(self) -> None:
        """Undo the claim of a run that wrote nothing worth keeping: remove only what it created.

        The removal happens while the lock is still held, so no other run can
        claim the directory in between and lose it.
        """
        try:
            if checkpoint.find(self.path):
                return
            if self.created:
                shutil.rmtree(self.path, ignore_errors=True)
                return
            if not self.had_lock:
                (self.path / LOCK).unlink(missing_ok=True)
            empty = self.path / checkpoint.DIRECTORY  # left by a first save that failed
            if empty.is_dir() and not any(empty.iterdir()):
                empty.rmdir()
        finally:
            self.release()


def claim(path: Path, *, default: bool, overwrite: bool, resume: bool) -> Claim:
    """Create and lock the run directory; re-checks under the lock that it is still free.

    default: bool. `path` is the default runs/<timestamp>: if another run took
        that name in the same second, use the next free one (-2, -3, ...).
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
    lock_file, had_lock = None, (path / LOCK).exists()
    if fcntl is not None:
        lock_file = open(path / LOCK, "a+")  # noqa: SIM115 - held open until release()
        for attempt in range(20):  # `finetune runs` probes the lock for an instant: let it pass
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == 19:
                    lock_file.close()
                    raise UserError(
                        f"another finetune run is writing to {path}; wait for it to end or choose another --output"
                    ) from None
                time.sleep(0.05)
    held = Claim(path, created, lock_file, had_lock)
    if not resume and not overwrite:
        try:
            refuse_existing_run(path)  # another run may have finished here since check_target
        except UserError:
            held.release()
            raise
    return held


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


def read_status(run_dir: Path) -> dict:
    try:
        status = json.loads((run_dir / STATUS).read_text(encoding="utf-8"))
        return status if isinstance(status, dict) else {}
    except (OSError, ValueError):
        return {}


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
    columns = ["step", "epoch", "train_loss", "eval_loss", "eval_accuracy"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in columns})


SAMPLE_SECTIONS = (("Prompt", "prompt"), ("Reference", "reference"), ("Before training", "before"),
                   ("After training", "after"))  # fmt: skip


def write_samples(path: Path, samples: list[dict]) -> None:
    lines = ["# Generations on held-out prompts", "", "Greedy decoding, before and after training.", ""]
    for i, sample in enumerate(samples, start=1):
        lines += [f"## Sample {i}", ""]
        for title, key in SAMPLE_SECTIONS:
            lines += [f"**{title}**", "", _fence(sample[key]), ""]
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


def summary_table(metrics: dict, run_dir: Path) -> str:
    rows = [
        ("run", str(run_dir)),
        ("backend", metrics["backend"]),
        ("preset", metrics["preset"]),
        ("LoRA rank", str(metrics["rank"])),
        ("train steps", str(metrics["steps"])),
        ("padding", _padding(metrics)),
        ("train loss", f"{metrics['train_loss']:.4f}"),
        ("eval loss", f"{metrics['eval_loss_before']:.4f} -> {metrics['eval_loss']:.4f}"),
        ("eval perplexity", f"{metrics['eval_perplexity']:.2f}"),
        ("eval accuracy", f"{metrics['eval_accuracy']:.3f}"),
        # None when this session trained a single step: that step compiles, so it is not timed.
        ("tokens/s", "n/a" if metrics["tokens_per_second"] is None else f"{metrics['tokens_per_second']:.0f}"),
        ("seconds", f"{metrics['seconds']:.1f}"),
        ("peak memory", f"{metrics['peak_memory_mb']:.0f} MB"),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line] + [f"{k.ljust(width)} | {v}" for k, v in rows] + [line])


def _padding(metrics: dict) -> str:
    """The share of trained positions that were padding, and what packing saved."""
    if "padding_fraction" not in metrics:
        return "n/a"
    if metrics.get("packing"):
        return f"{metrics['padding_fraction_unpacked']:.0%} -> {metrics['padding_fraction']:.0%} (packed)"
    return f"{metrics['padding_fraction']:.0%} (not packed)"
