"""Reopen a finished run: base model plus saved adapter, for eval and generate.

The run's config.yaml says which preset, template and LoRA layout were used;
the adapter file holds only the LoRA factors (backbone.save_lora_weights), so
the base weights come from the same preset as in training.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune import config as config_module
from finetune import outputs
from finetune.errors import UserError


@dataclass
class Run:
    directory: Path
    config: config_module.Config


def open_run(directory: str | Path) -> Run:
    """Read a run directory's config; pure Python, so it can run before the backend is chosen."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"run directory {directory} does not exist; pass --run DIR of a run made by finetune gemma")
    for name in ("config.yaml", outputs.ADAPTER):
        if not (directory / name).is_file():
            raise UserError(f"{directory} has no {name}, so it is not a finished run; pass --run DIR of a finished run")
    return Run(directory, config_module.from_dict(config_module.read_recipe(directory / "config.yaml")))


def load_model(run: Run):
    """(causal LM with the run's adapter, preprocessor); keras must already be on the run's backend."""
    from finetune import backend, model, presets

    cfg = run.config
    backend.apply_runtime_tweaks(cfg.model.precision, cfg.train.threads)
    source = presets.resolve(cfg.model.preset)
    lm, preprocessor = model.build(source, cfg.model.seq_len, cfg.model.quantize)
    model.enable_lora(lm, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets)
    adapter = run.directory / outputs.ADAPTER
    check_adapter(adapter, lm.backbone, cfg.lora.rank)
    lm.backbone.load_lora_weights(str(adapter))
    model.compile(lm, cfg.train.learning_rate or source.default_learning_rate, cfg.train.weight_decay)
    return lm, preprocessor


def check_adapter(path: Path, backbone, rank: int) -> None:
    """Refuse an adapter that does not fit the run's LoRA layout, before keras-hub assigns any of it.

    keras-hub's load_lora_weights reads the file without checks: a damaged file
    ends in a raw OSError, another rank in a ValueError, and NaN weights load
    silently. Read through Keras' own H5 store, so its layout stays Keras' business.
    """
    import numpy as np
    from keras.src.saving.saving_lib import H5IOStore

    fix = "retrain the run, or copy its adapter back from where it was made"
    layers = [layer for layer in backbone._flatten_layers(include_self=False) if layer.weights]
    expected = {index: layers[index] for index in backbone._lora_enabled_layers}
    try:
        store = H5IOStore(path, mode="r")
    except OSError as e:
        raise UserError(f"{path} is not a readable adapter ({str(e).splitlines()[0]}); {fix}") from None
    try:
        if not store.has_path("lora"):
            raise UserError(f"{path} holds no LoRA weights (no `lora` group); {fix}")
        stored_rank = int(store.get("lora")["rank"][()])
        if stored_rank != rank:
            raise UserError(
                f"{path} has LoRA rank {stored_rank}, but the run's config.yaml says {rank}; "
                "use the adapter this run saved"
            )
        stored = {int(key) for key in store.h5_file["lora"] if key.isdigit()}
        if stored != set(expected):
            raise UserError(
                f"{path} adapts {len(stored)} layers, but the run's config.yaml (lora.targets) gives "
                f"{len(expected)}; use the adapter this run saved"
            )
        for index, layer in expected.items():
            entry = store.get(f"lora/{index}")
            for name in ("lora_kernel_a", "lora_kernel_b"):
                values = np.asarray(entry[name])
                want = tuple(getattr(layer, name).shape)
                if values.shape != want:
                    raise UserError(
                        f"{path}: {name} of layer {layer.name} has shape {values.shape}, expected {want}; {fix}"
                    )
                if not np.isfinite(values.astype(np.float32)).all():
                    raise UserError(f"{path}: layer {layer.name} has weights that are not finite (NaN or inf); {fix}")
    except (OSError, KeyError, ValueError) as e:  # h5py on a damaged file
        detail = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"{path} is not a readable adapter ({type(e).__name__}: {detail}); {fix}") from None
    finally:
        store.close()


def evaluate_run(run: Run, data_path: str | None = None) -> dict:
    """Held-out metrics of the adapted model, on the run's split or on all of `data_path`."""
    from finetune import batching, model, scoring, templates, train

    cfg = run.config
    path = data_path or cfg.data.path
    records = train.load_records(cfg, path)
    lm, preprocessor = load_model(run)
    template = templates.get(cfg.data.template)
    usable = train.usable_examples(records, template, preprocessor.tokenizer, cfg, path)
    if data_path is None:  # the same held-out records as in training
        _, usable = train.split(usable, cfg, cfg.train.batch_size)
    examples = [e for _, e in usable]
    batches = batching.Batches(batching.pad(examples, cfg.model.seq_len), cfg.train.batch_size)
    result = scoring.metrics(model.evaluator(lm), batches)
    result["examples"] = len(examples)
    return result


def generate(run: Run, prompts: list[str], max_new_tokens: int | None = None, raw: bool = False) -> list[str]:
    """Greedy completions; each prompt is put in the run's template unless `raw`."""
    from finetune import scoring, templates
    from finetune.data import Record

    cfg = run.config
    template = templates.get(cfg.data.template)
    if not raw:
        prompts = [template.apply(Record(instruction=p, response="-"))[0] for p in prompts]
    lm, preprocessor = load_model(run)
    return scoring.generate(
        lm,
        preprocessor,
        prompts,
        cfg.train.max_new_tokens if max_new_tokens is None else max_new_tokens,
        template.stop_tokens,
    )


def list_runs(directory: str | Path) -> list[dict]:
    """A row per run in `directory` (or for `directory` itself): its path, state, step and eval loss."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory} is not a directory; pass a run directory or a directory of runs")
    candidates = [directory] + sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    return [row for row in (describe(path) for path in candidates) if row is not None]


def describe(path: Path) -> dict | None:
    """What state the run in `path` is in; None if `path` holds no run."""
    import json

    from finetune import checkpoint

    status = outputs.read_status(path)
    found = checkpoint.find(path)
    finished = (path / outputs.METRICS).is_file()
    if not (finished or found or status):
        return None
    row = {"run": str(path), "state": "", "step": "", "eval_loss": "", "note": ""}
    if finished:
        try:
            metrics = json.loads((path / outputs.METRICS).read_text(encoding="utf-8"))
            row.update(step=metrics.get("steps", ""), eval_loss=f"{metrics['eval_loss']:.4f}")
        except (OSError, ValueError, KeyError, TypeError):
            row["note"] = "metrics.json unreadable"
        row["state"] = "finished"
        return row
    step = found[-1].step if found else status.get("step", "")
    row["step"] = step
    if outputs.is_locked(path):
        row["state"] = "running"
    elif status.get("state") in ("failed", "stopped"):
        row["state"] = status["state"]
        row["note"] = str(status.get("message", "")).splitlines()[0][:100] if status.get("message") else ""
    elif found:
        row["state"] = "checkpointed"
        row["note"] = "killed or lost; --resume continues it" if status.get("state") == "running" else ""
    else:
        row["state"] = "failed"
        row["note"] = "ended before its first checkpoint"
    if found and row["state"] != "running":
        row["note"] = (row["note"] + f"; last checkpoint step {found[-1].step}").lstrip("; ")
    return row


def format_table(rows: list[dict]) -> str:
    columns = ["run", "state", "step", "eval_loss", "note"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
