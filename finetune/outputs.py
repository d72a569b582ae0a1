"""The run directory: checked before any work, written whole at the end.

Files are written into a hidden sibling directory and renamed into place
last, so an interrupted or refused run never leaves a half-written run that
looks finished.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import shutil
import tempfile
from pathlib import Path

import yaml

from finetune.errors import UserError

ADAPTER = "adapter.lora.h5"
RUN_MARKERS = ("config.yaml", "metrics.json", ADAPTER)


def choose_dir(requested: str | None, overwrite: bool) -> Path:
    """The run directory to use; refuses one that holds a run unless `overwrite`."""
    if requested is None:
        path = Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        _check_writable(path)
        return path
    path = Path(requested)
    if path.exists() and not path.is_dir():
        raise UserError(f"output {path} is a file, not a directory; pass another --output")
    if not overwrite and any((path / name).exists() for name in RUN_MARKERS):
        raise UserError(
            f"output directory {path} already holds a run; pass --overwrite to replace it or choose another --output"
        )
    _check_writable(path)
    return path


def _check_writable(path: Path) -> None:
    """Refuse now, not after hours of training, a place the run could not be written to."""
    existing = path.resolve()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write the run to {path}: {existing} is not a writable directory; pass another --output"
        )


class RunWriter:
    """Collects a run's files in a staging directory and publishes them at once."""

    def __init__(self, final: Path):
        self.final = final
        final.parent.mkdir(parents=True, exist_ok=True)
        self.staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))

    def path(self, name: str) -> Path:
        return self.staging / name

    def publish(self) -> Path:
        if not self.final.exists():
            self.staging.rename(self.final)
            return self.final
        # An existing directory may hold the user's own files: replace ours one
        # by one, metrics.json last, since its presence marks a finished run.
        names = sorted((p.name for p in self.staging.iterdir()), key=lambda n: n == "metrics.json")
        for name in names:
            os.replace(self.staging / name, self.final / name)
        self.staging.rmdir()
        return self.final

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def write_config(path: Path, config: dict) -> None:
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


def write_metrics(path: Path, metrics: dict) -> None:
    path.write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")


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
        ("train loss", f"{metrics['train_loss']:.4f}"),
        ("eval loss", f"{metrics['eval_loss_before']:.4f} -> {metrics['eval_loss']:.4f}"),
        ("eval perplexity", f"{metrics['eval_perplexity']:.2f}"),
        ("eval accuracy", f"{metrics['eval_accuracy']:.3f}"),
        ("tokens/s", f"{metrics['tokens_per_second']:.0f}"),
        ("seconds", f"{metrics['seconds']:.1f}"),
        ("peak memory", f"{metrics['peak_memory_mb']:.0f} MB"),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line] + [f"{k.ljust(width)} | {v}" for k, v in rows] + [line])
