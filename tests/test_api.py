"""The Python API a notebook uses: run, evaluate, generate and load, with the CLI's checks and messages.

End to end: whole tiny runs through finetune/__init__.py, which has no test file of its own but this one.
"""

import keras_hub
import pytest
from conftest import BACKEND

import finetune
from finetune import config
from finetune.platform import backend
from finetune.platform.errors import UserError


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "run"
    settings = {
        "backend": BACKEND, "output.dir": str(out), "model.seq_len": 64, "train.batch_size": 2,
        "train.max_steps": 2, "train.samples": 0, "data.max_records": 40,
    }  # fmt: skip
    metrics = finetune.run(finetune.load_config("tiny", settings))
    return out, metrics


def test_evaluate_gives_the_run_s_held_out_loss(finished):
    out, metrics = finished
    result = finetune.evaluate(out)
    assert result["loss"] == pytest.approx(metrics["eval_loss"], abs=1e-3) and result["examples"] > 0


def test_generate_takes_one_prompt_or_several(finished):
    out, _ = finished
    (one,) = finetune.generate(out, "Name a colour.", max_new_tokens=3)
    assert isinstance(one, str)
    assert len(finetune.generate(str(out), ["a", "b"], max_new_tokens=2)) == 2
    with pytest.raises(UserError, match="prompts must be non-empty strings"):
        finetune.generate(out, ["fine", " "])
    with pytest.raises(UserError, match="^system needs a chat template, and the run's is dolly"):
        finetune.generate(out, "Name a colour.", system="Be brief.")
    with pytest.raises(UserError, match="^tools holds no tools"):
        finetune.generate(out, "Name a colour.", tools=[])


def test_each_prompt_gets_its_own_max_new_tokens_whatever_shares_its_batch(finished):
    """keras-hub samples a batch to one length: beside a long prompt, a short one came back with 50 tokens for 5.
    Each answer is now its prompt's alone: the same beside others as by itself (greedy), within the budget."""
    out, _ = finished
    short, long = "Hi", "Name a city in France, and tell me about its rivers, its food and its people. " * 4
    (alone,) = finetune.generate(out, short, max_new_tokens=5)
    together = finetune.generate(out, [short, long], max_new_tokens=5)
    assert together[0] == alone
    tokenizer = finetune.load(out).preprocessor.tokenizer
    for text in together:
        assert len(tokenizer.tokenize(text)) <= 5 + 1, text  # a text may tokenize one piece apart from its ids


def test_load_returns_the_keras_hub_model_with_adapter_and_preprocessor(finished):
    out, _ = finished
    lm = finetune.load(out)
    assert isinstance(lm, keras_hub.models.CausalLM) and lm.preprocessor is not None
    assert lm.backbone._lora_enabled_layers  # keras-hub records the adapted layers here
    assert isinstance(lm.generate("Instruction:\nSay hi.\n\nResponse:\n", max_length=40), str)


def test_keras_dtype_policy_and_the_global_random_draws_are_the_caller_s_after_each_call(finished, tmp_path):
    """A bfloat16 run, and load and evaluate of it, set keras' global policy to the run's (mixed_bfloat16) and
    left it so: a notebook's next model was built in it; and a run reseeded Python's and NumPy's generators with
    its own seed. Each call now leaves them as it found them."""
    import random

    import keras
    import numpy as np

    out, _ = finished
    keras.config.set_dtype_policy("float32")
    random.seed(123)
    np.random.seed(123)
    expected = (random.random(), np.random.random())
    random.seed(123)
    np.random.seed(123)
    settings = {"backend": BACKEND, "output.dir": str(tmp_path / "bf16"), "model.seq_len": 32, "train.batch_size": 2,
                "train.max_steps": 1, "train.samples": 0, "data.max_records": 8, "model.precision": "bfloat16"}  # fmt: skip
    finetune.run(finetune.load_config("tiny", settings))
    assert (random.random(), np.random.random()) == expected  # the draws the notebook was making
    assert keras.config.dtype_policy().name == "float32"
    finetune.load(tmp_path / "bf16")
    finetune.evaluate(tmp_path / "bf16")
    assert keras.config.dtype_policy().name == "float32"
    assert keras.layers.Dense(2).compute_dtype == "float32"


def test_a_refusal_in_python_names_the_setting_or_argument_not_the_flag(finished, tmp_path):
    """A notebook has no --overwrite to pass: the refusal names what the caller sets instead."""
    out, _ = finished
    with pytest.raises(UserError, match="") as refused:
        finetune.run(finetune.load_config("tiny", {"backend": BACKEND, "output.dir": str(out)}))
    assert str(refused.value).endswith("already holds a run; pass output.overwrite=True to replace it or choose "
                                       "another output.dir")  # fmt: skip
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="already holds files; pass overwrite=True to replace them"):
        finetune.export(out, "lora", tmp_path / "taken")
    with pytest.raises(UserError, match="pass run_dir=DIR of a finished run"):
        finetune.evaluate(tmp_path / "taken")


def test_a_wrong_type_set_in_python_names_the_key():
    cfg = finetune.Config()
    cfg.lora.rank = "4"
    with pytest.raises(UserError, match="config key 'lora.rank' must be an integer"):
        finetune.run(cfg)
    cfg.lora.rank = 0
    with pytest.raises(UserError, match="LoRA rank must be at least 1"):
        finetune.run(cfg)


def test_a_setting_misspelt_on_a_config_by_hand_is_refused_by_name():
    """`cfg.lora.rnak = 8` added an attribute that no setting reads: the run trained at rank 4, silently."""
    cfg = finetune.Config()
    cfg.lora.rnak = 8
    with pytest.raises(UserError, match="unknown config key 'lora.rnak'; did you mean 'lora.rank'"):
        finetune.run(cfg)


@pytest.mark.parametrize(
    "call, said",
    [
        (lambda: finetune.load_config(42), "recipe must be a shipped recipe's name or a YAML file's path, got int"),
        (lambda: finetune.load_config("tiny", ["lora.rank=4"]), "overrides must be a dict of dotted keys"),
        (lambda: finetune.run("tiny"), r"cfg must be a Config .* pass finetune.load_config\('tiny'\)"),
    ],
)
def test_arguments_of_the_wrong_kind_are_refused_in_words(call, said):
    with pytest.raises(UserError, match=said):
        call()


def test_generate_refuses_a_budget_of_no_tokens(finished):
    """max_new_tokens 0 or below returned part of the prompt as the answer; the CLI refused it already."""
    out, _ = finished
    for tokens in (0, -1):
        with pytest.raises(UserError, match=f"^max_new_tokens must be at least 1, got {tokens}"):
            finetune.generate(out, "Name a colour.", max_new_tokens=tokens)


def test_a_dict_of_settings_is_a_config():
    with pytest.raises(UserError, match="unknown config key"):
        finetune.run({"lora": {"rnak": 4}})


def test_keras_backend_is_the_default_backend(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    assert finetune.Config().backend == "torch" and config.load(None, {}).backend == "torch"
    assert config.load(None, {"backend": "tensorflow"}).backend == "tensorflow"  # --backend wins
    monkeypatch.setenv("KERAS_BACKEND", "mxnet")
    with pytest.raises(UserError, match=r"unknown backend 'mxnet' \(from KERAS_BACKEND\)"):
        config.load(None, {})
    monkeypatch.delenv("KERAS_BACKEND")
    assert finetune.Config().backend == "jax"


def test_a_missing_backend_package_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == BACKEND else real(name, *a))
    with pytest.raises(UserError, match=rf"pip install 'finetune\[{BACKEND}\]'"):
        backend.select(BACKEND)
