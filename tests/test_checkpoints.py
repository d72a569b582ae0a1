"""Transformers checkpoints as --preset (finetune/model/checkpoints.py): a local directory or hf://ORG/NAME.

The directories here are `finetune export --format hf` writes of the tiny presets: keras-hub's converter must
give the tiny base's logits back, and a run on one must start from the tiny run's loss. Offline, hf:// stops in
seconds. The refusals and the sizes the plan reads are pure Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import BACKEND, float32_policy

import finetune
from finetune.model import presets
from finetune.platform import platforms
from finetune.platform.errors import UserError
from finetune.training import plan

TOKENS = np.array([[2, 50, 61, 72, 83, 94, 105, 116, 127, 5, 6, 7, 300, 301]], dtype="int32")
# What `finetune export --format hf` writes for tiny (Gemma 1): transformers' names for TINY_CONFIG's sizes.
TINY_AS_TRANSFORMERS = {
    "model_type": "gemma", "architectures": ["GemmaForCausalLM"], "vocab_size": 811, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32,
}  # fmt: skip


def transformers_dir(path: Path, config: dict = TINY_AS_TRANSFORMERS, files=("model.safetensors", "tokenizer.model")):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    for name in files:
        (path / name).write_bytes(b"")
    return path


# === Pure Python: what a directory or handle is, and its sizes ===


def test_a_transformers_directory_is_told_by_its_model_type(tmp_path):
    source = presets.resolve(str(transformers_dir(tmp_path / "hf")))
    assert (source.kind, source.family, source.transformers) == ("local", "gemma", True)
    for model_type, family in [("gemma2", "gemma"), ("gemma3_text", "gemma3"), ("gemma4", "gemma4")]:
        described = dict(TINY_AS_TRANSFORMERS, model_type=model_type)
        assert presets.family_of(str(transformers_dir(tmp_path / model_type, described))) == family
    assert presets.frameworks_needed(str(tmp_path / "hf")) == ()  # Gemma 1 tokenizes without TensorFlow


@pytest.mark.parametrize(
    "config, files, says",
    [
        (TINY_AS_TRANSFORMERS, ("tokenizer.model",), "no safetensors weights"),
        (TINY_AS_TRANSFORMERS, ("pytorch_model.bin", "tokenizer.model"), "pytorch_model.bin, which keras-hub does not"),
        (TINY_AS_TRANSFORMERS, ("model.safetensors",), "no tokenizer (tokenizer.model or tokenizer.json)"),
        (dict(TINY_AS_TRANSFORMERS, model_type="llama"), (), "transformers llama model, not a Gemma"),
        (dict(TINY_AS_TRANSFORMERS, model_type="gemma3n_text"), (), "a transformers Gemma 3n"),
        (dict(TINY_AS_TRANSFORMERS, model_type="paligemma"), (), "a Gemma keras-hub does not convert"),
    ],
)
def test_a_transformers_directory_finetune_cannot_train_is_refused(tmp_path, config, files, says):
    path = transformers_dir(tmp_path / "hf", config, files)
    with pytest.raises(UserError) as refused:
        presets.resolve(str(path))
    assert says in str(refused.value)


def test_the_plan_reads_a_transformers_directory_as_the_preset_it_was_exported_from(tmp_path):
    from finetune.model import archs

    exported = plan.model_of(str(transformers_dir(tmp_path / "hf")))
    tiny = plan.model_of("tiny")
    sizes = ("vocabulary_size", "num_layers", "num_query_heads", "num_key_value_heads", "hidden_dim", "head_dim")
    for name in (*sizes, "ffw_dim"):
        assert getattr(exported.dims, name) == getattr(tiny.dims, name), name
    assert archs.parameter_count(exported.config, "gemma") == archs.parameter_count(tiny.config, "gemma")


def hub_cache(root: Path, repo: str, config: dict) -> Path:
    """A Hugging Face cache holding only `repo`'s config.json, laid out as huggingface_hub writes it."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return root


def test_an_hf_handle_offline_stops_in_seconds_naming_the_hub_and_hf_token(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(platforms, "reachable", lambda host, *a, **k: False)
    start = time.monotonic()
    with pytest.raises(UserError) as refused:
        presets.resolve("hf://google/gemma-2b")
    assert time.monotonic() - start < 5
    message = str(refused.value)
    assert "cannot reach huggingface.co to download hf://google/gemma-2b" in message and "HF_TOKEN" in message
    with pytest.raises(UserError, match="write it as hf://ORG/NAME"):
        presets.resolve("hf://gemma-2b")


def test_an_hf_handle_in_the_cache_is_read_offline_and_planned(tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = hub_cache(tmp_path / "cache", "google/gemma-2b", TINY_AS_TRANSFORMERS)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(platforms, "reachable", lambda host, *a, **k: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    source = presets.resolve("hf://google/gemma-2b")
    assert (source.kind, source.family, source.transformers) == ("hub", "gemma", True)
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # keras-hub then reads the cache instead of retrying
    assert presets.frameworks_needed("hf://google/gemma-2b") == ()
    assert plan.model_of("hf://google/gemma-2b").dims.hidden_dim == 128
    with pytest.raises(UserError, match="not in the Hugging Face cache|not there"):
        plan.model_of("hf://google/gemma-7b")


# === Through keras-hub's converter: the same model back ===


def exported_base(name: str, out: Path) -> Path:
    """The tiny preset's base written as `finetune export --format hf --base` writes it."""
    from finetune.exports import export
    from finetune.model import builder

    lm, preprocessor = builder.load_base(presets.resolve(name), 64)
    out.mkdir()
    export.write_transformers(out, lm.backbone, preprocessor.tokenizer)
    return out


def logits(lm):
    import keras

    inputs = {"token_ids": TOKENS, "padding_mask": np.ones_like(TOKENS, dtype=bool)}
    if "position_ids" in builder_inputs(lm):  # Gemma 4 takes the positions too
        inputs["position_ids"] = np.arange(TOKENS.shape[1], dtype="int32")[None]
    return keras.ops.convert_to_numpy(lm(inputs))


def builder_inputs(lm) -> tuple[str, ...]:
    from finetune.model import builder

    return builder.input_names(lm)


# tiny on every backend; each newer family on one, in turn, to keep the suites lean.
CONVERTED_ON = {"tiny": ("jax", "torch", "tensorflow"), "tiny-gemma3": ("torch",), "tiny-gemma4": ("tensorflow",)}


@pytest.mark.parametrize("name", list(CONVERTED_ON))
def test_an_exported_transformers_directory_loads_back_as_the_same_model(name, tmp_path):
    from finetune.model import builder

    if BACKEND not in CONVERTED_ON[name]:
        pytest.skip(f"{name} is converted in the {CONVERTED_ON[name][0]} suite")

    with float32_policy():
        tiny, tiny_preprocessor = builder.load_base(presets.resolve(name), 64)
        directory = exported_base(name, tmp_path / "hf")
        source = presets.resolve(str(directory))
        assert source.transformers and source.family == presets.TINY[name].family
        converted, preprocessor = builder.load_base(source, 64)
        np.testing.assert_allclose(logits(converted), logits(tiny), atol=1e-5)
    text = "Instruction:\nName a colour.\n\nResponse:\nBlue, 2 plus 33."
    ours, theirs = tiny_preprocessor.tokenizer, preprocessor.tokenizer
    assert np.asarray(theirs(text)).tolist() == np.asarray(ours(text)).tolist()
    assert preprocessor.sequence_length == 64
    assert builder.load_tokenizer(source).vocabulary_size() == ours.vocabulary_size()


def test_a_transformers_checkpoint_is_not_quantized_as_it_loads(tmp_path):
    from finetune.model import builder

    directory = exported_base("tiny", tmp_path / "hf")
    # float32: load_base takes keras' global policy, which an earlier run in this worker may have left at float16,
    # where keras refuses int8 before the checkpoint is looked at.
    with float32_policy(), pytest.raises(UserError, match="transformers checkpoint, converted as it loads"):
        builder.load_base(presets.resolve(str(directory)), 64, quantize="int8")


# === A run on an exported base starts where the tiny run starts ===

SETTINGS = {
    "backend": BACKEND, "model.seq_len": 64, "model.precision": "float32", "train.batch_size": 2,
    "train.max_steps": 1, "train.samples": 0, "data.max_records": 24,
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run_and_its_base(tmp_path_factory):
    """(the tiny run's metrics, its base exported with `finetune export --format hf --base`)."""
    root = tmp_path_factory.mktemp("checkpoints")
    with float32_policy():
        metrics = finetune.run(finetune.load_config("tiny", dict(SETTINGS, **{"output.dir": str(root / "tiny")})))
        finetune.export(root / "tiny", "hf", root / "base", base=True)
    return metrics, root / "base"


@pytest.mark.backend_neutral  # the converted base's logits: the test above
def test_a_run_on_the_exported_base_starts_at_the_tiny_runs_loss(tiny_run_and_its_base, tmp_path):
    metrics, base = tiny_run_and_its_base
    settings = dict(SETTINGS, **{"model.preset": str(base), "output.dir": str(tmp_path / "run")})
    with float32_policy():
        again = finetune.run(finetune.load_config("tiny", settings))
    assert abs(again["eval_loss_before"] - metrics["eval_loss_before"]) < 1e-3
    assert again["steps"] == 1


@pytest.mark.backend_neutral  # the exported base's loss is checked on every backend above
def test_the_command_trains_on_an_exported_base_in_a_fresh_process(tiny_run_and_its_base, tmp_path):
    metrics, base = tiny_run_and_its_base
    command = Path(sys.executable).with_name("finetune")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    args = ["gemma", "--recipe", "tiny", "--preset", str(base), "--backend", BACKEND, "--seq-len", "64",
            "--precision", "float32", "--batch-size", "2", "--max-steps", "1", "--max-records", "24",
            "--set", "train.samples=0", "--output", "run"]  # fmt: skip
    done = subprocess.run([str(command), *args], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    typed = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert abs(typed["eval_loss_before"] - metrics["eval_loss_before"]) < 1e-3


@pytest.mark.backend_neutral
def test_the_command_refuses_an_unreachable_hf_handle_in_seconds(tmp_path):
    command = Path(sys.executable).with_name("finetune")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "empty-cache"), HF_TOKEN="")
    env.pop("KERAS_BACKEND", None)
    args = ["gemma", "--preset", "hf://google/gemma-2b", "--backend", BACKEND, "--max-steps", "1"]
    done = subprocess.run([str(command), *args], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "HF_TOKEN" in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists()
