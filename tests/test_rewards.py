"""GRPO's reward functions: loading --reward, the built-ins, and the checks that stop a run."""

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
    table = rewards.score([reward], ["p", "q"], ["x", "y"], {"answer": ["x", "z"]}, [[1], [2]], 0)
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
        rewards.score([reward], ["first", "second"], ["a", "b"], {}, [[1], [2]], 2)


def test_none_is_not_a_number_but_allowed():
    reward = rewards.Reward("r", lambda prompts, completions, **kw: [None, 1])
    table = rewards.score([reward], ["p", "q"], ["a", "b"], {}, [[1], [2]], 0)
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
