"""The method registry (methods/registry.py): every method whole, and no method asked for outside finetune/methods/.

A method's differences live in its module; a feature below the methods holds for every method. The walk below
fails on any comparison of a `method` value with a constant outside finetune/methods/, the shape the 16 forks
the registry replaced had (`if cfg.train.method != "sft":`).
"""

import ast
from pathlib import Path

import pytest

from finetune import config
from finetune.methods import registry
from finetune.methods.method import Method
from finetune.platform.errors import UserError

pytestmark = pytest.mark.one_backend  # no Keras backend: the code's shape and the registry's names
PACKAGE = Path(__file__).resolve().parent.parent / "finetune"


def method_forks(root: Path) -> list[str]:
    """file:line of each comparison of a `method` name or attribute with a constant, outside finetune/methods/."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "methods" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = any(
                (isinstance(s, ast.Name) and s.id == "method") or (isinstance(s, ast.Attribute) and s.attr == "method")
                for s in sides
            )
            constant = any(isinstance(s, (ast.Constant, ast.Tuple, ast.List, ast.Set)) for s in sides)
            if named and constant:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_no_code_outside_the_registry_asks_which_method_runs():
    assert method_forks(PACKAGE) == []


def test_the_walk_finds_a_fork(tmp_path):
    (tmp_path / "fork.py").write_text("def f(cfg):\n    if cfg.train.method != 'sft':\n        return 1\n")
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "inside.py").write_text("method = 'x'\nok = method == 'x'\n")
    assert method_forks(tmp_path) == [f"{tmp_path.name}/fork.py:2"]


def test_the_flag_offers_the_registry_s_methods():
    assert config.METHODS == tuple(registry.METHODS)


@pytest.mark.parametrize("name", list(registry.METHODS))
def test_every_method_is_whole(name):
    """Each method overrides every step the base leaves to it (those that raise NotImplementedError there)."""
    method = registry.get(name)
    assert method.name == name and method.title and method.why
    left = [
        step
        for step in ("prepare", "evaluated_on", "order", "held_out_scores", "evaluate", "objective")
        if getattr(type(method), step) is getattr(Method, step)
    ]
    assert left == []


def test_an_unknown_method_is_refused_with_the_names():
    with pytest.raises(UserError, match="unknown method 'kto'; choose sft, dpo"):
        registry.get("kto")


@pytest.mark.parametrize(
    "method, setting, message",
    [
        ("orpo", {"label_smoothing": 0.1}, "--label-smoothing is DPO's; --method orpo has none"),
        ("dpo", {"simpo_gamma": 0.1}, "--simpo-gamma is SimPO's"),
        ("sft", {"beta": 0.1}, "--beta is a setting of DPO, IPO, ORPO, SimPO, GRPO and RLOO; --method sft has none"),
    ],
)
def test_a_constant_of_another_method_is_refused(method, setting, message):
    train = config.TrainConfig(method=method, **setting)
    data = "alpaca" if method == "sft" else "preference"
    with pytest.raises(UserError, match=message):
        registry.decide(train, data)


def test_each_method_decides_its_constants_with_their_reasons():
    decided = registry.decide(config.TrainConfig(method="simpo", beta=2.5), "preference")
    assert decided["beta"] == (2.5, "set") and decided["simpo_gamma"][0] == 0.5
    assert registry.decide(config.TrainConfig(), "alpaca") == {
        "method": ("sft", "supervised: the response tokens' cross-entropy")
    }


@pytest.mark.parametrize("name", list(registry.METHODS))
@pytest.mark.parametrize("data_format", ["alpaca", "preference", "prompts"])
def test_each_method_takes_one_kind_of_records_in_training_and_in_eval_alike(name, data_format):
    """Method.takes is the one answer: training (registry.decide) and eval/predict (runs._check_kind) refuse the
    same formats, each naming the data's."""
    from finetune.data import formats
    from finetune.training import runs

    method = registry.get(name)
    train = config.TrainConfig(method=name, reward=["exact"] if method.prompted else [])
    takes = formats.kind(data_format) == method.takes
    refusals = []
    for check in (lambda: registry.decide(train, data_format), lambda: runs._check_kind(method, data_format, "d")):
        try:
            check()
        except UserError as e:
            refusals.append(str(e))
    assert refusals == [] if takes else len(refusals) == 2 and all(data_format in r for r in refusals), refusals
