"""GRPO's reward functions: loaded from --reward, called on each batch of rollouts, checked.

A reward function has TRL's signature, `f(prompts, completions, **columns) -> list[float | None]`: `prompts`
and `completions` are lists of text (of messages for conversational prompts: the completion is then
[{"role": "assistant", "content": TEXT}]), and every other key of the prompt records (answer, solution...)
comes as a list beside them, as do `completion_ids` (each completion's token ids) and `trainer_state` (None
here). None says the function does not apply to a completion; a completion no function applies to scores 0
and has no advantage, as TRL's.

--reward names one: FILE.py:FUNCTION, module:function, a built-in (BUILT_INS, docs/rl.md), or run:DIR, a trained
reward model (methods/reward.py). A function that
raises, returns the wrong count or a NaN stops the run: nothing it scored can be trusted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from finetune.platform.errors import UserError

BUILT_INS = {
    "format:REGEX": "1 where the completion matches REGEX (re.search, DOTALL), else 0",
    "length[:TOKENS]": "1 - |tokens - TOKENS| / TOKENS, at least 0: 1 at TOKENS completion tokens; TOKENS is half "
    "of --max-completion-length unless given",
    "exact": "1 where the record's `answer` (or one of a list of them), stripped, appears in the completion, else 0",
    "math": "1 where the completion's answer equals the record's `answer` as numbers (math-verify where it is "
    "installed; else the last number of each, after GSM8K's '####' or inside \\boxed{} where those are), else 0",
    "run:DIR": "the score a trained reward model (a finished --method reward run) gives the prompt and completion",
}
NONE_GIVEN = ("--method grpo learns from rewards: pass --reward FILE.py:FUNCTION (or a built-in: "
              f"{', '.join(BUILT_INS)}), once per reward function")  # fmt: skip


@dataclass(frozen=True)
class Reward:
    """One reward function and its weight in the total.

    name: str. As metrics name it (the function's __name__, or the built-in's).
    function: callable(prompts, completions, **columns) -> list of float or None.
    weight: float.
    """

    name: str
    function: object
    weight: float = 1.0

    def check_prompts(self, records) -> None:
        """Refuse prompts the function cannot score, before any rollout, where it says which (its own
        `check_prompts`: a reward run's template, fixed when it trained, must render them with their completions)."""
        check = getattr(self.function, "check_prompts", None)
        if callable(check):
            check(records)


def refused(specs: list, weights: list) -> str | None:
    """Why --reward and --reward-weights cannot be taken as given, before any function loads; None when they can."""
    if not specs:
        return NONE_GIVEN
    if weights and len(weights) != len(specs):
        return f"--reward-weights gives {len(weights)} weights for {len(specs)} --reward functions; give one each, in order"
    return None


def load(specs: list, weights: list, max_completion_length: int) -> list[Reward]:
    """The rewards --reward names, with --reward-weights (1 each when none are given)."""
    refusal = refused(specs, weights)
    if refusal:
        raise UserError(refusal)
    functions = [function_of(spec, max_completion_length) for spec in specs]
    given = [name for name, _ in functions]
    seen, names = {}, []
    for name in given:  # two rewards of one name get their metrics apart: name_1, name_2
        seen[name] = seen.get(name, 0) + 1
        names.append(f"{name}_{seen[name]}" if given.count(name) > 1 else name)
    return [Reward(name, f, float(w)) for name, (_, f), w in zip(names, functions, weights or [1.0] * len(specs))]


def function_of(spec: str, max_completion_length: int):
    """(name, function) of one --reward SPEC."""
    built = built_in(spec, max_completion_length)
    if built is not None:
        return built
    if spec.startswith("run:"):
        from finetune.methods import reward

        return "reward_model", reward.RewardRun.opened(spec)
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UserError(f"--reward {spec!r}: give FILE.py:FUNCTION, module:function or a built-in "
                        f"({', '.join(BUILT_INS)})")  # fmt: skip
    if where.endswith(".py") or "/" in where:
        module = _module_from_file(Path(where), spec)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise UserError(f"--reward {spec!r}: cannot import {where} ({e})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"--reward {spec!r}: {where} has no function {name!r}")
    return name, function


def _module_from_file(path: Path, spec: str):
    if not path.is_file():
        raise UserError(f"--reward {spec!r}: no file {path}")
    module_name = f"finetune_reward_{path.stem}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up
    try:
        loader.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: anything it raises is the user's to fix
        raise UserError(f"--reward {spec!r}: {path} failed to load ({type(e).__name__}: {e})") from None
    return module


# === The built-ins ===


def built_in(spec: str, max_completion_length: int):
    """(name, function) of a built-in reward; None when `spec` names none."""
    kind, _, argument = spec.partition(":")
    if kind == "format" and argument:
        try:
            pattern = re.compile(argument, re.DOTALL)
        except re.error as e:
            raise UserError(f"--reward {spec!r}: {argument!r} is not a regular expression ({e})") from None
        return "format", lambda prompts, completions, **_: [float(bool(pattern.search(_text(c)))) for c in completions]
    if kind == "length" and (not argument or argument.isdigit()):
        target = int(argument) if argument else max(1, max_completion_length // 2)
        if target < 1:
            raise UserError(f"--reward {spec!r}: the target length must be at least 1 token")

        def length(prompts, completions, completion_ids, **_):
            return [max(0.0, 1.0 - abs(len(ids) - target) / target) for ids in completion_ids]

        return "length", length
    if spec == "exact":
        return "exact", exact
    if spec == "math":
        return "math", math_reward
    return None


def _text(completion) -> str:
    """A completion's text: itself, or its assistant message's content."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def _answers(columns: dict, name: str, count: int) -> list:
    answers = columns.get("answer")
    if answers is None:
        raise ValueError(f"the {name} reward compares with the records' `answer`, and they have none")
    return answers


def _accepted(answer) -> list[str]:
    """A record's accepted answers, stripped: its `answer`, or each of a list of them (a question's aliases); none
    where it has none, or only empty ones (which every text contains)."""
    given = answer if isinstance(answer, (list, tuple)) else [answer]
    return [
        str(a).strip() for a in given if a is not None and not isinstance(a, (list, tuple, dict)) and str(a).strip()
    ]


def exact(prompts, completions, **columns):
    """1 where one of the record's accepted answers (_accepted) appears in the completion; None where it has none."""
    accepted = [_accepted(a) for a in _answers(columns, "exact", len(completions))]
    return [float(any(a in _text(c) for a in ok)) if ok else None for c, ok in zip(completions, accepted)]


def math_reward(prompts, completions, **columns):
    """1 where the completion's answer and one of the record's accepted answers are the same number (or
    expression, with math-verify)."""
    answers = _answers(columns, "math", len(completions))
    try:
        import math_verify
    except ImportError:
        math_verify = None
    out = []
    for completion, answer in zip(completions, answers):
        ok = _accepted(answer)
        if not ok:
            out.append(None)
        elif math_verify is not None:
            given = math_verify.parse(_text(completion))
            out.append(float(any(math_verify.verify(math_verify.parse(a), given) for a in ok)))
        else:
            given = final_number(_text(completion))
            out.append(float(any(same_number(given, final_number(a)) for a in ok)))
    return out


# A minus sign is one where no digit, letter or point stands before it: "1914-1918" ends in 1918, not -1918.
NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def final_number(text: str) -> float | None:
    """The answer a text gives as a number: after GSM8K's '####', else inside the last \\boxed{}, else the last
    number in it; thousands' commas dropped. None where there is none."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        text = boxed[-1]
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def same_number(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


# === Scoring ===


def score(rewards: list[Reward], prompts: list, completions: list, columns: dict, step: int | None,
          logged: dict | None = None) -> np.ndarray:  # fmt: skip
    """(completions, functions) float64: each function's reward of each completion, NaN where it gave None.

    columns: the prompt records' other keys, each a list as long as `completions`, and `completion_ids` (each
    completion's token ids), as the functions get them. A function that raises,
    returns anything but one number (a bool counts as 0 or 1) or None per completion, or a NaN or an infinity,
    stops the run (a UserError, exit 2), naming the function and the prompt. An `async def` function is awaited,
    as TRL awaits one. logged: {name: [values]}, what the functions gave TRL's `log_metric` (logged_metrics());
    TRL's `log_extra` columns have no table here and are dropped.
    """
    table = np.full((len(completions), len(rewards)), np.nan)
    logged = {} if logged is None else logged

    def log_metric(name: str, value: float) -> None:
        logged.setdefault(str(name), []).append(float(value))

    for index, reward in enumerate(rewards):
        try:
            values = reward.function(prompts=prompts, completions=completions, trainer_state=None,
                                     log_metric=log_metric, log_extra=_dropped, **columns)  # fmt: skip
            if inspect.isawaitable(values):  # an async reward function (an LLM judge): awaited off any running loop
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    values = pool.submit(asyncio.run, _awaited(values)).result()
            values = _listed(values, len(completions))
        except _Refused as e:
            raise _stopped(reward, prompts[0], step, str(e)) from None
        except Exception as e:  # noqa: BLE001 - the user's function: anything it raises stops the run
            raise _stopped(reward, prompts[0], step, f"raised {type(e).__name__}: {e}") from e
        for row, value in enumerate(values):
            if value is None:
                continue
            number = _number(value)
            if number is None:
                raise _stopped(reward, prompts[row], step, f"returned {value!r}, not a finite number or None")
            table[row, index] = number
    return table


def logged_metrics(logged: dict, taken) -> dict:
    """The means of what the reward functions gave `log_metric` (score's `logged`), each by its name, or as
    logged_NAME where finetune's own metrics (`taken`) hold the name."""
    return {(f"logged_{name}" if name in taken else name): float(np.mean(values)) for name, values in logged.items()}


class _Refused(Exception):
    """What a reward function returned, refused: the message's words."""


def _dropped(column, values) -> None:
    """TRL's `log_extra` (a column of its completions table): finetune keeps no such table."""


async def _awaited(awaitable):
    return await awaitable


def _listed(values, count: int) -> list:
    """A function's return value as a list of `count`: a list, tuple, NumPy array or a 1-D tensor (TRL's
    torch.tensor takes each)."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise _Refused(f"returned {type(values).__name__}, not one reward per completion ({count})")
    try:
        rank = np.ndim(values)
    except ValueError:  # values of unlike shapes: each is checked on its own (_number)
        rank = 1
    if rank > 1:
        raise _Refused(f"returned an array of shape {tuple(np.shape(values))}, not one reward per completion "
                       f"({count})")  # fmt: skip
    if len(values) != count:
        raise _Refused(f"returned {len(values)} values for {count} completions")
    return list(values)


def _number(value) -> float | None:
    """A reward as a float: a number, a bool (0 or 1), or a 0-d array or tensor of one; None for anything else or
    a value that is not finite."""
    try:
        found = np.asarray(value.detach().cpu() if hasattr(value, "detach") else value)
    except Exception:  # noqa: BLE001 - whatever the user's function returned
        return None
    if found.ndim != 0 or found.dtype.kind not in "biuf":
        return None
    number = float(found)
    return number if math.isfinite(number) else None


def line(rewards: list[Reward], row: np.ndarray) -> str:
    """One completion's rewards as a line: the weighted total, then each function's (None where it gave none)."""
    weights = np.array([r.weight for r in rewards])
    total = float(np.nansum(row * weights)) if not np.isnan(row).all() else float("nan")
    each = ", ".join(f"{r.name} {'None' if np.isnan(v) else f'{v:.3f}'}" for r, v in zip(rewards, row))
    return f"reward {total:.3f} ({each})"


def _stopped(reward: Reward, prompt, step: int | None, what: str) -> UserError:
    shown = _text(prompt) if not isinstance(prompt, str) else prompt
    shown = shown if len(shown) <= 120 else shown[:117] + "..."
    when = "scoring the held-out prompts" if step is None else f"at step {step + 1}"
    return UserError(f"the reward function {reward.name} {what}, {when}, on the prompt {shown!r}; nothing was "
                     "published")  # fmt: skip
