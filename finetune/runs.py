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
    config_file = directory / "config.yaml"
    if not config_file.is_file() or not (directory / outputs.ADAPTER).is_file():
        raise UserError(
            f"{directory} is not a finished run (no config.yaml and {outputs.ADAPTER}); pass --run DIR of a run"
        )
    return Run(directory, config_module.from_dict(config_module.read_recipe(config_file)))


def load_model(run: Run):
    """(causal LM with the run's adapter, preprocessor); keras must already be on the run's backend."""
    from finetune import backend, model, presets

    cfg = run.config
    backend.apply_runtime_tweaks(cfg.model.precision)
    source = presets.resolve(cfg.model.preset)
    lm, preprocessor = model.build(source, cfg.model.seq_len)
    model.enable_lora(lm, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets)
    lm.backbone.load_lora_weights(str(run.directory / outputs.ADAPTER))
    model.compile(lm, cfg.train.learning_rate or source.default_learning_rate, cfg.train.weight_decay)
    return lm, preprocessor


def evaluate_run(run: Run, data_path: str | None = None) -> dict:
    """Held-out metrics of the adapted model, on the run's split or on all of `data_path`."""
    from finetune import batching, data, evaluate, model, templates, train

    cfg = run.config
    path = data_path or cfg.data.path
    records = train.load_records(cfg, path)
    lm, preprocessor = load_model(run)
    template = templates.get(cfg.data.template)
    usable = train.usable_examples(records, template, preprocessor.tokenizer, cfg, path)
    if data_path is None:  # the same held-out records as in training
        _, usable = data.split(usable, cfg.data.eval_fraction, cfg.train.seed, min_eval=cfg.train.batch_size)
    examples = [e for _, e in usable]
    batches = batching.Batches(batching.pad(examples, cfg.model.seq_len), cfg.train.batch_size)
    result = evaluate.metrics(model.evaluator(lm), batches)
    result["examples"] = len(examples)
    return result


def generate(run: Run, prompts: list[str], max_new_tokens: int | None = None, raw: bool = False) -> list[str]:
    """Greedy completions; each prompt is put in the run's template unless `raw`."""
    from finetune import evaluate, templates
    from finetune.data import Record

    cfg = run.config
    template = templates.get(cfg.data.template)
    if not raw:
        prompts = [template.apply(Record(instruction=p, response="-"))[0] for p in prompts]
    lm, preprocessor = load_model(run)
    return evaluate.generate(
        lm, preprocessor, prompts, max_new_tokens or cfg.train.max_new_tokens, template.stop_tokens
    )
