"""adapter.json: what an adapter was trained on, and the checks before it is loaded anywhere.

keras-hub's `.lora.h5` keys the LoRA factors by the index of a layer among the
backbone's layers that have weights, and records only the rank. Nothing in it
says which preset, targets or alpha it belongs to, and load_lora_weights checks
nothing: an adapter can load silently into the wrong layers. Every run writes
adapter.json beside it, and eval, generate, load and export check both files
against the base model before a single factor is assigned.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from finetune.model import families
from finetune.platform import documents, keras_compat
from finetune.platform.errors import UserError

FORMAT = "finetune-adapter"
FORMAT_VERSION = 1
FACTORS = ("lora_kernel_a", "lora_kernel_b")
MAGNITUDE = "lora_magnitude"
"""DoRA's magnitude vector, beside an adapted layer's factors in adapter.lora.h5 (keras-hub's loader skips it)."""


def fingerprint(backbone) -> str:
    """sha256 over the sorted (path, shape) of the backbone's base weights (its LoRA factors left out).

    Shapes, not values: it tells a preset's architecture apart (layers, heads,
    widths, vocabulary) without reading gigabytes. Two presets of one
    architecture share it, so adapter.json records the preset's name too.
    """
    from finetune.model import tokens

    paths = families.weight_paths(backbone)
    entries = sorted(
        (paths[id(w)], [int(d) for d in w.shape])
        for w in backbone.weights
        if not w.path.split("/")[-1].startswith("lora_") and not tokens.is_rows(w)  # the adapter's, not the base's
    )
    return hashlib.sha256(json.dumps(entries).encode("utf-8")).hexdigest()


def layers_with_weights(backbone) -> list:
    """The list keras-hub's save/load_lora_weights index into: the backbone's layers that have weights."""
    return [layer for layer in backbone._flatten_layers(include_self=False) if layer.weights]


def kernel_shape(layer) -> tuple:
    """The logical shape of a dense layer's kernel, which its LoRA factors follow.

    An int4 layer stores its kernel packed and flattened; Keras keeps the shape
    that LoRA uses in `original_kernel_shape`.
    """
    if layer.quantization_mode == "int4" and hasattr(layer, "original_kernel_shape"):
        return tuple(int(d) for d in layer.original_kernel_shape)
    return tuple(int(d) for d in layer._kernel.shape)


def factor_shapes(layer, rank: int, dora: bool = False) -> dict:
    """{lora_kernel_a: shape, lora_kernel_b: shape} of rank-`rank` LoRA on `layer`, as Keras makes them, and
    DoRA's {lora_magnitude: shape}, one per output (builder.magnitude_shape); an expert bank's A and B of each
    projection (experts.factor_shapes)."""
    from finetune.model import experts

    if experts.is_bank(layer):
        return experts.factor_shapes(layer, rank)
    kernel = kernel_shape(layer)
    shapes = {"lora_kernel_a": [*kernel[:-1], rank], "lora_kernel_b": [rank, kernel[-1]]}
    if dora:
        from finetune.model import builder

        shapes[MAGNITUDE] = list(builder.magnitude_shape(layer))
    return shapes


def describe(backbone, run, version: str) -> dict:
    """adapter.json's content for a LoRA-enabled backbone, as it is about to be saved.

    run: resolve.Resolved. The run that trained it: its preset, LoRA (rank, alpha, targets and variant: dropout,
        rslora, dora), template and dtype are recorded.
    """
    from finetune.model import builder, tokens

    cfg = run.config
    layers = layers_with_weights(backbone)
    adapted, factors = [], {}
    for index in backbone._lora_enabled_layers:
        layer = layers[index]
        names = builder.lora_weight_names(layer)
        entry = {"index": index, "layer": layer.path, "name": layer.name}
        entry.update({name: [int(d) for d in getattr(layer, name).shape] for name in names})
        adapted.append(entry)
        factors[index] = [getattr(layer, name).numpy() for name in names]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "preset": {"name": cfg.model.preset, "family": run.source.family, "fingerprint": fingerprint(backbone)},
        "rank": int(cfg.lora.rank),
        "alpha": float(run.alpha),
        "targets": list(cfg.lora.targets),  # as given: aliases (all-linear) and transformers' names included
        # keras-hub's names of the adapted layers: what its enable_lora takes (export.md's recipe)
        "target_layer_names": sorted({entry["name"] for entry in adapted}),
        "dropout": float(cfg.lora.dropout),
        "rslora": bool(cfg.lora.rslora),
        "dora": bool(cfg.lora.dora),
        "template": cfg.data.template,
        "seq_len": int(cfg.model.seq_len),
        "dtype": run.precision,
        "quantize": cfg.model.quantize,
        "finetune_version": version,
        "adapted": adapted,
        "weights_sha256": weights_digest(factors),
        # --add-tokens: the new tokens and their ids; their rows are beside the adapter (outputs.TOKEN_ROWS).
        **({"added_tokens": tokens.added_of(backbone).describe()} if tokens.added_of(backbone) else {}),
    }


def save_token_rows(backbone, path: Path) -> None:
    import numpy as np

    from finetune.model import tokens

    with open(path, "wb") as f:
        np.save(f, np.asarray(tokens.rows(backbone).numpy(), "float32"))


def read_token_rows(path: Path, description: dict):
    """The new tokens' rows of a finished run, refused unless they are as many as adapter.json's tokens."""
    import numpy as np

    count = len(description["added_tokens"]["tokens"])
    fix = "copy it back from the run that made the adapter, beside adapter.json"
    try:
        values = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} ({e}); {fix}") from None
    if values.ndim != 2 or values.shape[0] != count or not np.isfinite(values).all():
        raise UserError(f"{path} holds rows of shape {values.shape}, adapter.json names {count} new tokens; {fix}")
    return values


def _saved(dora: bool, entry: dict | None = None) -> tuple[str, ...]:
    """The weights adapter.lora.h5 holds for an adapted layer (`entry`, its adapter.json entry): A and B, and DoRA's
    magnitude; an expert bank's A and B of each projection."""
    from finetune.model import families  # keras-free: an adapter is read before a backend is chosen

    if entry is not None and families.EXPERT_FACTORS[0] in entry:
        return families.EXPERT_FACTORS
    return (*FACTORS, MAGNITUDE) if dora else FACTORS


def save(backbone, path: Path) -> None:
    """adapter.lora.h5: keras-hub's save_lora_weights; under DoRA or with an expert bank adapted, its layout
    (lora/rank, lora/<index>/<name>) written through keras' store with each layer's weights
    (builder.lora_weight_names): the magnitudes and the experts' factors, which keras-hub cannot save."""
    from finetune.model import builder

    layers = layers_with_weights(backbone)
    adapted = [layers[i] for i in backbone._lora_enabled_layers]
    if all(builder.lora_weight_names(layer) == FACTORS for layer in adapted):
        backbone.save_lora_weights(str(path))
        return
    store = keras_compat.h5_store(path, mode="w")
    try:
        store.make("lora")["rank"] = backbone._lora_rank
        for index, layer in zip(backbone._lora_enabled_layers, adapted, strict=True):
            entry = store.make(f"lora/{index}")
            for name in builder.lora_weight_names(layer):
                entry[name] = getattr(layer, name)
    finally:
        store.close()


def assign(backbone, factors: dict) -> None:
    """Give each adapted layer its weights from read_factors' {index: values}, in factor_shapes' order."""
    from finetune.model import builder

    layers = layers_with_weights(backbone)
    for index, values in factors.items():
        for name, value in zip(builder.lora_weight_names(layers[index]), values, strict=True):
            getattr(layers[index], name).assign(value)


def weights_digest(factors: dict) -> str:
    """sha256 over each adapted layer's index and float32 factors, in index order.

    Of the values, not the file's bytes: it ties adapter.json to the weights
    whatever wrote the h5 file, and tells another run's adapter of the same
    layout apart.
    """
    import numpy as np

    digest = hashlib.sha256()
    for index in sorted(factors):
        digest.update(str(index).encode())
        for value in factors[index]:
            digest.update(np.ascontiguousarray(value, dtype=np.float32).tobytes())
    return digest.hexdigest()


def write(path: Path, description: dict) -> None:
    text = json.dumps(description, indent=1)
    text = re.sub(r"\[[\d,\s]*\]", lambda m: json.dumps(json.loads(m.group())), text)  # a shape on one line
    path.write_text(text + "\n", encoding="utf-8")


def read(path: Path) -> dict:
    """adapter.json, refused when missing, not JSON, not ours, or with any field not of the shape describe() writes."""
    if not path.is_file():
        raise UserError(
            f"{path.parent} has no {path.name}, which says what its adapter was trained on (runs made before "
            f"finetune wrote it lack one);\nretrain it with: finetune gemma --recipe {path.parent / 'config.yaml'}"
        )
    described = described_base(
        path, FORMAT, FORMAT_VERSION, "adapter", "copy it back from the run that made the adapter"
    )
    described.field("rank", int, check=documents.at_least(1))
    described.field("alpha", float)
    described.items("targets", str)
    described.field("dropout", float, required=False)
    for switch in ("rslora", "dora"):
        described.field(switch, bool, required=False)
    for entry in described.items("adapted", dict):
        entry.field("index", int, check=documents.at_least(0))
        entry.field("layer", str)
        for name in _saved(bool(described.value.get("dora")), entry.value):
            entry.items(name, int, check=documents.at_least(1))
    described.field("weights_sha256", str)
    added = described.section("added_tokens", required=False)
    if added is not None:
        added.items("tokens", str)
        added.items("ids", int, check=documents.at_least(0))
        added.field("vocabulary", int, check=documents.at_least(1))
    return described.value


def described_base(path: Path, fmt: str, version: int, what: str, fix: str) -> documents.Document:
    """A run's description of what it trained (adapter.json, a --full run's model.json) read, refused when not
    JSON, not of format `fmt` and `version`, or without its base preset's name and fingerprint."""
    try:
        text = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e}); check its permissions") from None
    described = documents.Document(documents.parse_json(text, str(path), fix), str(path), fix)
    if described.value.get("format") != fmt:
        raise UserError(f'{path} is not a finetune {what} description (no "format": "{fmt}")')
    if described.value.get("format_version") != version:
        shown = documents.shown(described.value.get("format_version"))
        raise UserError(f"{path} has format version {shown}; this finetune reads {version}")
    preset = described.section("preset")
    preset.field("name", str)
    preset.field("fingerprint", str)
    preset.field("family", str, required=False)
    return described


def check_against_config(description: dict, cfg, path: Path) -> None:
    """The description must say what the run's config.yaml says: preset, rank, alpha, targets, rslora and dora."""
    said = {
        "preset": (description["preset"].get("name"), cfg.model.preset),
        "rank": (description["rank"], cfg.lora.rank),
        "alpha": (float(description["alpha"]), cfg.lora.resolved_alpha()),
        "targets": (",".join(description["targets"]), ",".join(cfg.lora.targets)),
        **{key: (bool(description.get(key, False)), getattr(cfg.lora, key)) for key in ("rslora", "dora")},
        "added tokens": (",".join(description.get("added_tokens", {}).get("tokens", [])),
                         ",".join(cfg.model.add_tokens)),
    }  # fmt: skip
    if _local(said["preset"][0]) and _local(said["preset"][1]):
        del said["preset"]  # a preset directory may move: the base's fingerprint tells whether it is the same model
    for key, (described, configured) in said.items():
        if described != configured:
            raise UserError(
                f"{path} says {key} {described}, but the run's config.yaml says {configured}: the adapter "
                "comes from another run;\ncopy adapter.lora.h5 and adapter.json together from the run that made them"
            )


def _local(preset) -> bool:
    """A preset directory: config.yaml records it as an absolute path (config.absolute_paths)."""
    return isinstance(preset, str) and Path(preset).is_absolute()


def check_against_base(description: dict, backbone, rank: int, path: Path) -> list[tuple[int, object]]:
    """The description must fit the base model: same fingerprint, and each adapted layer where it says.

    Returns (index, layer) of each adapted layer, in the description's order.
    """
    described = description["preset"].get("fingerprint")
    actual = fingerprint(backbone)
    if described != actual:
        raise UserError(
            f"{path}: the adapter was trained on preset {description['preset'].get('name')} (base fingerprint "
            f"{str(described)[:12]}), but this base model's fingerprint is {actual[:12]}: another architecture"
        )
    layers = layers_with_weights(backbone)
    found = []
    for entry in description["adapted"]:
        index = entry.get("index")
        layer = layers[index] if isinstance(index, int) and 0 <= index < len(layers) else None
        if layer is None or layer.path != entry.get("layer"):
            raise UserError(f"{path}: adapted layer {entry.get('layer')} is not layer {index} of this base model")
        expected = factor_shapes(layer, rank, bool(description.get("dora")))
        for name in expected:
            if entry.get(name) != expected[name]:
                raise UserError(
                    f"{path}: {name} of {layer.path} has shape {entry.get(name)}, but rank {rank} on this base "
                    f"needs {expected[name]}"
                )
        found.append((index, layer))
    return found


def read_factors(path: Path, adapted: list[tuple[int, object]], rank: int, description: dict) -> dict:
    """{index: (A, B)}, or (A, B, magnitude) under DoRA, or an expert bank's (A, B) of each projection
    (factor_shapes' order), from a keras-hub .lora.h5, refused unless it holds exactly what adapter.json describes.

    keras-hub's load_lora_weights reads the file without checks: a damaged file
    ends in a raw OSError, another rank in a ValueError, and NaN weights load
    silently. Read through Keras' own H5 store, so its layout stays Keras' business.
    """
    import numpy as np

    fix = "retrain the run, or copy its adapter back from where it was made"
    try:
        store = keras_compat.h5_store(path, mode="r")
    except OSError as e:
        raise UserError(f"{path} is not a readable adapter ({str(e).splitlines()[0]}); {fix}") from None
    factors = {}
    try:
        if not store.has_path("lora"):
            raise UserError(f"{path} holds no LoRA weights (no `lora` group); {fix}")
        stored_rank = store.get("lora")["rank"][()]
        if np.ndim(stored_rank) != 0 or not np.issubdtype(np.asarray(stored_rank).dtype, np.integer):
            raise UserError(f"{path}: its LoRA rank is not a whole number ({np.shape(stored_rank)}); {fix}")
        if stored_rank != rank:
            raise UserError(
                f"{path} has LoRA rank {stored_rank}, but the run's config.yaml says {rank}; "
                "use the adapter this run saved"
            )
        stored = {int(key) for key in store.h5_file["lora"] if key.isdigit()}
        if stored != {index for index, _ in adapted}:
            raise UserError(
                f"{path} adapts {len(stored)} layers, but the run's config.yaml (lora.targets) gives "
                f"{len(adapted)}; use the adapter this run saved"
            )
        for index, layer in adapted:
            entry = store.get(f"lora/{index}")
            pair, shapes = [], factor_shapes(layer, rank, bool(description.get("dora")))
            for name in shapes:
                values = np.asarray(entry[name])
                want = tuple(shapes[name])
                if values.shape != want:
                    raise UserError(
                        f"{path}: {name} of layer {layer.name} has shape {values.shape}, expected {want}; {fix}"
                    )
                if not np.isfinite(values.astype(np.float32)).all():
                    raise UserError(f"{path}: layer {layer.name} has weights that are not finite (NaN or inf); {fix}")
                pair.append(values.astype(np.float32))
            factors[index] = tuple(pair)
    except (OSError, KeyError, ValueError, TypeError) as e:  # h5py on a damaged or edited file
        detail = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"{path} is not a readable adapter ({type(e).__name__}: {detail}); {fix}") from None
    finally:
        store.close()
    if weights_digest(factors) != description["weights_sha256"]:
        raise UserError(
            f"{path} does not hold the weights its adapter.json describes (their checksums differ): the two files "
            "come from different runs;\ncopy adapter.lora.h5 and adapter.json together from the run that made them"
        )
    return factors
