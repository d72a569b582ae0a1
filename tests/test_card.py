"""The model card `finetune publish` uploads, written from a run's record: here, run directories written by hand, as
a run writes them (config.yaml with its `resolved:` record, metrics.json), so that each part of the card is pinned
to what the run said."""

import json

import pytest
import yaml

from finetune import config as config_module
from finetune.exports import card
from finetune.model import presets
from finetune.training import outputs, runs

pytestmark = pytest.mark.one_backend  # pure Python: no Keras backend

RESOLVED = {
    "learning_rate": {"value": 0.0001, "why": "the default for a pretrained preset"},
    "packing": {"value": True, "why": "auto: examples packed | padding 3% of 16%"},
    "alpha": {"value": 4.0, "why": "the rank: a scale of 1, keras-hub's"},
    "output_dir": "/home/alice/runs/a",
    "versions": {"finetune": "0.2.0", "keras": "3.15.1", "keras-hub": "0.32.0"},
}
METRICS = {
    "steps": 40, "train_examples": 380, "eval_examples": 20, "eval_loss_before": 1.5, "eval_loss": 1.25,
    "eval_accuracy_before": 0.5, "eval_accuracy": 0.625, "eval_perplexity": 3.4903, "trained_tokens": 20480,
    "response_tokens": 9000,
}  # fmt: skip


def run_directory(tmp_path, settings: dict, family: str, metrics=METRICS) -> runs.Run:
    cfg = config_module.from_dict(settings)
    directory = tmp_path / "run"
    directory.mkdir(parents=True)
    written = {**outputs.run_config(cfg), "resolved": RESOLVED}
    (directory / outputs.CONFIG).write_text(yaml.safe_dump(written, sort_keys=False), encoding="utf-8")
    (directory / outputs.METRICS).write_text(json.dumps(metrics), encoding="utf-8")
    return runs.Run(directory, cfg, {"preset": {"name": cfg.model.preset, "family": family}})


def card_of(run: runs.Run, library="peft", to="hf://someone/gemma3-sft") -> tuple[dict, str]:
    licence = presets.licence_of(run.config.model.preset, run.adapter["preset"]["family"])
    text = card.model_card(run, card.Upload("the adapter for PEFT", library, to), licence)
    assert text.startswith("---\n")
    _, front, body = text.split("---\n", 2)
    return yaml.safe_load(front), body


def test_a_gemma_3_card_carries_the_gemma_terms_its_base_and_its_data(tmp_path):
    settings = {
        "model": {"preset": "hf://google/gemma-3-1b-it"},
        "data": {"path": "hf:databricks/databricks-dolly-15k"},
    }
    metadata, body = card_of(run_directory(tmp_path, settings, "gemma3"))
    assert metadata["license"] == "gemma" and metadata["license_link"] == "https://ai.google.dev/gemma/terms"
    assert metadata["base_model"] == "google/gemma-3-1b-it"
    assert metadata["datasets"] == ["databricks/databricks-dolly-15k"]
    assert metadata["library_name"] == "peft" and {"gemma3", "lora", "sft"} <= set(metadata["tags"])
    assert "Gemma is provided under and subject to the Gemma Terms of Use" in body  # the notice the terms ask for
    assert body.startswith("\n# gemma3-sft\n")


def test_a_gemma_4_card_is_apache_and_names_no_base_model_the_hub_lacks(tmp_path):
    metadata, body = card_of(run_directory(tmp_path, {"model": {"preset": "gemma4_2b"}}, "gemma4"))
    assert metadata["license"] == "apache-2.0" and "base_model" not in metadata
    assert "Gemma Terms of Use" not in body and "`gemma4_2b` (Gemma 4)" in body


@pytest.mark.parametrize("full", [False, True])
def test_the_card_says_what_goes_up_for_an_adapter_run_or_a_full_one_and_the_familys_loader(tmp_path, full):
    """A --full run has no adapter: its card said "with the adapter merged in", tagged lora. A Gemma 4 preset
    loads with its own class: keras-hub's CausalLM.from_preset takes another for its backbone."""
    from finetune.exports import publish

    run = run_directory(tmp_path, {"model": {"preset": "gemma4_2b", "full": full}}, "gemma4")
    licence = presets.licence_of("gemma4_2b", "gemma4")
    for form in ("merged", "hf", "gguf"):
        upload = card.Upload(publish.FORMS[form].what, publish.FORMS[form].library, "hf://me/x")
        text = card.model_card(run, upload, licence)
        _, front, body = text.split("---\n", 2)
        assert ("adapter" in body.split("## Base model")[0]) is not full, body
        assert ("every weight" in body.split("## Base model")[0]) is full, body
        assert ("lora" in yaml.safe_load(front)["tags"]) is not full
        assert ("| alpha | 4.0 |" in body) is not full  # LoRA's scale: a --full run decided it, and used none
        if form == "merged":
            assert "keras_hub.models.Gemma4CausalLM.from_preset" in body


def test_a_local_data_file_is_named_by_its_name_alone(tmp_path):
    settings = {"model": {"preset": "tiny"}, "data": {"path": "/home/alice/secret-project/train.jsonl"}}
    _, body = card_of(run_directory(tmp_path, settings, "gemma"))
    assert "`train.jsonl`" in body and "secret-project" not in body
    assert "/home/alice" not in body  # nor the run's own directory, which config.yaml's record names


def test_every_decision_and_held_out_metric_is_in_the_card(tmp_path):
    _, body = card_of(run_directory(tmp_path, {"model": {"preset": "tiny"}}, "gemma"))
    assert "| learning_rate | 0.0001 | the default for a pretrained preset |" in body
    assert "| packing | on | auto: examples packed \\| padding 3% of 16% |" in body  # a | in a reason stays in its cell
    assert "| loss | 1.5000 | 1.2500 |" in body and "| accuracy | 0.5000 | 0.6250 |" in body
    assert "| perplexity |  | 3.4903 |" in body  # no value before training: an empty cell
    assert "Held-out examples: 20." in body and "380 in the training set, 20 held out" in body
    assert "- trained: 40 steps over 20,480 tokens, the loss on 9,000 of them" in body and "keep-best" not in body
    kept = {**METRICS, "best_step": 30}
    (tmp_path / "best").mkdir()
    _, body = card_of(run_directory(tmp_path / "best", {"model": {"preset": "tiny"}}, "gemma", kept))
    assert "the adapter and its held-out metrics are step 30's" in body
    assert "- keras-hub 0.32.0" in body and "made with finetune 0.2.0" in body


def test_a_run_that_held_nothing_out_says_so(tmp_path):
    metrics = {"steps": 4, "train_examples": 40, "eval_examples": 0}
    _, body = card_of(run_directory(tmp_path, {"model": {"preset": "tiny"}}, "gemma", metrics))
    assert "The run held nothing out, so it has no held-out metrics." in body and "| loss |" not in body


def test_the_card_names_the_frameworks_the_run_used_not_every_one_installed(tmp_path):
    """A PyTorch run's card: its torch, and TensorFlow as keras-hub's tokenizers' (not as its backend); not JAX."""
    installed = {"finetune": "0.2.0", "keras": "3.15.1", "keras-hub": "0.32.0", "jax": "0.10.2", "torch": "2.13.0",
                 "tensorflow": "2.21.0"}  # fmt: skip
    for backend, shown, hidden in [("torch", "- torch 2.13.0", "jax"), ("jax", "- jax 0.10.2", "torch")]:
        run = run_directory(tmp_path / backend, {"backend": backend, "model": {"preset": "tiny"}}, "gemma")
        written = yaml.safe_load((run.directory / outputs.CONFIG).read_text())
        written["resolved"] = {**RESOLVED, "versions": installed}
        (run.directory / outputs.CONFIG).write_text(yaml.safe_dump(written, sort_keys=False), encoding="utf-8")
        _, body = card_of(run)
        assert shown in body and f"- {hidden} " not in body, body
        assert "- tensorflow 2.21.0 (keras-hub's tokenizers)" in body and "- keras 3.15.1" in body
