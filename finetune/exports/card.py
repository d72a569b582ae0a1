"""The model card (README.md) that `finetune publish` uploads: a finished run's record, for people and the Hub.

Everything in it comes from what the run wrote: config.yaml (the settings, and under `resolved:` each decision with
its reason and the framework versions), metrics.json (the held-out metrics before and after training) and the
preset's licence (model/presets.py). It opens with the Hugging Face Hub's metadata as YAML front matter (license,
base_model, library_name, tags), which Kaggle shows as text. A local data file is named by its file name alone:
where it sat on the machine that trained is nobody's business on the Hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune.data import formats
from finetune.model import checkpoints, families
from finetune.training import outputs


@dataclass(frozen=True)
class Upload:
    """What goes up, as the card describes it.

    what: str. A sentence's worth: "the adapter for PEFT", "{model}, in transformers' format"; the card fills
        {model} (the weights: merged with the adapter, or a --full run's) and {causal_lm} (the family's keras-hub
        class, which keras-hub's generic CausalLM.from_preset does not pick for a Gemma 4) from the run.
    library: str. The Hub's library_name: keras-hub, transformers, peft or gguf.
    destination: str. hf://USER/NAME or kaggle://OWNER/MODEL/keras/VARIATION.
    """

    what: str
    library: str
    destination: str


def model_card(run, upload: Upload, licence: families.Licence) -> str:
    """README.md for `run` (runs.Run, a finished run), uploaded as `upload`, its base weights under `licence`."""
    cfg = run.config
    recorded = _recorded(run.directory)
    metrics = outputs.checked_metrics(run.directory) or {}
    family = families.get(run.adapter["preset"]["family"])
    name = upload.destination.rstrip("/").rsplit("/", 1)[-1]
    lines = [
        "---",
        yaml.safe_dump(_metadata(cfg, upload, licence, family), sort_keys=False).rstrip(),
        "---",
        "",
        f"# {name}",
        "",
        _opening(cfg, family, recorded, upload),
        "",
        "## Base model",
        "",
        f"- preset: `{cfg.model.preset}`",
        f"- family: {family.title}",
        f"- licence: [{licence.name}]({licence.link})",
        "",
        "## Data",
        "",
        *_data(cfg, metrics),
        "",
        "## Training",
        "",
        f"- method: `{cfg.train.method}`",
        "- every weight of the language model trained (--full), in float32"
        if cfg.model.full
        else f"- LoRA: rank {cfg.lora.rank} on {', '.join(cfg.lora.targets)}, dropout {cfg.lora.dropout}"
        + (", rsLoRA" if cfg.lora.rslora else "")
        + (", DoRA" if cfg.lora.dora else ""),
        f"- sequence length {cfg.model.seq_len}, {metrics.get('steps', '?')} steps",
        "",
        "Each setting the run decided, and why:",
        "",
        *_decisions(recorded, lora=not cfg.model.full),
        "",
        "## Held-out metrics",
        "",
        *_metrics(metrics),
        "",
        "## Frameworks",
        "",
        *_versions(recorded, cfg.backend),
        "",
        "## Licence",
        "",
        f"This model is built on the weights of `{cfg.model.preset}`, which come under the "
        f"[{licence.name}]({licence.link}); they apply to this model too.",
    ]
    if licence.notice:
        lines += ["", licence.notice]
    return "\n".join(lines) + "\n"


def _opening(cfg, family: families.Family, recorded: dict, upload: Upload) -> str:
    version = recorded.get("versions", {}).get("finetune")
    made = f"finetune {version}" if version else "finetune"
    kind = "full" if cfg.model.full else "LoRA"  # --full: every weight trained
    model = "the trained model (every weight, --full)" if cfg.model.full else "the model with the adapter merged in"
    what = upload.what.format(model=model, causal_lm=family.causal_lm)
    return (
        f"A {kind} fine-tune of `{cfg.model.preset}` ({family.title}) on {_data_name(cfg.data.path)}, made with "
        f"{made}. This upload is {what}."
    )


def _recorded(directory: Path) -> dict:
    """config.yaml's `resolved:` record: the run's decisions ({value, why}), versions and machine."""
    try:
        found = yaml.safe_load((directory / outputs.CONFIG).read_text(encoding="utf-8")).get("resolved")
    except (OSError, yaml.YAMLError, AttributeError):
        return {}
    return found if isinstance(found, dict) else {}


def _metadata(cfg, upload: Upload, licence: families.Licence, family: families.Family) -> dict:
    """The Hub's card metadata (huggingface.co/docs/hub/model-cards#model-card-metadata)."""
    found = {"license": licence.spdx, "license_link": licence.link}
    if cfg.model.preset.startswith(checkpoints.PREFIX):  # a Hub repository: the Hub links the two
        found["base_model"] = cfg.model.preset.removeprefix(checkpoints.PREFIX).strip("/")
    if cfg.data.path and cfg.data.path.startswith("hf:"):
        found["datasets"] = [cfg.data.path.removeprefix("hf:").split(":")[0]]
    found["library_name"] = upload.library
    found["pipeline_tag"] = "text-generation"
    kind = "full-fine-tune" if cfg.model.full else "lora"
    found["tags"] = list(dict.fromkeys(["finetune", kind, family.name, cfg.train.method, upload.library]))
    return found


def _data_name(path: str | None) -> str:
    """The data as the card names it: hf:NAME and the shipped sample as they are, a file by its name alone."""
    if not path:
        return "no data named"
    if path.startswith("hf:"):
        return f"`{path}` (Hugging Face)"
    if path == formats.SAMPLE:
        return "`sample` (the Dolly sample finetune ships)"
    return f"`{path.rstrip('/').rsplit('/', 1)[-1]}`"


def _data(cfg, metrics: dict) -> list[str]:
    lines = [f"- data: {_data_name(cfg.data.path)}, template `{cfg.data.template}`"]
    if cfg.eval.data:
        lines.append(f"- held-out data: {_data_name(cfg.eval.data)}")
    if "train_examples" in metrics:
        lines.append(f"- examples: {metrics['train_examples']} in the training set, {metrics.get('eval_examples', 0)} "
                     "held out")  # fmt: skip
    if isinstance(metrics.get("trained_tokens"), int) and isinstance(metrics.get("steps"), int):
        # what the steps went through: a run of fewer steps than an epoch saw part of the set
        lines.append(f"- trained: {metrics['steps']} steps over {metrics['trained_tokens']:,} tokens"
                     + (f", the loss on {metrics['response_tokens']:,} of them"
                        if isinstance(metrics.get("response_tokens"), int) else ""))  # fmt: skip
    if metrics.get("best_step") is not None:
        lines.append(f"- the adapter and its held-out metrics are step {metrics['best_step']}'s, the best held-out "
                     "loss (--keep-best)")  # fmt: skip
    if cfg.data.max_records:
        lines.append(f"- the first {cfg.data.max_records} records were read (--max-records)")
    return lines


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _decisions(recorded: dict, lora: bool = True) -> list[str]:
    """The decisions' table; a --full run's without LoRA's alpha, which it decided and never used."""
    rows = [(key, entry) for key, entry in recorded.items() if isinstance(entry, dict) and "why" in entry
            and (lora or key != "alpha")]  # fmt: skip
    if not rows:
        return ["(the run recorded none)"]
    table = ["| setting | value | why |", "|---|---|---|"]
    return table + [f"| {key} | {_shown(entry.get('value'))} | {_cell(entry['why'])} |" for key, entry in rows]


def _shown(value) -> str:
    """A decided value as the run's table prints it: on and off for a switch."""
    return ("on" if value else "off") if isinstance(value, bool) else _cell(value)


def _metrics(metrics: dict) -> list[str]:
    """A row per held-out metric of the run's method: its value before training and after."""
    if not metrics.get("eval_examples"):
        return ["The run held nothing out, so it has no held-out metrics."]
    names = [
        key
        for key, value in metrics.items()
        if key.startswith("eval_") and not key.endswith("_before") and key != "eval_examples"
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    ]
    table = [f"Held-out examples: {metrics['eval_examples']}.", "", "| metric | before | after |", "|---|---|---|"]
    for key in names:
        before = metrics.get(f"{key}_before")
        shown = "" if not isinstance(before, (int, float)) else f"{before:.4f}"
        table.append(f"| {key.removeprefix('eval_')} | {shown} | {metrics[key]:.4f} |")
    return table


def _versions(recorded: dict, trained_on: str) -> list[str]:
    """The versions a run trained with: finetune's, keras', keras-hub's and its backend's framework's; TensorFlow
    also on another backend, as keras-hub's tokenizers run on it. Not the other backends' installed beside."""
    versions = recorded.get("versions")
    lines = [f"- trained on {trained_on}"]
    if isinstance(versions, dict):
        for name, version in versions.items():
            if name in ("jax", "torch") and name != trained_on:  # installed beside, not used
                continue
            used = " (keras-hub's tokenizers)" if name == "tensorflow" and trained_on != "tensorflow" else ""
            lines.append(f"- {_cell(name)} {_cell(version)}{used}")
    return lines
