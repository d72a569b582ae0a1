"""Read, check, filter and split instruction records. Knows nothing of prompts.

A file holds one JSON object per line (JSON Lines) or one JSON array of them,
in one of three formats, told apart by the first record's keys:

- dolly: `instruction` and `response` strings, optional `context` and `category`;
- alpaca: `instruction` and `output`, optional `input` (read as the context);
- chat: `messages`, a list of `{role, content}` turns (system, user, assistant),
  ending with the assistant's; a system turn is put before the first user turn.

null reads as empty and other keys are ignored. Sources: a local path, a gs://
path, `hf:NAME` for a Hugging Face dataset, or `sample` for the project's own
sample, shipped in finetune/assets/ so that installs outside a checkout find it too.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from finetune import platforms
from finetune.errors import UserError

SAMPLE = "sample"  # the name that stands for SAMPLE_PATH
SAMPLE_PATH = Path(__file__).resolve().parent / "assets" / "dolly-sample.jsonl"
TEXT_FIELDS = ("instruction", "context", "response", "category")
REQUIRED = ("instruction", "response")


FORMATS = ("dolly", "alpaca", "chat")
ROLES = {"user": "user", "assistant": "assistant", "model": "assistant"}


@dataclass(frozen=True)
class Record:
    instruction: str
    response: str
    context: str = ""
    category: str = ""
    turns: tuple = ()
    """Chat records: ((role, text), ...) alternating user and assistant, ending with the assistant's. For
    those, instruction is the first user turn and response the last assistant turn."""


def detect_format(obj) -> str:
    """dolly, alpaca or chat, from one record's keys."""
    if isinstance(obj, dict) and "messages" in obj:
        return "chat"
    if isinstance(obj, dict) and "output" in obj and "response" not in obj:
        return "alpaca"
    return "dolly"


def load_records(source: str) -> list[Record]:
    """All records of `source`, checked; raises UserError naming the line at fault."""
    return read(source)[0]


def read(source: str) -> tuple[list[Record], str]:
    """(records, format) of `source`: the format is detected from its first record."""
    if source == SAMPLE:
        source = str(SAMPLE_PATH)
    if source.startswith("hf:"):
        return _from_hugging_face(source[3:])
    raw = _read_bytes(source)
    try:
        # utf-8-sig: a byte-order mark from Windows editors is valid input.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{source} is not UTF-8 text (byte {e.start} is 0x{raw[e.start]:02x}); re-save it as UTF-8"
        ) from None
    if not text.strip():
        raise UserError(f"{source} is empty; it needs one JSON record per line with instruction and response")
    if text.lstrip().startswith("["):
        return _from_array(text, source)
    records, fmt = [], None
    # JSON Lines ends lines at \n only: str.splitlines() would also split inside a
    # record at U+2028, U+2029 or U+0085, which JSON strings may hold raw. CRLF files
    # read the same as LF ones.
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        obj = _json(line, f"{source}:{number}", "each line must be one JSON object")
        fmt = fmt or detect_format(obj)
        records.append(_record(obj, f"{source}:{number}", fmt))
    return records, fmt or "dolly"


def _whole_number(digits: str):
    """JSON integers of any length: past Python's 4300-digit limit for int() they stay text (no field reads
    them as numbers; an ignored key may hold one)."""
    try:
        return int(digits)
    except ValueError:
        return digits


def _json(text: str, where: str, shape: str):
    """json.loads that never escapes: invalid JSON, nesting deeper than Python's parser goes, or anything else
    it raises is a UserError naming `where` (file:line)."""
    try:
        return json.loads(text, parse_int=_whole_number)
    except json.JSONDecodeError as e:
        at = f" at line {e.lineno}" if "\n" in text else ""
        raise UserError(f"{where}: not valid JSON ({e.msg}{at}); {shape}") from None
    except RecursionError:
        raise UserError(f"{where}: JSON nested too deeply to read (thousands of levels); flatten that record") from None
    except (ValueError, TypeError, OverflowError) as e:
        raise UserError(f"{where}: cannot read this JSON ({str(e).splitlines()[0][:120]}); {shape}") from None


def _from_array(text: str, source: str) -> tuple[list[Record], str]:
    items = _json(text, source, "a file starting with [ must be one JSON array")
    if not isinstance(items, list) or not items:
        raise UserError(f"{source}: the JSON array is empty; it needs records with instruction and response")
    fmt = detect_format(items[0])
    return [_record(obj, f"{source} item {i}", fmt) for i, obj in enumerate(items, start=1)], fmt


def _read_bytes(source: str) -> bytes:
    if source.startswith("gs://"):
        return _read_cloud(source)
    path = Path(source)
    if not path.exists():
        raise UserError(f"data file {source} does not exist; pass --data PATH to a Dolly-style JSONL file")
    if not path.is_file():
        raise UserError(f"data path {source} is not a file; pass --data PATH to a Dolly-style JSONL file")
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read data file {source} ({e.strerror or e}); check its permissions") from None


def _read_cloud(source: str) -> bytes:
    """gs:// through tf.io.gfile (installed with keras-hub), else storage's fsspec file system (gcsfs)."""
    try:
        import tensorflow as tf

        with tf.io.gfile.GFile(source, "rb") as f:
            return f.read()
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - gfile raises framework-specific errors
        raise UserError(
            f"could not read {source}: {str(e).splitlines()[0]}; check the path and your GCS credentials"
        ) from e
    from finetune import storage

    fs, path = storage.filesystem(source)  # names the extra to install when gs:// has no file system
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except Exception as e:  # noqa: BLE001 - each file system raises its own errors
        raise UserError(f"could not read {source}: {e}; check the path and your GCS credentials") from e


def _from_hugging_face(name: str) -> tuple[list[Record], str]:
    platforms.use_hugging_face_cache_only_when_offline()
    try:
        import datasets
    except ImportError:
        raise UserError("hf: data needs the `datasets` package: pip install datasets") from None
    try:
        rows = datasets.load_dataset(name, split="train")
    except Exception as e:  # noqa: BLE001 - hub and network errors come in many types
        raise UserError(
            f"could not load Hugging Face dataset {name!r} ({type(e).__name__}); without network, "
            "export it to JSONL elsewhere and pass --data FILE.jsonl"
        ) from e
    fmt = detect_format(dict(rows[0])) if len(rows) else "dolly"
    return [_record(dict(row), f"hf:{name} row {i}", fmt) for i, row in enumerate(rows)], fmt


def _record(obj, where: str, fmt: str = "dolly") -> Record:
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object with instruction and response, got {type(obj).__name__}")
    if fmt == "chat":
        return _chat_record(obj, where)
    if fmt == "alpaca":
        for name in ("instruction", "output"):
            if name not in obj:
                raise UserError(
                    f"{where}: record has no {name!r} field; this file is in Alpaca format (instruction, input, "
                    "output), as its first record is"
                )
        obj = {"instruction": obj["instruction"], "context": obj.get("input"), "response": obj["output"]}
    for name in REQUIRED:
        if name not in obj:
            raise UserError(f"{where}: record has no {name!r} field; every record needs instruction and response")
    fields = {}
    for name in TEXT_FIELDS:
        value = obj.get(name)
        if value is None and name not in REQUIRED:
            value = ""
        if not isinstance(value, str):
            raise UserError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            # JSON allows an escaped lone surrogate such as "\ud800"; it is not text, and the tokenizer fails on it.
            raise UserError(
                f"{where}: field {name!r} holds a lone surrogate escape (\\ud800-\\udfff), which is not text; "
                "fix or remove the record"
            ) from None
        fields[name] = value
    for name in REQUIRED:
        if not fields[name].strip():
            raise UserError(f"{where}: field {name!r} is empty; remove the record or fill it in")
    return Record(**fields)


def _chat_record(obj: dict, where: str) -> Record:
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: `messages` must be a non-empty list of {{role, content}} turns")
    system, turns = "", []
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise UserError(f"{where}: message {number} must be an object with a `role` and a string `content`")
        role, content = message.get("role"), message["content"]
        if role == "system" and number == 1:
            system = content
            continue
        if role not in ROLES:
            raise UserError(f"{where}: message {number} has role {role!r}; use system (first only), user or assistant")
        expected = "user" if len(turns) % 2 == 0 else "assistant"
        if ROLES[role] != expected:
            raise UserError(f"{where}: message {number} should be the {expected}'s: turns must alternate, user first")
        if not content.strip():
            raise UserError(f"{where}: message {number} is empty; remove the record or fill it in")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"{where}: message {number} holds a lone surrogate escape, which is not text") from None
        turns.append((expected, content))
    if not turns or turns[-1][0] != "assistant":
        raise UserError(f"{where}: the last message must be the assistant's, which is what the model learns")
    if system:
        turns[0] = ("user", f"{system}\n\n{turns[0][1]}")
    return Record(instruction=turns[0][1], response=turns[-1][1], turns=tuple(turns))


def filter_records(records, *, drop_context=False, categories=(), max_records=None, source=""):
    """Apply the data filters; an empty result is a user error."""
    kept = [r for r in records if not (drop_context and r.context.strip())]
    if categories:
        wanted = set(categories)
        kept = [r for r in kept if r.category in wanted]
    if max_records is not None:
        kept = kept[:max_records]
    if not kept:
        applied = []
        if drop_context:
            applied.append("drop_context")
        if categories:
            applied.append(f"categories={list(categories)}")
        raise UserError(
            f"no usable records in {source or 'the data'} after filters ({', '.join(applied) or 'none'}); "
            "relax --category / --drop-context or use another file"
        )
    return kept


def fingerprint(records) -> str:
    """sha256 of the records' text: a resume refuses data that changed since its checkpoint."""
    digest = hashlib.sha256()
    for r in records:
        fields = [r.instruction, r.context, r.response, r.category] + ([r.turns] if r.turns else [])
        digest.update(json.dumps(fields).encode("utf-8"))
    return digest.hexdigest()


def split(records, eval_fraction: float, seed: int, min_eval: int = 1):
    """Shuffle with `seed`, hold out `eval_fraction` (at least `min_eval`); returns (train, eval)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_eval = max(min_eval, round(len(records) * eval_fraction))
    if len(records) - n_eval < 1:
        raise UserError(
            f"{len(records)} records are too few to hold out {n_eval} for evaluation and train on the rest; "
            "add records or lower --eval-fraction / --batch-size"
        )
    held = set(order[:n_eval])
    train = [r for i, r in enumerate(records) if i not in held]
    evaluation = [r for i, r in enumerate(records) if i in held]
    return train, evaluation
