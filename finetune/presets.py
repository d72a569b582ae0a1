"""Which model a --preset names, and the embedded tiny Gemma.

A preset is one of: `tiny` (built here, offline), a local preset directory
(made by save_to_preset, or attached under /kaggle/input), a `kaggle://`
handle, or a keras-hub preset name such as gemma_2b_en or gemma3_1b. In a
Kaggle notebook, a name or handle whose model is attached is read from
/kaggle/input instead of being downloaded.
Kaggle-hosted ones need credentials; without them we stop in seconds with
instructions instead of waiting on a download that cannot work.
"""

from __future__ import annotations

import difflib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from finetune import platforms
from finetune.errors import UserError

TINY_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tiny" / "tokenizer.spm"
TINY_WEIGHTS = Path(__file__).resolve().parent / "assets" / "tiny" / "weights.npz"
# A smoke-test model, not an assistant: about 0.4M parameters, Gemma 1 layout,
# briefly pretrained on text generated like the sample (see tools/).
TINY_CONFIG = dict(
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=1,
    hidden_dim=128,
    intermediate_dim=512,
    head_dim=32,
)
# Learning rates a run uses when none is given. Gemma checkpoints take the
# Keras tutorial's 5e-5; the tiny model is small and barely pretrained, and
# needs a much larger step to move in a one-minute run.
LEARNING_RATE = {"tiny": 1e-2, "pretrained": 5e-5}


@dataclass(frozen=True)
class Source:
    kind: str
    """tiny, local or hub."""
    handle: str
    """What keras_hub's from_preset is given (or `tiny`)."""
    family: str
    """gemma (Gemma 1 and 2, GemmaCausalLM) or gemma3 (Gemma3CausalLM)."""

    @property
    def default_learning_rate(self) -> float:
        return LEARNING_RATE["tiny" if self.kind == "tiny" else "pretrained"]


def resolve(preset: str) -> Source:
    """Classify `preset` and check that it can be loaded, without loading it."""
    if preset == "tiny":
        return Source("tiny", "tiny", "gemma")
    path = Path(preset).expanduser()
    if path.is_dir():
        return Source("local", str(path), _family_of_directory(path))
    attached = _attached_in_kaggle_notebook(preset)
    if attached is not None:
        return Source("local", str(attached), _family_of_directory(attached))
    if preset.startswith("kaggle://"):
        family = "gemma3" if "gemma3" in preset or "gemma-3" in preset else "gemma"
        source = Source("hub", preset, family)
    elif "/" in preset or preset.startswith((".", "~")):
        raise UserError(
            f"preset directory {preset} does not exist; pass a directory made by save_to_preset, "
            "a preset name such as gemma_2b_en, or `tiny`"
        )
    else:
        source = Source("hub", preset, _family_of_name(preset))
    _check_hub_access(source.handle)
    return source


def _attached_in_kaggle_notebook(preset: str) -> Path | None:
    """In a Kaggle notebook, the attached copy of a hub preset, so that nothing is downloaded."""
    if not platforms.in_kaggle_notebook() or not (preset.startswith("kaggle://") or "/" not in preset):
        return None
    attached = platforms.attached_preset(preset)
    if attached is not None:
        print(f"note: using {preset} attached at {attached} instead of downloading it", file=sys.stderr)
    return attached


def _family_of_directory(path: Path) -> str:
    config = path / "config.json"
    if not config.is_file():
        raise UserError(f"{path} is not a keras-hub preset directory (no config.json); make one with save_to_preset")
    try:
        described = json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{config} is not valid JSON; re-create the preset with save_to_preset") from None
    if not isinstance(described, dict):
        raise UserError(
            f"{config} must hold a JSON object with a class_name, not a {type(described).__name__}; "
            "re-create the preset with save_to_preset"
        )
    class_name = str(described.get("class_name") or "")
    if "Gemma3" in class_name:
        return "gemma3"
    if "Gemma" in class_name:
        return "gemma"
    raise UserError(f"{path} holds a {class_name or 'non-Gemma'} model; finetune trains Gemma presets only")


def directory_backbone(path: Path) -> tuple[str, dict]:
    """The family and backbone config ("config" in config.json) of a local preset directory."""
    family = _family_of_directory(path)
    config = json.loads((path / "config.json").read_text(encoding="utf-8")).get("config")
    if not isinstance(config, dict):
        raise UserError(f'{path / "config.json"} has no backbone "config" mapping; re-create it with save_to_preset')
    return family, config


def known_names() -> dict[str, str]:
    import keras_hub

    names = {name: "gemma" for name in keras_hub.models.GemmaCausalLM.presets}
    names.update({name: "gemma3" for name in keras_hub.models.Gemma3CausalLM.presets})
    return names


def _family_of_name(name: str) -> str:
    names = known_names()
    if name in names:
        return names[name]
    close = difflib.get_close_matches(name, names, n=3)
    hint = f"did you mean {', '.join(close)}?" if close else "e.g. gemma_2b_en, gemma2_2b_en, gemma3_1b, or tiny"
    raise UserError(f"unknown preset {name!r}; {hint}")


def _check_hub_access(handle: str) -> None:
    if platforms.in_kagglehub_cache(handle):
        return
    if platforms.use_kaggle_secrets():
        print("note: using the Kaggle credentials from this notebook's secrets", file=sys.stderr)
    if not platforms.kaggle_credentials_present():
        raise UserError(
            f"preset {handle} is downloaded from Kaggle, and no Kaggle credentials were found. Set "
            "KAGGLE_USERNAME and KAGGLE_KEY (or write ~/.kaggle/kaggle.json) after accepting the Gemma "
            "license on kaggle.com;\nin a Kaggle notebook, attach the model (it is found under /kaggle/input) "
            "or add KAGGLE_USERNAME and KAGGLE_KEY as notebook secrets; or run offline with --preset tiny"
        )
    if not platforms.reachable("www.kaggle.com"):
        raise UserError(
            f"cannot reach kaggle.com to download {handle}; check the network, pass a local preset "
            "directory as --preset, or run offline with --preset tiny"
        )


def preset_sequence_length(source: Source) -> int:
    """The sequence length the preset's own preprocessor has, before a run sets its --seq-len."""
    import inspect

    import keras_hub

    if source.kind == "tiny":  # no preset files: the class default
        signature = inspect.signature(keras_hub.models.GemmaCausalLMPreprocessor.__init__)
        return signature.parameters["sequence_length"].default
    return keras_hub.models.CausalLMPreprocessor.from_preset(source.handle).sequence_length


def tiny_tokenizer():
    import keras_hub

    return keras_hub.models.GemmaTokenizer(proto=str(TINY_TOKENIZER))


def tiny_backbone(vocabulary_size: int, dtype=None):
    """The tiny GemmaBackbone with its shipped base weights (tools/make_tiny_weights.py).

    Loaded from a numpy file rather than initialised, so every backend starts
    from the same base model and an adapter trained on one applies on another.
    dtype: a policy, or quantized.policies' map: quantized kernels are filled from the float weights.
    """
    import keras_hub
    import numpy as np

    from finetune import quantized

    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=vocabulary_size, dtype=dtype, **TINY_CONFIG)
    with np.load(TINY_WEIGHTS) as stored:
        compressed = quantized.quantized_layers(backbone)
        for layer in compressed:
            quantized.fill(layer, stored[f"{layer.path}/kernel"].astype(np.float32))
        done = {id(v) for layer in compressed for v in layer.weights}
        for weight in backbone.weights:
            if id(weight) not in done:
                weight.assign(stored[weight.path].astype(np.float32))
    return backbone


def dims(source: Source):
    """The backbone's sizes, read without building it: the layouts are set before the weights exist.

    A hub preset's come from the package's table (archs.py) when it has them, else from the preset's
    config.json, which keras-hub downloads alone.
    """
    from finetune import archs, layouts

    if source.kind == "tiny":
        config = dict(TINY_CONFIG, vocabulary_size=tiny_tokenizer().vocabulary_size())
    elif source.kind == "local":
        _, config = directory_backbone(Path(source.handle))
    else:
        parts = source.handle.removeprefix("kaggle://").split("/")
        arch = archs.lookup(parts[3] if len(parts) > 3 else parts[0])
        if arch is not None:
            config = arch.config
        else:
            from keras_hub.src.utils.preset_utils import load_json

            config = load_json(source.handle).get("config", {})
    try:
        return layouts.Dims.from_backbone_config(config, source.family)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"preset {source.handle} has no usable backbone size {e} in its config.json") from None
