"""model.weights.h5 and model.json: a --full run's trained weights, and the checks before they load anywhere.

A --full run trains every weight of the language model, so it publishes the whole backbone instead of an adapter.
model.weights.h5 holds each weight under the name families.weight_paths gives it (the same in every build of
the base), and model.json says what it was trained on, as adapter.json does for an adapter: the preset, its
family and base fingerprint (adapter.fingerprint), the precision, and a checksum of the weights. eval, generate,
load and export check both against the config and the base before a single weight is assigned.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from finetune.model import families
from finetune.platform import documents
from finetune.platform.errors import UserError
from finetune.training import adapter

WEIGHTS = "model.weights.h5"
DESCRIPTION = "model.json"
FORMAT = "finetune-full-model"
FORMAT_VERSION = 1
GROUP = "weights"
"""The h5 group the weights are kept under, each by its path."""
_FIX = "retrain the run, or copy model.weights.h5 and model.json back together from where it was made"


def saved_weights(backbone) -> list[tuple[str, object]]:
    """(name, variable) of each weight the file keeps: the backbone's, without its random seeds' states (NEFTune,
    dropout), which a built model makes anew, and without --add-tokens' rows, which adapter.tokens.npy keeps as a
    LoRA run's (the file then fits the base as it loads, and an export merges the rows as a LoRA run's)."""
    from finetune.model import tokens

    paths = families.weight_paths(backbone)
    return [(paths[id(w)], w) for w in backbone.weights
            if not w.path.endswith("seed_generator_state") and not tokens.is_rows(w)]  # fmt: skip


def describe(backbone, run, version: str, digest: str) -> dict:
    """model.json's content for the trained backbone, whose saved weights' checksum is `digest` (save's).

    run: resolve.Resolved. The run that trained it: its preset, template and precision are recorded.
    """
    from finetune.model import tokens

    cfg = run.config
    added = tokens.added_of(backbone)
    return {
        **({"added_tokens": added.describe()} if added else {}),  # as adapter.json: the tokens' ids (runs.py)
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "preset": {"name": cfg.model.preset, "family": run.source.family, "fingerprint": adapter.fingerprint(backbone)},
        "template": cfg.data.template,
        "seq_len": int(cfg.model.seq_len),
        "dtype": run.precision,
        "weights": len(saved_weights(backbone)),
        "finetune_version": version,
        "weights_sha256": digest,
    }


def save(backbone, path: Path) -> str:
    """Write every weight (saved_weights) into `path`, in its stored dtype; returns their checksum (_digest)."""
    import h5py
    import numpy as np

    digest = hashlib.sha256()
    with h5py.File(path, "w") as f:
        group = f.create_group(GROUP)
        for name, weight in saved_weights(backbone):
            value = np.asarray(weight.numpy())
            group.create_dataset(name, data=value)
            _digest(digest, name, value)
    return digest.hexdigest()


def _digest(digest, name: str, value) -> None:
    """sha256 over each weight's name and values, in the file's order: of the values, not the file's bytes."""
    import numpy as np

    digest.update(name.encode("utf-8"))
    digest.update(np.ascontiguousarray(value).tobytes())


def read(path: Path) -> dict:
    """model.json, refused when missing, not JSON, not ours, or with a field not of the shape describe() writes."""
    if not path.is_file():
        raise UserError(f"{path.parent} has no {path.name}, which says what its trained weights are; {_FIX}")
    described = adapter.described_base(path, FORMAT, FORMAT_VERSION, "--full model", _FIX)
    described.field("weights", int, check=documents.at_least(1))
    described.field("weights_sha256", str)
    return described.value


def check_against_config(description: dict, cfg, path: Path) -> None:
    """The description must name the preset the run's config.yaml names (a preset directory may move: the base's
    fingerprint tells then)."""
    described, configured = description["preset"].get("name"), cfg.model.preset
    if described != configured and not (Path(described).is_absolute() and Path(configured).is_absolute()):
        raise UserError(
            f"{path} says preset {described}, but the run's config.yaml says {configured}: the weights come from "
            "another run;\ncopy model.weights.h5 and model.json together from the run that made them"
        )


def load(backbone, directory: Path, description: dict) -> None:
    """Assign the run's trained weights to `backbone` (its base, built as the run trained), once model.json fits
    it (the base's fingerprint) and model.weights.h5 holds what model.json describes: every weight, of its shape,
    finite, with its checksum. Every weight is read and checked before the first is assigned."""
    import h5py
    import numpy as np

    path = directory / WEIGHTS
    described, actual = description["preset"].get("fingerprint"), adapter.fingerprint(backbone)
    if described != actual:
        raise UserError(
            f"{directory / DESCRIPTION}: the weights were trained on preset {description['preset'].get('name')} "
            f"(base fingerprint {str(described)[:12]}), but this base model's fingerprint is {actual[:12]}: "
            "another architecture"
        )
    wanted = saved_weights(backbone)
    values, digest = [], hashlib.sha256()
    try:
        with h5py.File(path, "r") as f:
            group = f[GROUP]
            stored = sum(1 for _ in _datasets(group))
            if stored != len(wanted) or stored != description["weights"]:
                raise UserError(f"{path} holds {stored} weights, but this base has {len(wanted)}; {_FIX}")
            for name, weight in wanted:
                if name not in group:
                    raise UserError(f"{path} has no weight {name}; {_FIX}")
                value = np.asarray(group[name])
                if value.shape != tuple(weight.shape):
                    raise UserError(f"{path}: {name} has shape {value.shape}, the base {tuple(weight.shape)}; {_FIX}")
                if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
                    raise UserError(f"{path}: {name} has weights that are not finite (NaN or inf); {_FIX}")
                _digest(digest, name, value)
                values.append(value)
    except OSError as e:
        raise UserError(f"{path} is not readable trained weights ({str(e).splitlines()[0]}); {_FIX}") from None
    except (KeyError, ValueError, TypeError) as e:  # h5py on a damaged or edited file
        raise UserError(f"{path} is not readable trained weights ({type(e).__name__}: {e}); {_FIX}") from None
    if digest.hexdigest() != description["weights_sha256"]:
        raise UserError(
            f"{path} does not hold the weights its model.json describes (their checksums differ): the two files "
            "come from different runs;\ncopy model.weights.h5 and model.json together from the run that made them"
        )
    for (_, weight), value in zip(wanted, values, strict=True):
        weight.assign(value)


def _datasets(group):
    """Every dataset under an h5 group, however deep its name's slashes put it."""
    import h5py

    for item in group.values():
        if isinstance(item, h5py.Dataset):
            yield item
        else:
            yield from _datasets(item)
