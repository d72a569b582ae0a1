"""The training methods by name (--method): each a Method object of its family's module.

A new method is a new object here, from a module of its own (or its family's); nothing outside finetune/methods/
asks which method runs (tests/test_methods.py walks the code for such a question).
"""

from __future__ import annotations

from finetune.data import formats
from finetune.methods import preference, supervised
from finetune.methods.method import Method
from finetune.platform.errors import UserError

METHODS: dict[str, Method] = {m.name: m for m in (supervised.SFT, preference.DPO, preference.IPO, preference.ORPO,
                                                   preference.SIMPO)}  # fmt: skip


def get(name: str) -> Method:
    """The method `name` names; a UserError listing the methods for any other."""
    try:
        return METHODS[name]
    except KeyError:
        raise UserError(f"unknown method {name!r}; choose {', '.join(METHODS)}") from None


# The train settings that belong to some methods and not to others, by flag (each method's `defaults` names its own).
CONSTANT_FLAGS = {"beta": "--beta", "label_smoothing": "--label-smoothing", "simpo_gamma": "--simpo-gamma"}


def decide(train, data_format: str) -> dict:
    """{setting: (value, why)}: --method's method and its constants (Method.decide), once the data is of the form it
    trains on and no other method's constant is set; each refusal says what to pass.

    train: config.TrainConfig. data_format: the records' format (formats.read).
    """
    method = get(train.method)
    paired = data_format in formats.PREFERENCE_FORMATS
    if paired and not method.paired:
        takers = ", ".join(m.name for m in METHODS.values() if m.paired)
        raise UserError(f"the data is {data_format} pairs (chosen and rejected answers); pass --method {takers} to "
                        "train on them, or give SFT records")  # fmt: skip
    if method.paired and not paired:
        raise UserError(f"--method {method.name} trains on preference pairs ({{prompt, chosen, rejected}} records); "
                        f"the data is {data_format}: give pairs, or pass --method sft")  # fmt: skip
    for name, flag in CONSTANT_FLAGS.items():
        if getattr(train, name, None) is not None and name not in method.defaults:
            owners = [m for m in METHODS.values() if name in m.defaults]
            raise UserError(f"{flag} is {', '.join(m.title for m in owners)}'s; --method {method.name} has none: "
                            f"leave it out or pass --method {' or '.join(m.name for m in owners)}")  # fmt: skip
    return method.decide(train)
