"""Documents read from outside (JSON the environment or another run wrote), checked in their shape, field by field.

Whatever a file or a variable holds (null, a list where an object was written,
a port number where an address was, nesting thousands deep, an integer of a
million digits), reading it ends in a value of the shape asked for or in a
DocumentError: a UserError that names the document and the field, one message
for the first field at fault. Nothing else escapes, so a hand-edited or
half-written document is exit 2 with a message, never a traceback.

    spec = documents.Document(documents.parse_json(text, "CLUSTER_SPEC"), "CLUSTER_SPEC")
    pools = spec.section("cluster")
    chief = pools.items("workerpool0", str)[0]
"""

from __future__ import annotations

import decimal
import json
import math
from collections.abc import Callable
from typing import Any, Optional

from finetune.platform.errors import UserError

# A kind a field may be, as messages name it: JSON's words, since a user wrote JSON, not Python.
WORDS = {dict: "an object", list: "a list", str: "text", int: "an integer", float: "a number", bool: "true or false"}


class DocumentError(UserError):
    """A document, or one of its fields, is not what finetune wrote there.

    document: str. What the document is called (a file's path, an environment variable).
    problem: str. What is wrong: of a field, naming it (`task.index must be an integer, got text`), or of the
        whole (`is not valid JSON (...)`).
    fix: str. How to mend it, after the problem.
    """

    def __init__(self, document: str, problem: str, fix: str = "", field: bool = False):
        self.what = f"{document}{': ' if field else ' '}{problem}"
        """The problem without the fix: `metrics.json is not an object (it holds null)`."""
        super().__init__(self.what + (f"; {fix}" if fix else ""))
        self.document = document


def kind_of(value) -> str:
    """What a parsed value is, in JSON's words, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity"
    if isinstance(value, (int, float, decimal.Decimal)):
        return "a number"
    if isinstance(value, (bytes, bytearray)):
        return "binary data"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "text" if isinstance(value, str) else type(value).__name__


def parse_json(text: str | bytes, document: str, fix: str = "") -> Any:
    """json.loads that never escapes: not JSON, not UTF-8, nested too deep or a number too long is a DocumentError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DocumentError(document, f"is not valid JSON ({e.msg} at line {e.lineno})", fix) from None
    except RecursionError:
        raise DocumentError(document, "is nested too deeply to read", fix) from None
    except (ValueError, TypeError) as e:  # not UTF-8, or an integer past Python's 4300 digits
        raise DocumentError(document, f"cannot be read ({str(e).splitlines()[0][:80]})", fix) from None


def is_kind(value, kind) -> bool:
    """Whether `value` is of `kind` (a type of WORDS, or a tuple of them): true is no integer, and NaN no number."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, float):
        return float in kinds and math.isfinite(value)
    if isinstance(value, int):
        return int in kinds or float in kinds
    return any(isinstance(value, k) for k in kinds if k not in (bool, int, float))


def words(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(WORDS[k] for k in kinds)


class Document:
    """A parsed document, or a part of one, read field by field.

    value: what was parsed. name: str. The document, for messages. fix: str. How to mend it, said with every
    problem. at: str. Where `value` sits in the document (`cluster.workerpool0`); empty for all of it.
    """

    def __init__(self, value, name: str, fix: str = "", at: str = ""):
        self.value = value
        self.name = name
        self.fix = fix
        self.at = at
        if not isinstance(value, dict):
            where = f"{at} " if at else ""
            raise DocumentError(name, f"{where}is not an object (it holds {kind_of(value)})", fix, field=bool(at))

    def fail(self, problem: str):
        """Raise a DocumentError for this document; `problem` starts with the field it names."""
        raise DocumentError(self.name, problem, self.fix, field=True)

    def _where(self, key: str) -> str:
        return f"{self.at}.{key}" if self.at else key

    def has(self, key: str) -> bool:
        return self.value.get(key) is not None

    def field(
        self,
        key: str,
        kind,
        *,
        required: bool = True,
        default=None,
        check: Optional[Callable[[Any], Optional[str]]] = None,
    ):
        """The value at `key`, of `kind`; a missing or null one is `default` where not required.

        check: a function (value) -> what is wrong with it (`must be at least 1`), or None when nothing is.
        """
        value = self.value.get(key)
        where = self._where(key)
        if value is None:
            if required:
                raise DocumentError(self.name, f"has no {where}", self.fix)
            return default
        if not is_kind(value, kind):
            self.fail(f"{where} must be {words(kind)}, got {kind_of(value)}")
        problem = check(value) if check else None
        if problem:
            self.fail(f"{where} {problem}, got {shown(value)}")
        return value

    def section(self, key: str, required: bool = True) -> Document | None:
        """The object at `key`, as a Document; None for a missing one where not required."""
        value = self.field(key, dict, required=required)
        return None if value is None else Document(value, self.name, self.fix, self._where(key))

    def items(self, key: str, kind, *, required: bool = True, check=None) -> list:
        """The list at `key`, each item of `kind` (dict items come as Documents); [] for a missing one where not
        required."""
        found = self.field(key, list, required=required, default=[])
        out = []
        for index, item in enumerate(found):
            where = f"{self._where(key)}[{index}]"
            if not is_kind(item, kind):
                self.fail(f"{where} must be {words(kind)}, got {kind_of(item)}")
            problem = check(item) if check else None
            if problem:
                self.fail(f"{where} {problem}, got {shown(item)}")
            out.append(Document(item, self.name, self.fix, where) if kind is dict else item)
        return out


def shown(value) -> str:
    """`value` as a message shows it: its repr, cut at 40 characters."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's 4300 digits, as YAML reads one
        return "a number too long to show"
    return text if len(text) <= 40 else text[:37] + "..."


def at_least(low: int) -> Callable[[Any], Optional[str]]:
    """A check: the number is `low` or more."""
    return lambda value: None if value >= low else f"must be at least {low}"


def one_of(*choices) -> Callable[[Any], Optional[str]]:
    """A check: the value is one of `choices`."""
    return lambda value: None if value in choices else f"must be one of {', '.join(map(str, choices))}"
