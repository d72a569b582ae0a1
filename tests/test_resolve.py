"""resolve(): each `auto` and unset setting decided once, with its reason; a resumed run keeps what its
checkpoint decided; the user's Config is never changed."""

import dataclasses
import json

import pytest
from conftest import BACKEND, chat, write_jsonl

from finetune import config
from finetune.config import Config
from finetune.model import presets
from finetune.platform import backend
from finetune.platform.errors import UserError
from finetune.training import resolve

TINY = presets.Source("tiny", "tiny", "gemma")


def tiny_config(**train) -> Config:
    cfg = config.load("tiny", {"backend": BACKEND})
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def test_auto_precision_is_the_one_rule_here_and_in_the_plan():
    """backend.precision_rule decides for this process and for the plan of a device elsewhere."""
    from finetune.training import plan

    assert backend.precision_rule("gpu", True, "torch", None)[0] == "bfloat16"
    assert backend.precision_rule("gpu", False, "torch", None) == (
        "float16",
        "auto: the gpu has no bf16 units (T4, V100)",
    )
    assert backend.precision_rule("cpu", False, "jax", None)[0] == "float32"
    assert plan.auto_precision(plan.device("t4")) == "float16"
    assert plan.auto_precision(plan.device("a100")) == "bfloat16"
    decided, why = backend.auto_precision_why("cpu")
    assert decided == backend.cpu_precision(BACKEND) and why.startswith("auto: ")


OVERFLOWING = ("gemma3", "gemma3n", "gemma4")


@pytest.mark.one_backend
def test_auto_never_picks_float16_for_gemma_3_3n_or_4(monkeypatch):
    """Their activations pass float16's 65,504 (keras-hub clamps Gemma 3 and 4 there, silently, and leaves 3n
    unclamped): where float16 is the fast dtype, auto picks float32 for them and says why; Gemma 1 and 2 keep it."""
    from finetune.model import families

    assert {name for name, f in families.FAMILIES.items() if f.float16_overflows} == set(OVERFLOWING)
    for name in OVERFLOWING:
        overflows = families.get(name).float16_overflows
        chosen, why = backend.precision_rule("gpu", False, "torch", overflows)  # a T4
        assert chosen == "float32" and "65,504" in why and families.get(name).title in why, why
        assert backend.precision_rule("gpu", True, "jax", overflows)[0] == "bfloat16"  # an A100: bf16 has the range
        assert backend.precision_rule("tpu", True, "jax", overflows)[0] == "bfloat16"
    # An Intel CPU with AVX512-FP16 but no AMX, where float16 is the fast dtype under PyTorch and TensorFlow.
    monkeypatch.setattr(backend, "cpu_flags", lambda: {"avx512_fp16", "avx512_bf16"})
    assert backend.precision_rule("cpu", False, "torch", None)[0] == "float16"
    chosen, why = backend.precision_rule("cpu", False, "torch", families.get("gemma3n").float16_overflows)
    assert chosen == "float32" and "does not clamp" in why


@pytest.mark.one_backend
@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma3", "tiny-gemma3n", "tiny-gemma4"])
@pytest.mark.parametrize("card, bf16", [("t4", False), ("a100", True)])
def test_the_plan_and_the_run_pick_the_same_precision(monkeypatch, preset, card, bf16):
    """`finetune plan --device-memory t4` says what a run on a T4 decides: float32 for Gemma 3, 3n and 4, float16
    for Gemma 1 and 2 (the run asks the framework whether the gpu has bf16: here it is told)."""
    from finetune.training import plan

    cfg = config.load("tiny", {"backend": "torch", "model.preset": preset})
    planned = plan.make(cfg, target=plan.device(card))
    monkeypatch.setattr(backend, "supports_bfloat16", lambda device: bf16)
    decided = resolve._precision(cfg, "gpu", None)
    assert planned.precision == decided.value
    assert decided.value == ("bfloat16" if bf16 else "float16" if preset == "tiny" else "float32"), decided
    assert any(note.startswith(f"precision auto is {decided.value} on {card}") for note in planned.notes)


@pytest.mark.one_backend
def test_explicit_float16_on_gemma_3_is_warned_once_and_kept(capsys):
    cfg = config.load("tiny", {"backend": "torch", "model.preset": "tiny-gemma3", "model.precision": "float16"})
    decided = resolve._precision(cfg, "gpu", None)
    assert decided.value == "float16" and decided.why.startswith("set; warned: ") and "65,504" in decided.why
    assert capsys.readouterr().out.count("warning: --precision float16") == 1
    resolve._precision(config.load("tiny", {"backend": "torch", "model.precision": "float16"}), "gpu", None)
    assert "warning" not in capsys.readouterr().out  # Gemma 1 and 2 compute right in float16


def test_precision_is_the_user_s_the_checkpoint_s_or_auto_s():
    cfg = tiny_config()
    assert resolve._precision(cfg, "cpu", None) == resolve.Decision(*backend.auto_precision_why("cpu"))
    saved = {"model": {"precision": "float16"}}
    assert resolve._precision(cfg, "cpu", saved) == resolve.Decision(
        "float16", "resumed: auto chose it when the run started"
    )  # a run started on a T4 goes on in float16 wherever it resumes
    cfg.model.precision = "float32"
    assert resolve._precision(cfg, "cpu", saved) == resolve.Decision("float32", "set")  # check_compatible refuses


def test_a_resumed_run_keeps_its_cpu_thread_count():
    """PyTorch's CPU sums follow its thread count: picked from the idle cores when a run starts, it is kept for the
    resume (one worker of a busy machine picked 1 where the run had 2, and the adapter differed in its last bits)."""
    saved = {"train": {"threads": 2}}
    assert resolve._threads(tiny_config(), saved) == 2
    assert resolve._threads(tiny_config(threads=1), saved) == 1  # the user's own count wins
    assert resolve._threads(tiny_config(), {"train": {}}) is None  # a checkpoint from before: chosen afresh


def test_batch_size_is_set_resumed_probed_or_the_backend_s_default():
    assert resolve._batch_size(tiny_config(batch_size=3), None) == resolve.Decision(3, "set")
    assert resolve._batch_size(tiny_config(batch_size="auto"), {"train": {"batch_size": 8}}).value == 8
    assert resolve._batch_size(tiny_config(batch_size="auto"), None).value == "auto"
    default = resolve._batch_size(tiny_config(batch_size=None), None)
    assert default == resolve.Decision(backend.DEFAULT_BATCH_SIZE[BACKEND], f"the {BACKEND} default")


def test_learning_rate_is_set_resumed_or_the_preset_kind_s_default():
    assert resolve._learning_rate(tiny_config(learning_rate=0.5), TINY, None) == resolve.Decision(0.5, "set")
    assert (
        resolve._learning_rate(tiny_config(learning_rate=None), TINY, {"train": {"learning_rate": 0.25}}).value == 0.25
    )
    decided = resolve._learning_rate(tiny_config(learning_rate=None), TINY, None)
    assert decided.value == presets.LEARNING_RATE["tiny"] and "tiny" in decided.why
    pretrained = resolve._learning_rate(tiny_config(learning_rate=None), presets.Source("hub", "x", "gemma"), None)
    assert pretrained.value == presets.LEARNING_RATE["pretrained"]


def test_template_follows_the_data_or_the_checkpoint():
    cfg = tiny_config()
    cfg.data.template = "auto"
    assert resolve._template(cfg, "dolly", None) == resolve.Decision(
        "dolly", "auto: for dolly records (--template names another)"
    )
    assert resolve._template(cfg, "chat", None).value == "gemma-chat"
    assert resolve._template(cfg, "chat", {"data": {"template": "alpaca"}}).value == "alpaca"
    cfg.data.template = "alpaca"
    assert resolve._template(cfg, "dolly", None) == resolve.Decision("alpaca", "set")
    cfg.data.template = "none"
    with pytest.raises(UserError, match="need a template"):
        resolve._template(cfg, "dolly", None)


def test_alpha_is_the_rank_unless_set():
    cfg = tiny_config()
    assert resolve.alpha(cfg.lora) == resolve.Decision(4.0, "the rank: a scale of 1, keras-hub's")
    cfg.lora.alpha = 8
    assert resolve.alpha(cfg.lora) == resolve.Decision(8.0, "set")


def test_resolve_decides_every_auto_setting_and_leaves_the_config_alone(tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(12)])
    cfg = config.load(
        "tiny", {"backend": BACKEND, "data.path": str(data), "data.template": "auto", "train.learning_rate": None}
    )
    before = json.dumps(cfg.to_dict(), sort_keys=True)
    run = resolve.resolve(cfg, "chat")
    assert json.dumps(cfg.to_dict(), sort_keys=True) == before  # the user's settings, untouched
    assert run.template == "gemma-chat" and run.precision != "auto" and run.learning_rate == 1e-2
    assert run.batch_size == backend.DEFAULT_BATCH_SIZE[BACKEND] and run.remat is False
    assert run.decisions["time_limit"] == resolve.Decision("off", "none asked")
    assert all(isinstance(d.why, str) and d.why for d in run.decisions.values())
    recipe = run.recipe()
    assert (recipe.precision, recipe.lora.rank, recipe.lora.resolved_alpha()) == (run.precision, 4, 4.0)
    assert recipe.optimizer.learning_rate == 1e-2 and run.recipe(train=False).optimizer is None


def test_settled_fills_in_what_needed_the_model_and_the_table_shows_every_decision():
    run = resolve.resolve(tiny_config(batch_size="auto"), "dolly")
    assert run.batch_size == "auto" and run.packed is None
    settled = run.settled(packing=resolve.Decision(True, "auto: packs"), batch_size=resolve.Decision(8, "probed"))
    assert settled.batch_size == 8 and settled.packed is True and run.batch_size == "auto"
    lines = settled.table().splitlines()
    assert lines[0].split() == ["setting", "value", "why"]
    assert [line.split()[:2] for line in lines[1:]] == [[n, resolve.shown(d.value)] for n, d in
                                                       settled.decisions.items()]  # fmt: skip
    assert settled.recorded()["batch_size"] == {"value": 8, "why": "probed"}


def test_packing_is_decided_from_the_built_model(monkeypatch):
    from finetune.methods.supervised import SFT
    from finetune.model import attention

    class LM:
        backbone = object()

    monkeypatch.setattr(attention, "packs_exactly", lambda backbone: True)
    assert resolve.packing(LM(), "auto", SFT).value is True and resolve.packing(LM(), "on", SFT) == resolve.Decision(
        True, "set"
    )
    monkeypatch.setattr(attention, "packs_exactly", lambda backbone: False)  # blocks without the per-example mask
    assert resolve.packing(LM(), "off", SFT) == resolve.Decision(False, "set")
    with pytest.raises(UserError, match="--packing on"):
        resolve.packing(LM(), "on", SFT)
    assert resolve.packing(LM(), "auto", SFT).value is False


def test_a_finished_run_is_rebuilt_as_it_trained():
    cfg = tiny_config()
    cfg.model.precision = "float32"
    run = resolve.finished(cfg)
    assert run.precision == "float32" and run.recipe(train=False).optimizer is None and run.alpha == 4.0


def test_records_in_any_format_resolve(tmp_path):
    """Every template auto picks renders its format (templates.for_data), decided here once."""
    cfg = tiny_config()
    cfg.data.template = "auto"
    for found in ("dolly", "alpaca", "chat", "sharegpt", "completion", "text"):
        assert resolve._template(cfg, found, None).why.startswith("auto")


def test_pairs_pack_as_sft_s_examples_do(monkeypatch):
    """Pairs pack as SFT's examples do (issue 34), --parallel or not: a packed micro-batch splits over the data
    shards (pair_packing.inputs), where packing used to be turned off."""
    from finetune.methods.preference import DPO
    from finetune.model import attention

    class LM:
        backbone = object()

    monkeypatch.setattr(attention, "packs_exactly", lambda backbone: True)
    packed = resolve.packing(LM(), "auto", DPO)
    assert packed.value is True and "pairs packed" in packed.why
    assert resolve.packing(LM(), "on", DPO).value is True


@pytest.mark.one_backend
def test_controls_the_run_s_length_leaves_idle_are_noted():
    """A warmup as long as the run, --eval-every past its end, an --early-stop or --keep-best with too few
    evaluations: each runs as asked, with a note (they were silent)."""
    cfg = Config()
    assert resolve.plan_notes(cfg, total=30, warmup=3, steps_per_epoch=10) == []
    (warm,) = resolve.plan_notes(cfg, total=3, warmup=10, steps_per_epoch=10)
    assert "the warmup takes 10 steps and the run 3" in warm and "0.2x" in warm
    cfg.eval.every, cfg.eval.early_stop, cfg.eval.keep_best = 10, 2, True
    said = " | ".join(resolve.plan_notes(cfg, total=3, warmup=0, steps_per_epoch=10))
    assert "--eval-every 10 is past the run's 3 steps: the held-out split is scored 1 time" in said
    assert "--early-stop 2 needs more evaluations than the run's 1" in said and "--keep-best has one" in said
    cfg.eval.every = 1  # three evaluations: early stop after two without a better one can act
    assert resolve.plan_notes(cfg, total=3, warmup=0, steps_per_epoch=10) == []
