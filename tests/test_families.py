"""The newer families end to end, on their tiny presets: train, resume, export, on this process' backend.

One short run per family (module fixture, packed) serves every check: its
eval loss falls; a copy of it cut back to what a kill -9 right after its
step-3 checkpoint leaves on disk (that checkpoint, no results: what
tests/test_resume.py gets by killing `tiny` for real) resumes to the same
adapter, bit for bit; the merged export loads in plain keras-hub with the
run's logits; and, in the PyTorch suite, the hf and peft exports give them
in transformers and PEFT. Packing is checked on the models directly in
tests/test_packing.py.
"""

import json
import shutil

import h5py
import numpy as np
import pytest
from conftest import BACKEND, float32_policy, write_jsonl

import finetune
from finetune import checkpoint, families, model, outputs, presets

FAMILIES = ["tiny-gemma3", "tiny-gemma4", "tiny-gemma4-moe", "tiny-gemma3n"]
TARGETS = ["query", "key", "value", "attention_output", "ffw_gating", "ffw_gating_2", "ffw_linear"]
TOKENS = np.array([[2, 50, 61, 72, 83, 94, 105, 116, 127, 5, 6, 7, 300, 301]], dtype="int32")
in_torch_suite = pytest.mark.skipif(BACKEND != "torch", reason="transformers and PEFT are checked in the PyTorch suite")


def settings(preset, out, data, **more):
    return {
        "backend": BACKEND, "output.dir": str(out), "model.preset": preset, "model.seq_len": 32,
        "model.precision": "float32", "train.batch_size": 2, "train.max_steps": 6, "train.checkpoint_every": 3,
        "train.samples": 0, "data.path": str(data), "data.max_records": 24,
        "lora.rank": 4, "lora.alpha": 8.0, "lora.targets": TARGETS, **more,
    }  # fmt: skip


def logits(lm, tokens=TOKENS):
    import keras

    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    if "position_ids" in model.input_names(lm):
        x["position_ids"] = np.arange(tokens.shape[1])[None].astype("int32")
    return keras.ops.convert_to_numpy(lm(x))


def adapter_arrays(path):
    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: arrays.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None)
    return arrays


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    records = [{"instruction": f"What is {i} plus {i + 1}?", "response": f"{2 * i + 1}."} for i in range(24)]
    return write_jsonl(tmp_path_factory.mktemp("data") / "sums.jsonl", records)


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request, data, tmp_path_factory):
    """(preset, run directory, metrics, the fine-tuned model's logits on TOKENS)."""
    out = tmp_path_factory.mktemp(request.param) / "run"
    with float32_policy():
        metrics = finetune.run(finetune.load_config("tiny", settings(request.param, out, data)))
        tuned = logits(finetune.load(out))
    return request.param, out, metrics, tuned


def test_a_tiny_family_preset_trains_and_packs(trained):
    preset, out, metrics, _ = trained
    assert metrics["eval_loss"] < metrics["eval_loss_before"]
    assert metrics["packing"] is True and metrics["steps"] == 6
    described = json.loads((out / "adapter.json").read_text())
    assert described["preset"]["family"] == presets.TINY[preset].family
    assert len(described["adapted"]) > len(TARGETS)  # every kind of block took its adapters


def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_adapter(trained, data, tmp_path):
    preset, whole, _, _ = trained
    out = tmp_path / "killed"
    shutil.copytree(whole, out)
    for found in checkpoint.find(out):  # what a kill right after step 3's checkpoint leaves
        if found.step > 3:
            shutil.rmtree(found.path)
    (out / outputs.METRICS).unlink()
    with float32_policy():
        metrics = finetune.run(finetune.load_config("tiny", settings(preset, out, data)), resume=True)
    assert metrics["resumed_from_step"] == 3 and metrics["steps"] == 6
    expected, got = adapter_arrays(whole / "adapter.lora.h5"), adapter_arrays(out / "adapter.lora.h5")
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_merged_and_lora_exports_give_the_run_s_logits(trained, tmp_path):
    preset, out, _, tuned = trained
    finetune.export(out, "lora", tmp_path / "lora")
    finetune.export(out, "merged", tmp_path / "merged")
    with float32_policy():
        merged = families.keras_hub_class(families.get(presets.TINY[preset].family)).from_preset(
            str(tmp_path / "merged")
        )
    assert type(merged).__name__ == families.get(presets.TINY[preset].family).causal_lm
    np.testing.assert_allclose(logits(merged), tuned, atol=1e-4)


@in_torch_suite
def test_hf_and_peft_exports_give_the_run_s_logits_in_transformers(trained, tmp_path):
    transformers = pytest.importorskip("transformers", reason="checked in transformers: pip install 'finetune[hf]'")
    peft = pytest.importorskip("peft", reason="checked in PEFT: pip install 'finetune[hf]'")
    import torch

    preset, out, _, tuned = trained
    family = families.get(presets.TINY[preset].family)

    def hf_logits(hf_model):
        with torch.no_grad():
            return hf_model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()

    hf = transformers.AutoModelForCausalLM.from_pretrained(finetune.export(out, "hf", tmp_path / "hf"))
    assert type(hf).__name__ == family.transformers
    np.testing.assert_allclose(hf_logits(hf), tuned, atol=1e-4)
    base = transformers.AutoModelForCausalLM.from_pretrained(finetune.export(out, "hf", tmp_path / "base", base=True))
    adapted = peft.PeftModel.from_pretrained(base, finetune.export(out, "peft", tmp_path / "peft"))
    np.testing.assert_allclose(hf_logits(adapted), tuned, atol=1e-4)
