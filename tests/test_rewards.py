"""GRPO's reward functions: loading --reward, the built-ins, and the checks that stop a run."""

import re

import numpy as np
import pytest

from finetune.methods import rewards
from finetune.platform.errors import UserError

pytestmark = pytest.mark.one_backend


def test_builtins_score_as_documented():
    ids = [[5, 6], [5, 6, 7, 8]]
    (fmt,) = rewards.load(["format:^<a>.*</a>$"], [], 8)
    assert fmt.function(["p", "p"], ["<a>x</a>", "no"]) == [1.0, 0.0]
    (length,) = rewards.load(["length"], [], 8)  # the target is half of --max-completion-length: 4 tokens
    assert length.function(["p", "p"], ["", ""], completion_ids=ids) == [0.5, 1.0]
    (exact,) = rewards.load(["exact"], [], 8)
    assert exact.function(["p", "p"], ["it is 42", "41"], answer=[" 42 ", "42"]) == [1.0, 0.0]
    (math,) = rewards.load(["math"], [], 8)
    got = math.function(["p"] * 3, ["so 1,234.0", "\\boxed{7} then 9", "none"], answer=["#### 1234", "7", "3"])
    assert got == [1.0, 1.0, 0.0]
    # A hyphen between numbers is no minus sign; an empty answer is none (every text would contain it).
    got = math.function(["p"] * 3, ["in 1914-1918", "pages 10-15", "x = -3"], answer=["1918", "15", "-3"])
    assert got == [1.0, 1.0, 1.0]
    assert math.function(["p"], ["7"], answer=[" "]) == [None]
    assert exact.function(["p", "p"], ["anything", "x"], answer=["", "  "]) == [None, None]
    # An answer given as a list (a question's aliases) accepts any of them; it scored 0 as the list's repr.
    got = exact.function(["p"] * 3, ["Paris!", "it is 7", "no"], answer=[["paris", "Paris"], ["7"], [" ", None]])
    assert got == [1.0, 1.0, None]
    assert math.function(["p", "p"], ["#### 8", "9"], answer=[["7", "8"], ["1"]]) == [1.0, 0.0]


def test_two_rewards_of_one_name_are_told_apart_in_order():
    names = [reward.name for reward in rewards.load(["length", "exact", "length"], [], 8)]
    assert names == ["length_1", "exact", "length_2"]


def test_a_file_function_gets_the_columns(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(
        "def f(prompts, completions, answer, **kw):\n    return [float(a == c) for a, c in zip(answer, completions)]\n"
    )
    (reward,) = rewards.load([f"{path}:f"], [2.0], 8)
    table = rewards.score([reward], ["p", "q"], ["x", "y"], {"answer": ["x", "z"], "completion_ids": [[1], [2]]}, 0)
    assert reward.weight == 2.0 and table.tolist() == [[1.0], [0.0]]


@pytest.mark.parametrize(
    "body, said",
    [("raise ValueError('boom')", "raised ValueError: boom"), ("return [1.0]", "returned 1 values for 2"),
     ("return [float('nan'), 1.0]", "returned nan"), ("return [float('inf'), 1.0]", "returned inf, not a finite")],
)  # fmt: skip
def test_a_bad_reward_stops_naming_itself_and_the_prompt(tmp_path, body, said):
    path = tmp_path / "bad.py"
    path.write_text(f"def judge(prompts, completions, **kw):\n    {body}\n")
    (reward,) = rewards.load([f"{path}:judge"], [], 8)
    with pytest.raises(UserError, match=f"judge {said}.*at step 3.*the prompt 'first'"):
        rewards.score([reward], ["first", "second"], ["a", "b"], {"completion_ids": [[1], [2]]}, 2)


def test_a_reward_returns_what_trl_takes(tmp_path):
    """What TRL's torch.tensor(...) takes is a reward here too: bools (a check's pass or fail), NumPy numbers and
    arrays, a 1-D tensor; an `async def` function (an LLM judge) is awaited; `log_metric` and `log_extra` are
    there to call, and the metrics logged are kept by name (ours keep theirs). Each was refused, exit 2, or a
    TypeError calling None; a tensor's refusal said "returned 2 values for 2 completions"."""
    import torch

    path = tmp_path / "trl.py"
    path.write_text(
        "import numpy as np, torch\n"
        "def passed(completions, **kw):\n    return [c.startswith('a') for c in completions]\n"
        "def flags(completions, **kw):\n    return np.array([c == 'b' for c in completions])\n"
        "def tensor(completions, **kw):\n    return torch.tensor([0.5, 2.0])\n"
        "async def judge(completions, **kw):\n    return [float(len(c)) for c in completions]\n"
        "def logs(completions, log_metric, log_extra, **kw):\n"
        "    log_metric('judge_calls', 1.0)\n    log_metric('reward', 5.0)\n    log_extra('why', ['x', 'y'])\n"
        "    return [np.float32(1.0), None]\n"
    )
    loaded = rewards.load([f"{path}:{name}" for name in ("passed", "flags", "tensor", "judge", "logs")], [], 8)
    logged = {}
    table = rewards.score(loaded, ["p", "q"], ["ab", "b"], {"completion_ids": [[1], [2]]}, 0, logged)
    np.testing.assert_array_equal(table[:, :4], [[1.0, 0.0, 0.5, 2.0], [0.0, 1.0, 2.0, 1.0]])
    assert table[0, 4] == 1.0 and np.isnan(table[1, 4])
    assert rewards.logged_metrics(logged, {"reward": 0.3}) == {"judge_calls": 1.0, "logged_reward": 5.0}
    assert torch.is_tensor(torch.tensor([1.0]))  # the tensor case ran on torch's own type


@pytest.mark.parametrize(
    "value, said",
    [("'ok'", "returned str, not one reward per completion"), ("[[1.0, 2.0]] * 2", "returned an array of shape (2, 2)"),
     ("['1', 2.0]", "returned '1', not a finite number"), ("[np.array([1.0]), 2.0]", "returned array([1.]), not a finite number")],
)  # fmt: skip
def test_a_reward_of_another_kind_stops_naming_what_it_returned(tmp_path, value, said):
    path = tmp_path / "odd.py"
    path.write_text(f"import numpy as np\ndef odd(completions, **kw):\n    return {value}\n")
    (reward,) = rewards.load([f"{path}:odd"], [], 8)
    with pytest.raises(UserError, match=f"odd {re.escape(said)}"):
        rewards.score([reward], ["first", "second"], ["a", "b"], {"completion_ids": [[1], [2]]}, 2)


def test_none_is_not_a_number_but_allowed():
    reward = rewards.Reward("r", lambda prompts, completions, **kw: [None, 1])
    table = rewards.score([reward], ["p", "q"], ["a", "b"], {"completion_ids": [[1], [2]]}, 0)
    assert np.isnan(table[0, 0]) and table[1, 0] == 1.0


def test_load_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(UserError, match="learns from rewards"):
        rewards.load([], [], 8)
    with pytest.raises(UserError, match="2 weights for 1"):
        rewards.load(["exact"], [1.0, 2.0], 8)
    with pytest.raises(UserError, match="no file"):
        rewards.load([f"{tmp_path}/none.py:f"], [], 8)
    with pytest.raises(UserError, match="has no function"):
        rewards.load(["json:no_such_function"], [], 8)
