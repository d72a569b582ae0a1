"""The training methods by name (--method): each a Method object of its family's module.

A new method is a new object here, from a module of its own (or its family's); nothing outside finetune/methods/
asks which method runs (tests/test_methods.py walks the code for such a question).
"""

from __future__ import annotations

from collections import Counter

from finetune.data import formats
from finetune.methods import classify, grpo, preference, reward, rloo, supervised
from finetune.methods.method import Method
from finetune.platform.errors import UserError

METHODS: dict[str, Method] = {m.name: m for m in (supervised.SFT, preference.DPO, preference.IPO, preference.ORPO,
                                                   preference.SIMPO, grpo.GRPO_METHOD, rloo.RLOO_METHOD,
                                                   reward.REWARD, classify.CLASSIFY)}  # fmt: skip


def get(name: str) -> Method:
    """The method `name` names; a UserError listing the methods for any other."""
    try:
        return METHODS[name]
    except KeyError:
        raise UserError(f"unknown method {name!r}; choose {', '.join(METHODS)}") from None


# The train settings that belong to some methods and not to others, by flag (each method's `defaults` names its own).
CONSTANT_FLAGS = {"beta": "--beta", "label_smoothing": "--label-smoothing", "simpo_gamma": "--simpo-gamma",
                  "num_generations": "--num-generations", "max_completion_length": "--max-completion-length",
                  "temperature": "--temperature", "top_p": "--top-p", "epsilon": "--epsilon",
                  "epsilon_high": "--epsilon-high", "num_iterations": "--num-iterations", "loss_type": "--loss-type",
                  "scale_rewards": "--scale-rewards", "center_rewards": "--center-rewards",
                  "normalize_advantages": "--normalize-advantages"}  # fmt: skip
# The files a finished run of some method writes beside its adapter (Method.files): --overwrite replaces them too.
FILES = tuple(name for m in METHODS.values() for name in m.files)
# The online RL methods' reward functions: lists, empty when not given.
REWARD_FLAGS = {"reward": "--reward", "reward_weights": "--reward-weights"}


def decide(train, data_format: str) -> dict:
    """{setting: (value, why)}: --method's method and its constants (Method.decide), once the data is of the form it
    trains on and no other method's constant is set; each refusal says what to pass.

    train: config.TrainConfig. data_format: the records' format (formats.read).
    """
    method = get(train.method)
    found = formats.kind(data_format)
    if found != method.takes:
        raise UserError(_other_kind(method, data_format, found))
    _check_settings(method, train)
    return method.decide(train)


def _other_kind(method, data_format: str, found: str) -> str:
    """Why `method` cannot train on data of `data_format` (of the kind `found`, not Method.takes), and what to pass."""
    if found == "prompts alone":
        takers = ", ".join(m.name for m in METHODS.values() if m.takes == found)
        return (f"the data is {data_format}: prompts alone, with no answers to learn from; pass --method {takers} "
                "(online RL with --reward functions), or give records with answers")  # fmt: skip
    if method.prompted:
        return (f"--method {method.name} trains on prompts alone ({{\"prompt\": ...}} records, text or messages) "
                f"and writes its own completions; the data is {data_format}: give prompts")  # fmt: skip
    if found == "preference pairs":
        takers = ", ".join(m.name for m in METHODS.values() if m.takes == found)
        return (f"the data is {data_format} pairs (chosen and rejected answers); pass --method {takers} to train on "
                "them, or give SFT records")  # fmt: skip
    return (f"--method {method.name} trains on preference pairs ({{prompt, chosen, rejected}} records); the data is "
            f"{data_format}: give pairs, or pass --method sft")  # fmt: skip


def check(cfg) -> None:
    """What the settings alone refuse for --method's method, before any data is read or weights load: each run
    checks it first, and `--plan-only`, which reads neither, checks it too (a plan of a run that would be refused
    is no plan). registry.decide checks the rest, against the data's form.

    cfg: config.Config.
    """
    method = get(cfg.train.method)
    _check_settings(method, cfg.train)
    if cfg.data.train_on_prompt and not method.prompt_loss:
        takers = " or ".join(m.name for m in METHODS.values() if m.prompt_loss)
        raise UserError(f"--train-on-prompt puts the prompt's tokens in the loss; {method.title}'s loss has no place "
                        f"for them: leave it out or pass --method {takers}")  # fmt: skip
    why = method.unpacked_why()
    if why and cfg.data.packing == "on":
        raise UserError(f"--packing on: {why}; pass --packing auto or off")
    refusal = method.refusal(cfg)
    if refusal:
        raise UserError(refusal)


def _check_settings(method: Method, train) -> None:
    """The other methods' settings, left out or refused by name; GRPO's reward functions; --group-by-length and
    --beta where this method has no use for them."""
    for name, flag in REWARD_FLAGS.items():
        if getattr(train, name, None) and not method.prompted:
            takers = [m for m in METHODS.values() if m.prompted]
            raise UserError(f"{flag} scores the rollouts of {' and '.join(m.title for m in takers)}; --method "
                            f"{method.name} has none: leave it out or pass --method "
                            f"{' or '.join(m.name for m in takers)}")  # fmt: skip
    for name, flag in CONSTANT_FLAGS.items():
        if getattr(train, name, None) is not None and name not in method.defaults:
            owners = [m for m in METHODS.values() if name in m.defaults]
            titles = [m.title for m in owners]
            whose = f"{titles[0]}'s" if len(titles) == 1 else f"a setting of {', '.join(titles[:-1])} and {titles[-1]}"
            raise UserError(f"{flag} is {whose}; --method {method.name} has none: leave it out or pass --method "
                            f"{' or '.join(m.name for m in owners)}")  # fmt: skip
    if getattr(train, "labels", None) and not method.labelled:
        raise UserError(f"--labels names a classifier's classes; --method {method.name} has none: leave it out or "
                        "pass --method classify")  # fmt: skip
    twice = [label for label, count in Counter(getattr(train, "labels", None) or ()).items() if count > 1]
    if twice:
        raise UserError(f"--labels names {twice[0]!r} twice; name each class once")
    if getattr(train, "group_by_length", False) and method.ungrouped_why():
        raise UserError(f"--group-by-length: {method.ungrouped_why()}; leave it out")
    # 0 is the online RL methods' "no KL" (no reference pass); the preference losses need a beta
    if train.beta == 0 and method.defaults.get("beta", (0,))[0] > 0 and not method.prompted:
        raise UserError(f"--beta 0 leaves {method.title}'s loss nothing to weigh; give a positive --beta")
