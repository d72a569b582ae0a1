"""Read, check, filter and split training records. Knows nothing of prompts.

A file holds its records as JSON Lines, one JSON array, CSV (a header row, one
record per row; .csv, or .tsv with tabs) or Parquet. Its format is told apart
by the first record's keys (FORMATS):

- dolly: `instruction` and `response` strings, optional `context` and `category`;
- alpaca: `instruction` and `output`, optional `input` (read as the context);
- chat: `messages`, a list of `{role, content}` turns (system, user, assistant),
  ending with the assistant's; a system turn comes first. With TRL's tool-calling
  form it is read as tool-chat: a `tools` list of JSON schemas beside `messages`,
  assistant messages with `tool_calls` ({type: function, function: {name,
  arguments}}) and `reasoning_content`, and `tool` messages with the tools' answers;
- sharegpt: `conversations`, a list of `{from, value}` turns (human, gpt, system),
  read as chat; an optional top-level `system` string is its system turn. With
  LLaMA-Factory's tool turns (`function_call`, `observation`) or `tools` it is
  read as tool-chat;
- completion: `prompt` and `completion` strings, trained on the completion;
- completion-chat: `prompt` and `completion` as lists of messages (TRL's
  conversational prompt-completion): the prompt ends with the user's, the
  completion is the assistant's answer, and only the completion is trained;
  with tools, tool calls or reasoning it is read as tool-chat, the completion's
  model turns trained;
- text: `text`, trained on every token;
- preference: `chosen` and `rejected` texts, with a `prompt` text or without one
  (TRL's implicit prompt: the texts' shared beginning, as Anthropic HH's are);
- preference-chat: `chosen` and `rejected` as lists of messages, after a `prompt`
  list of messages or sharing their leading messages (UltraFeedback's form).
  A pair's record is an SFT record whose response is the chosen answer, plus
  the rejected one (docs/preference.md).
- prompts: `prompt` text alone, no completion (TRL's prompt-only form), for
  online RL (--method grpo), which writes its own completions;
- prompts-chat: `prompt` as a list of messages ending with the user's.
  A prompt record keeps its other keys (`answer`, `solution`...) in `columns`,
  for the reward functions (docs/rl.md).

Any of these may be compressed, and is read as it is: gzip (.gz), bzip2 (.bz2)
and xz (.xz) through Python's own modules, Zstandard (.zst) where the
zstandard package is installed.

null reads as empty and other keys are ignored. Chat and ShareGPT records are
lists, so they come in JSON or Parquet, not CSV. Sources: a local path, a gs://
path, `hf:NAME[:CONFIG]` for a Hugging Face dataset (one split of it, train unless
told), or `sample` for the project's own
sample, shipped in finetune/assets/ so that installs outside a checkout find it too.
"""

from __future__ import annotations

import csv
import dataclasses
import decimal
import hashlib
import io
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from finetune.data import audio, images, pictures
from finetune.platform import documents, platforms
from finetune.platform.errors import UserError

SAMPLE = "sample"  # the name that stands for SAMPLE_PATH
SAMPLE_PATH = Path(__file__).resolve().parent.parent / "assets" / "dolly-sample.jsonl"
TEXT_FIELDS = ("instruction", "context", "response", "category")
REQUIRED = ("instruction", "response")


# Each format's keys, as the messages that name them print them.
FORMATS = {
    "dolly": "instruction, response",
    "alpaca": "instruction, output",
    "chat": "messages",
    "tool-chat": "messages (or prompt and completion, or ShareGPT's conversations) with tools, tool calls or reasoning",
    "sharegpt": "conversations",
    "completion": "prompt, completion",
    "completion-chat": "prompt, completion, as messages",
    "text": "text",
    "preference": "chosen, rejected, and prompt or none, as text",
    "preference-chat": "chosen, rejected, and prompt or none, as messages",
    "prompts": "prompt alone, as text",
    "prompts-chat": "prompt alone, as messages",
}
TITLES = {"dolly": "Dolly", "alpaca": "Alpaca", "sharegpt": "ShareGPT", "completion": "prompt/completion"}
CHAT_FORMATS = (
    "chat",
    "tool-chat",
    "sharegpt",
    "completion-chat",
    "preference-chat",
    "prompts-chat",
)  # records of turns, rendered by a chat template
PREFERENCE_FORMATS = ("preference", "preference-chat")  # pairs of a chosen and a rejected answer
PROMPT_FORMATS = ("prompts", "prompts-chat")  # prompts alone: online RL writes the completions


def kind(fmt: str) -> str:
    """What records of format `fmt` are, as a method takes them: preference pairs, prompts alone, or records with
    an answer (any other format)."""
    if fmt in PREFERENCE_FORMATS:
        return "preference pairs"
    return "prompts alone" if fmt in PROMPT_FORMATS else "records with answers"


ROLES = {"user": "user", "assistant": "assistant", "model": "assistant"}
# A first message's roles that are the system prompt: OpenAI's newer name for it too, which Gemma 4's template
# renders as it renders a system message.
SYSTEM_ROLES = ("system", "developer")
# ShareGPT's speakers, as community sets name them.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant"}
PARQUET_MAGIC = b"PAR1"
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
# Compressions read as they are: the suffix, and the bytes a file starts with (bzip2's "BZh" could begin text).
COMPRESSIONS = {"gzip": (".gz", b"\x1f\x8b"), "bzip2": (".bz2", None), "xz": (".xz", b"\xfd7zXZ\x00"),
                "Zstandard": (".zst", b"\x28\xb5\x2f\xfd")}  # fmt: skip
ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class Record:
    instruction: str
    response: str
    context: str = ""
    category: str = ""
    turns: tuple = ()
    """Chat records: ((role, text), ...) alternating user and assistant, ending with the assistant's. For
    those, instruction is the first user turn and response the last assistant turn."""
    images: tuple = ()
    """The record's image files (absolute paths), one `<image>` placeholder in its text for each (images.py)."""
    audios: tuple = ()
    """The record's audio files (absolute paths), one `<audio>` placeholder in its text for each (audio.py)."""
    rejected: str = ""
    """Preference pairs: the rejected answer, after the same prompt as the chosen one (`response`, and the last
    assistant turn of `turns`)."""
    where: str = field(default="", compare=False, repr=False)
    """Preference pairs and prompts: file:line (or row) of the record, for errors found once it is tokenized."""
    columns: dict = field(default_factory=dict, compare=False, repr=False)
    """Prompts: the record's other keys (answer, solution...), as read, for the reward functions."""
    messages: tuple = ()
    """Chat and ShareGPT records: the conversation as the chat template takes it ({role, content} dicts, the
    system's first where there is one; tool-chat's also with tool_calls, reasoning_content and tool messages)."""
    tools: tuple = ()
    """Tool-chat records: the tools' JSON schemas ({type: function, function: {name, description, parameters}})."""
    prompt_messages: int = 0
    """Completion-chat records: how many of `messages` are the prompt, whose model turns are not trained."""

    @property
    def uses_tools(self) -> bool:
        """Whether the record has tools, tool calls, tool messages or reasoning, which only some templates render."""
        return bool(self.tools) or any(set(m) - {"role", "content"} or m["role"] == "tool" for m in self.messages)

    @property
    def is_pair(self) -> bool:
        """Whether this is a preference pair (it has a rejected answer)."""
        return bool(self.rejected)


def detect_format(obj) -> str | None:
    """The format (a key of FORMATS) one record's keys show, or None."""
    if not isinstance(obj, dict):
        return None
    if "chosen" in obj or "rejected" in obj:  # before messages: UltraFeedback's pairs also hold `messages`
        lists = isinstance(obj.get("chosen"), list) or isinstance(obj.get("rejected"), list)
        return "preference-chat" if lists else "preference"
    if "messages" in obj:
        return "chat"
    if "conversations" in obj:
        return "sharegpt"
    if "instruction" in obj:
        return "alpaca" if "output" in obj and "response" not in obj else "dolly"
    if "prompt" in obj and "completion" in obj:
        lists = isinstance(obj["prompt"], list) or isinstance(obj["completion"], list)
        return "completion-chat" if lists else "completion"
    if "prompt" in obj and "text" not in obj:
        return "prompts-chat" if isinstance(obj["prompt"], list) else "prompts"
    if "text" in obj:
        return "text"
    return None


def _first_format(obj, where: str) -> str:
    found = detect_format(obj)
    if found in ("completion", "completion-chat") and isinstance(obj.get("label"), bool):
        # Read as SFT, its undesirable completions (label false) would be trained on as answers to imitate.
        raise UserError(f"{where}: a prompt and completion with a true/false `label` is TRL's unpaired preference "
                        "form (KTO's), which finetune does not train yet; give pairs (prompt, chosen, rejected) for "
                        "--method dpo, or keep the records labelled true, without the label, for SFT")  # fmt: skip
    if found is not None:
        return found
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object (a record), got {documents.kind_of(obj)}")
    under = _records_key(obj)
    if under is not None:
        raise UserError(
            f"{where}: the records are in a list under {under!r}; give them as JSON Lines, one object per line, "
            "or as a JSON array"
        )
    keys = ", ".join(repr(k) for k in list(obj)[:6]) or "no keys"
    read = "; ".join(f"{name} ({keys_})" for name, keys_ in FORMATS.items())
    raise UserError(f"{where}: a record with {keys} is in no format finetune reads.\nIt reads: {read}")


def _records_key(obj: dict) -> str | None:
    """The key of an object that holds the records in a list ({"data": [...]}, as some exports write), or None."""
    for key, value in obj.items():
        if isinstance(value, list) and value and detect_format(value[0]) is not None:
            return key
    return None


def load_records(source: str) -> list[Record]:
    """All records of `source`, checked; raises UserError naming the line at fault."""
    return read(source)[0]


def read(source: str, split: str = "train") -> tuple[list[Record], str]:
    """(records, format) of `source`: the format is detected from its first record.

    split: str. Of an hf:NAME[:CONFIG] source, the split read (Hugging Face's notation: train, test[:100]).
    """
    if not source.strip():
        raise UserError("the data path is empty; give a data file (JSONL, JSON, CSV or Parquet), hf:NAME or sample")
    if source == SAMPLE:
        source = str(SAMPLE_PATH)
    if source.startswith("hf:"):
        return _from_hugging_face(source[3:], split)
    if split != "train":
        raise UserError(
            f"--data-split {split} picks a split of a Hugging Face dataset (--data hf:NAME); {source} is read whole, "
            "and finetune holds out its own evaluation share (--eval-fraction)"
        )
    raw, name = _decompressed(_read_bytes(source), source)
    if raw.startswith(PARQUET_MAGIC):
        return _records(_parquet_rows(raw, source), source)
    if name.endswith(".parquet"):
        raise UserError(f"{source} is not a Parquet file (it does not start with PAR1); check how it was written")
    text = _text(raw, source)
    if name.endswith((".csv", ".tsv")):
        return _records(_csv_rows(text, source, "\t" if name.endswith(".tsv") else ","), source, "CSV")
    if text.lstrip().startswith("["):
        return _records(_array_items(text, source), source)
    return _records(_json_lines(text, source), source)


def _decompressed(raw: bytes, source: str) -> tuple[bytes, str]:
    """(the file's bytes, decompressed when it is compressed; its name in lower case, without the compression's
    suffix, which tells its format: x.csv.gz is CSV).

    gzip, bzip2 and xz come with Python; Zstandard where the zstandard package is installed. A compressed file is
    known by its suffix, or by the bytes it starts with where no text starts so.
    """
    name = source.lower()
    kind = next((k for k, (suffix, _) in COMPRESSIONS.items() if name.endswith(suffix)), None)
    if kind is None:
        kind = next((k for k, (_, magic) in COMPRESSIONS.items() if magic and raw.startswith(magic)), None)
    if raw.startswith(ZIP_MAGIC):
        raise UserError(f"{source} is a zip archive; extract the data file from it, or compress it with gzip")
    if kind is None:
        return raw, name
    name = name.removesuffix(COMPRESSIONS[kind][0])
    try:
        return _decompress(kind, raw, source), name
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - each codec raises its own (OSError, EOFError, zlib.error, LZMAError)
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise UserError(f"{source} is not a whole {kind} file ({first}); check how it was compressed") from None


def _decompress(kind: str, raw: bytes, source: str) -> bytes:
    if kind == "gzip":
        import gzip

        return gzip.decompress(raw)
    if kind == "bzip2":
        import bz2

        return bz2.decompress(raw)
    if kind == "xz":
        import lzma

        return lzma.decompress(raw)
    try:
        import zstandard
    except ImportError:
        raise UserError(
            f"{source} is Zstandard-compressed, which needs the zstandard package: pip install zstandard, "
            "or decompress it first (zstd -d) or compress it with gzip"
        ) from None
    return zstandard.ZstdDecompressor().decompressobj().decompress(raw)


def _text(raw: bytes, source: str) -> str:
    try:
        # utf-8-sig: a byte-order mark from Windows editors is valid input.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(
            f"{source}:{line} is not UTF-8 text (byte {e.start} is 0x{raw[e.start]:02x}); re-save the file as UTF-8"
        ) from None
    if not text.strip():
        raise UserError(f"{source} is empty; it needs records: JSON Lines, a JSON array, CSV rows or Parquet")
    return text


def _records(rows, source: str, container: str = "") -> tuple[list[Record], str]:
    """Records from (where, object) pairs, all in the format of the first."""
    records, fmt = [], None
    for where, obj in rows:
        if fmt is None:
            fmt = _first_format(obj, where)
            if container and fmt in CHAT_FORMATS:
                raise UserError(
                    f"{where}: {fmt} records hold lists of turns, which a {container} cell cannot; "
                    "give them as JSON Lines, a JSON array or Parquet"
                )
        elif _is_pair(obj) != (fmt in PREFERENCE_FORMATS):
            raise UserError(_mixed(where, fmt))
        elif fmt in PROMPT_FORMATS and detect_format(obj) not in PROMPT_FORMATS:
            raise UserError(f"{where}: a record with an answer in a file of prompts alone, as its first record is; "
                            "a file holds prompts alone (for --method grpo) or records with answers, not both")  # fmt: skip
        written = _messages_as_text(obj) if container else None
        if written:  # TRL's conversational forms written out into cells: they would train as that text
            raise UserError(
                f"{where}: the {written!r} cell holds a list of messages written as text, which a {container} "
                "file cannot hold as a list; give the records as JSON Lines, a JSON array or Parquet"
            )
        records.append(_with_images(obj, where, fmt, source))
    if fmt is None:
        raise UserError(f"{source} holds no records; it needs one record per line or row")
    if fmt in ("chat", "completion-chat", "sharegpt") and any(r.uses_tools for r in records):
        fmt = "tool-chat"  # a template that renders tools is needed (templates.for_data)
    return records, fmt


MESSAGES_AS_TEXT = re.compile(r"""^\s*\[\s*\{.*['"]role['"]\s*:""", re.DOTALL)


def _messages_as_text(obj) -> str | None:
    """The key of a text cell that holds a list of {role, content} messages written out (JSON or Python's), or None."""
    for key, value in obj.items() if isinstance(obj, dict) else ():
        if isinstance(value, str) and MESSAGES_AS_TEXT.match(value):
            return key
    return None


def _is_pair(obj) -> bool:
    return isinstance(obj, dict) and ("chosen" in obj or "rejected" in obj)


def _mixed(where: str, fmt: str) -> str:
    if fmt in PREFERENCE_FORMATS:
        found = "an SFT record, with no chosen or rejected answer, in a file of preference pairs"
    else:
        found = f"a preference pair (chosen, rejected) in a file of {fmt} records"
    return f"{where}: {found}, as its first record is; a file holds preference pairs or SFT records, not both"


def _json_lines(text: str, source: str):
    # JSON Lines ends lines at \n only: str.splitlines() would also split inside a
    # record at U+2028, U+2029 or U+0085, which JSON strings may hold raw. CRLF files
    # read the same as LF ones.
    first = True
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            where = f"{source}:{number}"
            try:
                obj = _json(line, where, "each line must be one JSON object")
            except UserError:
                if first:
                    _refuse_one_object(text, source)
                raise
            first = False
            yield where, obj


def _refuse_one_object(text: str, source: str) -> None:
    """A file that is one JSON object over many lines (pretty-printed, or records under a key such as `data`)
    is told apart from broken JSON Lines; a file of one line is JSON Lines' own, whose line's error stands."""
    if sum(1 for line in text.split("\n") if line.strip()) < 2:
        return
    try:
        obj = json.loads(text, parse_int=_whole_number)
    except (ValueError, RecursionError):
        return
    if not isinstance(obj, dict):
        return
    under = _records_key(obj)
    held = f"records under {under!r}" if under is not None else "a single object"
    raise UserError(
        f"{source} is one JSON object over many lines ({held}); give the records as JSON Lines, one object per "
        "line, or as a JSON array"
    )


def _array_items(text: str, source: str):
    items = _json(text, source, "a file starting with [ must be one JSON array", whole_file=True)
    if not isinstance(items, list) or not items:
        raise UserError(f"{source}: the JSON array is empty; it needs records, such as instruction and response")
    for i, obj in enumerate(items, start=1):
        yield f"{source} item {i}", obj


def _csv_rows(text: str, source: str, delimiter: str):
    """Each row of a CSV file with a header, as a dict; empty cells read as empty text.

    Strict: a quote left open would otherwise swallow the rest of the file into one cell without a word.
    """
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # a cell may hold a whole document; the default stops at 128 KiB
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
        try:
            reader.fieldnames = _header(reader.fieldnames or [], source, delimiter)
        except csv.Error as e:
            raise UserError(f"{source}:1: not valid CSV ({e}); check the quotes of the header row") from None
        start = 2  # the line the next row starts on
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                raise UserError(f"{source}:{start}: not valid CSV ({e}); check the quotes from this line") from None
            where = f"{source}:{start}"
            if None in row:
                raise UserError(f"{where}: this row has more cells than the header has names")
            yield where, {k: v for k, v in row.items() if v is not None}
            start = reader.line_num + 1
    finally:
        csv.field_size_limit(limit)


def _header(names: list, source: str, delimiter: str) -> list:
    """A CSV header's names without the spaces around them ("instruction, response" as typed by hand); a name
    given twice is refused, as its second column would silently replace the first."""
    names = [name.strip() for name in names]
    if len(names) == 1 and any(mark in names[0] for mark in ",;\t|".replace(delimiter, "")):
        raise UserError(
            f"{source}:1: the header is one column, {names[0][:60]!r}; a .csv is read with commas between cells "
            "and a .tsv with tabs: re-save it so"
        )
    repeated = sorted({name for name in names if name and names.count(name) > 1})
    if repeated:
        raise UserError(
            f"{source}:1: the header names {', '.join(map(repr, repeated))} more than once; give each column its own name"
        )
    return names


def _parquet_rows(raw: bytes, source: str):
    """Each row of a Parquet file, as a dict (pyarrow comes with `datasets`)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{source} is Parquet, which needs pyarrow: pip install pyarrow") from None
    try:
        rows = _binary_as_text(pq.read_table(pa.BufferReader(raw))).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types, and MemoryError on bad sizes
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise UserError(f"{source}: cannot read this Parquet file ({first})") from None
    for i, obj in enumerate(rows, start=1):
        yield f"{source} row {i}", obj


def _binary_as_text(table):
    """Parquet from older Spark and Hive keeps strings as plain binary: a binary column that is UTF-8 reads as
    text; one that is not stays binary, which a text field refuses by its row."""
    import pyarrow as pa

    for index, column in enumerate(table.schema):
        if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            text = pa.large_string() if pa.types.is_large_binary(column.type) else pa.string()
            try:
                table = table.set_column(index, column.name, table.column(index).cast(text))
            except pa.ArrowInvalid:
                pass
    return table


def _whole_number(digits: str):
    """JSON integers of any length: past Python's 4300-digit limit for int() they are read as Decimal, which has
    none (an ignored key may hold one; a text field refuses it as it refuses any number)."""
    try:
        return int(digits)
    except ValueError:
        return decimal.Decimal(digits)


class _KeyTwice(Exception):
    """A JSON object that gives one key twice (json.loads keeps the last value without a word)."""


def _once_each(pairs: list) -> dict:
    """An object's pairs as a dict, refusing a key given twice."""
    made = dict(pairs)
    if len(made) != len(pairs):
        seen = set()
        raise _KeyTwice(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return made


def _json(text: str, where: str, shape: str, whole_file: bool = False):
    """json.loads that never escapes: invalid JSON, nesting deeper than Python's parser goes, or anything else
    it raises is a UserError naming `where`, file:line (whole_file: `text` is all of the file `where` names,
    and the line is found in it)."""
    try:
        return json.loads(text, parse_int=_whole_number, object_pairs_hook=_once_each)
    except _KeyTwice as e:
        raise UserError(f"{where}: key {e.args[0]!r} is given twice in one object, and JSON would keep the last "
                        "silently; keep one") from None  # fmt: skip
    except json.JSONDecodeError as e:
        where = f"{where}:{e.lineno}" if whole_file else where
        raise UserError(f"{where}: not valid JSON ({e.msg}); {shape}") from None
    except RecursionError:
        where = f"{where}:{_deepest_line(text)}" if whole_file else where
        raise UserError(f"{where}: JSON nested too deeply to read (thousands of levels); flatten that record") from None
    except (ValueError, TypeError, OverflowError) as e:
        raise UserError(f"{where}: cannot read this JSON ({str(e).splitlines()[0][:120]}); {shape}") from None


# A JSON string (whose brackets are text) or a bracket.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def _deepest_line(text: str) -> int:
    """The line where `text`'s JSON is nested deepest: in the record too deep for Python's parser to read."""
    depth = deepest = at = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        bracket = match.group()
        if bracket in "[{":
            depth += 1
            if depth > deepest:
                deepest, at = depth, match.start()
        elif bracket in "]}":
            depth -= 1
    return text.count("\n", 0, at) + 1


def _read_bytes(source: str) -> bytes:
    if source.startswith("gs://"):
        return _read_cloud(source)
    path = Path(source).expanduser()  # a quoted ~, or one from the Python API, is the home folder too
    if not path.exists():
        raise UserError(
            f"data file {source} does not exist; give the path of a data file (JSONL, JSON, CSV or Parquet)"
        )
    if path.is_dir():
        try:
            found = sorted(p.name for p in path.iterdir() if _is_data_name(p.name) and p.is_file())
        except OSError:  # a folder we may not list
            found = []
        such = f", such as {path / found[0]}" if found else " (JSONL, JSON, CSV or Parquet)"
        raise UserError(f"data path {source} is a folder; give the path of one data file{such}")
    if not path.is_file():
        raise UserError(f"data path {source} is not a file; give the path of a data file (JSONL, JSON, CSV or Parquet)")
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read data file {source} ({e.strerror or e}); check its permissions") from None


def _is_data_name(name: str) -> bool:
    """Whether a file name is a data file's: x.jsonl, x.csv.gz, ..."""
    name = name.lower()
    for suffix, _ in COMPRESSIONS.values():
        name = name.removesuffix(suffix)
    return name.endswith(DATA_SUFFIXES)


def _read_cloud(source: str) -> bytes:
    """gs:// through storage's fsspec file system (gcsfs, the gcs extra), as run directories go there; without
    gcsfs, through tf.io.gfile (TensorFlow comes with keras-hub)."""
    from finetune.platform import storage

    try:
        fs, path = storage.filesystem(source)
    except UserError:
        return _read_with_gfile(source)
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except Exception as e:  # noqa: BLE001 - each file system raises its own errors
        raise UserError(f"could not read {source}: {_first_line(e)}; check the path and your GCS credentials") from None


def _read_with_gfile(source: str) -> bytes:
    from finetune.platform import storage

    try:
        import tensorflow as tf
    except ImportError:
        raise UserError(f"reading {source} needs gcsfs: {storage.GCS_EXTRA}") from None
    try:
        with tf.io.gfile.GFile(source, "rb") as f:
            return f.read()
    except Exception as e:  # noqa: BLE001 - gfile raises framework-specific errors
        raise UserError(f"could not read {source}: {_first_line(e)}; check the path and your GCS credentials") from None


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0][:200] if str(error).strip() else type(error).__name__


def _from_hugging_face(spec: str, split: str = "train") -> tuple[list[Record], str]:
    """The records of hf:NAME[:CONFIG], one split of it: a Hub dataset, or a local one `datasets` loads."""
    name, _, config = (part.strip() for part in spec.partition(":"))
    if not name:
        raise UserError(
            "hf: names no dataset; give its name on the Hugging Face Hub, e.g. hf:databricks/databricks-dolly-15k"
        )
    platforms.use_hugging_face_cache_only_when_offline()
    try:
        import datasets
    except ImportError:
        raise UserError("hf: data needs the `datasets` package: pip install datasets") from None
    label = f"hf:{name}" + (f":{config}" if config else "")
    try:
        rows = datasets.load_dataset(name, split=split, **({"name": config} if config else {}))
    except Exception as e:  # noqa: BLE001 - hub and network errors come in many types
        raise UserError(_hugging_face_refusal(datasets, label, config, split, e)) from None
    where = label if split == "train" else f"{label} ({split})"
    rows = pictures.undecoded(rows)
    return _records(((f"{where} row {i}", dict(row)) for i, row in enumerate(rows)), where)


def _hugging_face_refusal(datasets, label: str, config: str, split: str, error: Exception) -> str:
    """What went wrong loading a Hugging Face dataset: a split or config it lacks (naming those it has), or else."""
    said = _first_line(error)
    name = label[3:].split(":")[0]
    if isinstance(error, ValueError) and "split" in said.lower():
        available = _names_or_none(datasets.get_dataset_split_names, name, config or None)
        choose = f"choose one of {', '.join(available)}" if available else said
        return f"{label} has no split {split!r}; {choose} with --data-split"
    if isinstance(error, ValueError) and "config" in said.lower():
        available = _names_or_none(datasets.get_dataset_config_names, name)
        choose = f"one of {', '.join(available)}" if available else said
        if not config:
            return f"{label} has several configs: name one as hf:{name}:CONFIG, {choose}"
        return f"{label} has no config {config!r}; name {choose} as hf:{name}:CONFIG"
    return (
        f"could not load Hugging Face dataset {label[3:]!r} ({type(error).__name__}: {said[:160]}); without network, "
        "export it to JSONL elsewhere and pass --data FILE.jsonl"
    )


def _names_or_none(lookup, *args) -> list[str]:
    try:
        return [str(name) for name in lookup(*args)]
    except Exception:  # noqa: BLE001 - only a better message: without it the error's own line is given
        return []


def _record(obj, where: str, fmt: str = "dolly") -> Record:
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a record (an object with {FORMATS[fmt]}), got {documents.kind_of(obj)}")
    if fmt in PREFERENCE_FORMATS:
        return _pair_record(obj, where, fmt)
    if fmt in PROMPT_FORMATS:
        return _prompt_record(obj, where)
    if fmt == "completion-chat":
        return _completion_chat_record(obj, where)
    for name in FORMATS[fmt].split(", "):
        if name not in obj:
            raise UserError(
                f"{where}: record has no {name!r} field; this file is in {TITLES.get(fmt, fmt)} format "
                f"({FORMATS[fmt]}), "
                "as its first record is"
            )
    if fmt == "chat":
        if "tools" in obj or _has_tool_turns(obj["messages"]):
            return _tool_chat_record(obj, where)
        return _chat_record(obj["messages"], where, "messages", ("role", "content"), ROLES)
    if fmt == "sharegpt":
        system = _field(obj, "system", where, required=False)
        if _sharegpt_tools(obj):
            return _sharegpt_tool_record(obj, where, system)
        return _chat_record(obj["conversations"], where, "conversations", ("from", "value"), SHAREGPT_ROLES, system)
    if fmt == "completion":
        if isinstance(obj["prompt"], list) or isinstance(obj["completion"], list):
            raise UserError(
                f"{where}: prompt and completion as lists of messages, in a file whose first record has them as "
                "text; a file holds one form"
            )
        prompt = _field(obj, "prompt", where, required=False)
        return Record(instruction=prompt, response=_field(obj, "completion", where))
    if fmt == "text":
        return Record(instruction="", response=_field(obj, "text", where))
    if fmt == "alpaca":
        obj = {"instruction": obj["instruction"], "context": obj.get("input"), "response": obj["output"]}
    fields = {name: _field(obj, name, where, required=name in REQUIRED) for name in TEXT_FIELDS}
    return Record(**fields)


def _labelled(obj, record: Record, where: str) -> Record:
    """The record with its file:line (for messages found later: a classifier's record without a label) and its
    `label` (a classifier's class: text or a whole number) in `columns`, where it has one."""
    if not isinstance(obj, dict):
        return record
    record = dataclasses.replace(record, where=record.where or where)
    if "label" not in obj or record.columns:
        return record
    return dataclasses.replace(record, columns={"label": obj["label"]})


def _with_images(obj, where: str, fmt: str, source: str) -> Record:
    """The record, with its pictures where it has an `images` list or TRL's content parts (images.py)."""
    if not isinstance(obj, dict):
        return _record(obj, where, fmt)
    spoken = obj
    if fmt == "completion-chat" and isinstance(obj.get("prompt"), list) and isinstance(obj.get("completion"), list):
        spoken = {**obj, "messages": [*obj["prompt"], *obj["completion"]]}  # audio parts in either list
    clips = audio.audio_paths(spoken, where, source) if not source.startswith("hf:") else ()
    if fmt == "chat" and "messages" in obj:
        obj = {**obj, "messages": images.parts_to_text(obj["messages"], where)}
    if fmt == "completion-chat":
        obj = {**obj, **{key: images.parts_to_text(obj.get(key), where) for key in ("prompt", "completion")}}
    if fmt == "prompts-chat":  # GRPO's prompt as messages, TRL's content parts among them
        obj = {**obj, "prompt": images.parts_to_text(obj.get("prompt"), where)}
    paths = _pictures(obj, where, source)
    record = _labelled(obj, _record(obj, where, fmt), where)
    texts = [record.instruction, record.context, record.response] + [text for _, text in record.turns[1:-1]]
    if fmt in PROMPT_FORMATS:  # no answer: the last turn is the user's, placeholders and all
        texts = [record.instruction] + [text for _, text in record.turns[1:]]
    if clips or "audios" in obj:
        _check_placeholders(texts, clips, where, audio.PLACEHOLDER, "audio clip")
        record = dataclasses.replace(record, audios=clips)
    if not paths and "images" not in obj and not (source.startswith("hf:") and "image" in obj):
        return record
    _check_placeholders(texts, paths, where, images.PLACEHOLDER, "image")
    return dataclasses.replace(record, images=paths)


def _pictures(obj: dict, where: str, source: str) -> tuple:
    """The record's pictures: image file paths from a file, each checked with Pillow; from hf:NAME, its Image
    columns' pictures, held in memory (pictures.py) and checked alike."""
    if not source.startswith("hf:"):
        return images.image_paths(obj, where, source)
    held = pictures.in_row(obj, where)
    if held is None and isinstance(obj.get("images"), list) and obj["images"]:
        raise UserError(
            f"{where}: `images` holds file paths, which hf: does not resolve; give the pictures as an Image "
            "column (datasets.Image), or the records as a JSONL file beside them"
        )
    return tuple(images.check(picture, where) for picture in held or ())


def _field(obj: dict, name: str, where: str, required: bool = True) -> str:
    """obj[name] as text: null or missing reads as empty where not required; a required one must hold text."""
    value = obj.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise UserError(f"{where}: field {name!r} must be a string, got {documents.kind_of(value)}")
    _check_text(value, where, f"field {name!r}")
    if required and not value.strip():
        raise UserError(f"{where}: field {name!r} is empty; remove the record or fill it in")
    return value


def _check_text(value: str, where: str, what: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # JSON allows an escaped lone surrogate such as "\ud800"; it is not text, and the tokenizer fails on it.
        raise UserError(
            f"{where}: {what} holds a lone surrogate escape (\\ud800-\\udfff), which is not text; "
            "fix or remove the record"
        ) from None


def _chat_record(messages, where: str, key: str, names: tuple, roles: dict, system: str = "") -> Record:
    """Turns alternating user and assistant, ending with the assistant's: a chat record's `messages`
    ({role, content}) or a ShareGPT record's `conversations` ({from, value})."""
    role_key, text_key = names
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: `{key}` must be a non-empty list of {{{role_key}, {text_key}}} turns")
    turns = []
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not isinstance(message.get(text_key), str):
            raise UserError(
                f"{where}: message {number} must be an object with a `{role_key}` and a string `{text_key}`"
            )
        role, content = message.get(role_key), message[text_key]
        if role in SYSTEM_ROLES and number == 1:
            system = content
            continue
        if not isinstance(role, str) or role not in roles:  # a list or an object is no role, and not hashable
            speakers = ", ".join(roles)
            raise UserError(f"{where}: message {number} has {role_key} {role!r}; use system (first only), {speakers}")
        expected = "user" if len(turns) % 2 == 0 else "assistant"
        if roles[role] != expected:
            raise UserError(f"{where}: message {number} should be the {expected}'s: turns must alternate, user first")
        if not content.strip():
            raise UserError(f"{where}: message {number} is empty; remove the record or fill it in")
        _check_text(content, where, f"message {number}")
        turns.append((expected, content))
    if not turns or turns[-1][0] != "assistant":
        raise UserError(f"{where}: the last message must be the assistant's, which is what the model learns")
    messages = [{"role": role, "content": text} for role, text in turns]
    if system:
        _check_text(system, where, "the system turn")
        turns[0] = ("user", f"{system}\n\n{turns[0][1]}")
        messages.insert(0, {"role": "system", "content": system})
    return Record(instruction=turns[0][1], response=turns[-1][1], turns=tuple(turns), messages=tuple(messages))


def _completion_chat_record(obj: dict, where: str) -> Record:
    """TRL's conversational prompt-completion: `prompt` messages ending with the user's, and `completion`, the
    assistant's answer; read as a chat of the two whose prompt's model turns are not trained (as TRL's
    completion-only loss)."""
    prompt, completion = obj.get("prompt"), obj.get("completion")
    for key, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, list) or not value:
            raise UserError(
                f"{where}: `{key}` must be a non-empty list of {{role, content}} messages, as the file's first "
                f"record's is, got {documents.kind_of(value)}"
            )
    first = completion[0]
    if not isinstance(first, dict) or not isinstance(first.get("role"), str) or ROLES.get(first["role"]) != "assistant":
        raise UserError(f"{where}: the completion must open with the assistant's message, which the model learns")
    if "tools" in obj or _has_tool_turns(prompt) or _has_tool_turns(completion):  # read as tool-chat (read())
        record = _tool_chat_record({"tools": obj.get("tools"), "messages": [*prompt, *completion]}, where)
    else:
        record = _chat_record([*prompt, *completion], where, "prompt and completion", ("role", "content"), ROLES)
    return dataclasses.replace(record, prompt_messages=len(prompt), where=where)


# LLaMA-Factory's ShareGPT speakers for tools: the model's call (a JSON {name, arguments}, or a list of them) and the
# tool's answer.
SHAREGPT_TOOL_ROLES = ("function_call", "observation")


def _sharegpt_tools(obj: dict) -> bool:
    """Whether a ShareGPT record has tools (a non-empty `tools`) or tool turns: LLaMA-Factory's form of them."""
    turns = obj.get("conversations")
    called = isinstance(turns, list) and any(isinstance(t, dict) and t.get("from") in SHAREGPT_TOOL_ROLES
                                             for t in turns)  # fmt: skip
    tools = obj.get("tools")
    return called or (tools is not None and tools != "" and tools != [] and tools != "[]")


def _sharegpt_tool_record(obj: dict, where: str, system: str) -> Record:
    """LLaMA-Factory's ShareGPT with tools, read as tool-chat: `function_call` turns are the assistant's tool_calls,
    `observation` turns the tools' answers, and `tools` (a list or its JSON text) the schemas, each either OpenAI's
    {type: function, function: {...}} or the bare function {name, description, parameters}."""
    turns = obj["conversations"]
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: `conversations` must be a non-empty list of {{from, value}} turns")
    messages = [{"role": "system", "content": system}] if system else []
    named = None  # the function the last call named: the name an observation answers
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise UserError(f"{where}: message {number} must be an object with a `from` and a string `value`")
        speaker, value = turn.get("from"), turn["value"]
        if speaker == "system" and number == 1:
            messages.insert(0, {"role": "system", "content": value})
        elif speaker == "function_call":
            calls = _json_calls(value, number, where)
            named = calls[0]["function"]["name"] if len(calls) == 1 else None
            messages.append({"role": "assistant", "tool_calls": calls})
        elif speaker == "observation":
            messages.append({"role": "tool", "content": value, **({"name": named} if named else {})})
        elif isinstance(speaker, str) and speaker in SHAREGPT_ROLES:
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": value})
        else:
            speakers = ", ".join([*SHAREGPT_ROLES, *SHAREGPT_TOOL_ROLES])
            raise UserError(f"{where}: message {number} has from {speaker!r}; use system (first only), {speakers}")
    return _tool_chat_record({"tools": _bare_tools(obj.get("tools"), where), "messages": messages}, where)


def _json_calls(value: str, number: int, where: str) -> list:
    """A function_call turn's calls: its JSON {name, arguments} (or a list of them) as tool_calls."""
    try:
        calls = json.loads(value)
    except ValueError:
        calls = None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise UserError(f"{where}: message {number} is a function_call whose value is not a call: it must be the "
                        'JSON text of {"name": ..., "arguments": {...}}, or a list of them')  # fmt: skip
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]


def _bare_tools(tools, where: str):
    """`tools` with each bare function schema ({name, description, parameters}) put in OpenAI's {type: function,
    function: ...}, as tool-chat reads them; empty text is none."""
    if isinstance(tools, str):
        if not tools.strip():
            return None
        try:
            tools = json.loads(tools)
        except ValueError:
            raise UserError(f"{where}: `tools` is text that is not JSON; give a list of tool schemas") from None
    if not isinstance(tools, list):
        return tools  # _tools says what it must be
    return [{"type": "function", "function": t} if isinstance(t, dict) and "function" not in t and "name" in t
            else t for t in tools]  # fmt: skip


TOOL_KEYS = ("tool_calls", "reasoning_content", "reasoning", "thinking")  # beside role and content: tool-chat's


def _has_tool_turns(messages) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or any(key in m for key in TOOL_KEYS)) for m in messages
    )


def _tool_chat_record(obj: dict, where: str) -> Record:
    """TRL's tool-calling form: `tools` (JSON schemas), and messages in which the assistant may call tools
    (`tool_calls`) and think (`reasoning_content`), and `tool` messages answer the calls."""
    tools = _tools(obj.get("tools"), where)
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: `messages` must be a non-empty list of {{role, content}} messages")
    kept, previous, pending = [], None, []
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise UserError(f"{where}: message {number} must be an object with a `role`")
        role = message.get("role")
        role = ROLES.get(role, role) if isinstance(role, str) else role
        if pending and role != "tool" and previous == "tool":
            _unanswered(pending, number, where)
        if role in SYSTEM_ROLES and number == 1:
            kept.append({"role": "system", "content": _message_text(message, number, where)})
            continue
        if role not in ("user", "assistant", "tool"):
            raise UserError(
                f"{where}: message {number} has role {role!r}; use system (first only), user, assistant, tool"
            )
        if previous is None and role != "user":
            raise UserError(f"{where}: message {number} should be the user's: a conversation opens with the user")
        if role == "tool" and previous not in ("tool", "called"):
            raise UserError(f"{where}: message {number} is a tool's answer with no assistant tool_calls before it")
        if previous == "called" and role != "tool":
            raise UserError(f"{where}: message {number} is the {role}'s, but the assistant's tool_calls before it "
                            "have no answer: put each call's `tool` message after them")  # fmt: skip
        kept.append(_tool_message(message, role, number, where))
        _check_called(kept[-1], tools, number, where)
        if "tool_calls" in kept[-1]:
            for index, call in enumerate(kept[-1]["tool_calls"]):  # each its id: which answer is whose (below)
                call.setdefault("id", f"call_{number}_{index}")
            pending = list(kept[-1]["tool_calls"])
        if role == "tool":
            kept[-1]["tool_call_id"] = _answered(pending, kept[-1], number, where)["id"]
        previous = "called" if role == "assistant" and "tool_calls" in kept[-1] else role
    if pending and previous == "tool":
        _unanswered(pending, len(messages) + 1, where)
    if kept[-1]["role"] != "assistant":
        raise UserError(f"{where}: the last message must be the assistant's, which is what the model learns")
    said = [(m["role"], m.get("content", "")) for m in kept if m["role"] in ("user", "assistant") and m.get("content")]
    first = next((text for role, text in said if role == "user"), "")
    last = next((text for role, text in reversed(said) if role == "assistant"), "")
    return Record(instruction=first, response=last, turns=tuple(said), messages=tuple(kept), tools=tools)


def _answered(pending: list, message: dict, number: int, where: str) -> dict:
    """The call a tool message answers, taken off `pending`: the one its tool_call_id names, else the first of its
    `name`, else the first. Gemma 4's template writes each answer under the name of the call whose id it gives:
    without ids, every answer of a message of two calls was written under the last call's name."""
    if not pending:
        raise UserError(f"{where}: message {number} is a tool's answer, but every call before it has one already")
    wanted, name = message.get("tool_call_id"), message.get("name")
    if wanted is not None:
        found = next((call for call in pending if call.get("id") == wanted), None)
        if found is None:
            raise UserError(f"{where}: message {number} answers call {wanted!r}, which no unanswered call before it "
                            "has as its id")  # fmt: skip
    elif name is not None:
        found = next((call for call in pending if call["function"]["name"] == name), None)
        if found is None:
            raise UserError(f"{where}: message {number} is {name!r}'s answer, but no unanswered call before it "
                            f"calls {name!r}")  # fmt: skip
    else:
        found = pending[0]
    pending.remove(found)
    return found


def _unanswered(pending: list, number: int, where: str) -> None:
    names = ", ".join(repr(call["function"]["name"]) for call in pending)
    raise UserError(f"{where}: the tool calls before message {number} left {names} without a `tool` answer; give "
                    "each call its answer, in order or by tool_call_id")  # fmt: skip


def _check_called(message: dict, tools: tuple, number: int, where: str) -> None:
    """Refuse a call of a tool the record's `tools` do not declare, where it declares any: the model would learn
    to call a function its prompt never shows."""
    declared = [tool["function"]["name"] for tool in tools]
    for call in message.get("tool_calls", ()) if declared else ():
        name = call["function"]["name"]
        if name not in declared:
            raise UserError(f"{where}: message {number} calls {name!r}, which the record's tools do not declare "
                            f"({', '.join(declared)}); fix the name, or add its schema to `tools`")  # fmt: skip


def _tool_message(message: dict, role: str, number: int, where: str) -> dict:
    """One user, assistant or tool message, checked, with the keys a chat template reads."""
    kept = {"role": role}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise UserError(f"{where}: message {number} has tool_calls; only the assistant calls tools")
        kept["tool_calls"] = _tool_calls(calls, number, where)
    if message.get("content") is not None or not calls:
        kept["content"] = _message_text(message, number, where, empty_ok=bool(calls))
    for key in ("reasoning_content", "reasoning", "thinking"):
        if message.get(key) is not None:
            if role != "assistant" or not isinstance(message[key], str):
                raise UserError(f"{where}: message {number}'s {key} must be the assistant's thinking, as text")
            kept[key] = message[key]
    for key in ("name", "tool_call_id"):  # which call a tool message answers
        if role == "tool" and isinstance(message.get(key), str):
            kept[key] = message[key]
    return kept


def _message_text(message: dict, number: int, where: str, empty_ok: bool = False) -> str:
    content = message.get("content")
    if not isinstance(content, str):
        raise UserError(f"{where}: message {number} must have a string `content`, got {documents.kind_of(content)}")
    if not empty_ok and not content.strip():
        raise UserError(f"{where}: message {number} is empty; remove the record or fill it in")
    _check_text(content, where, f"message {number}")
    return content


def _tool_calls(calls, number: int, where: str) -> list:
    """An assistant message's tool_calls, each {type: function, function: {name, arguments}}; arguments given as
    a JSON text (as some datasets store them) are read into the object the templates take."""
    form = "a list of {type: function, function: {name, arguments: {...}}}"
    if not isinstance(calls, list) or not calls:
        raise UserError(f"{where}: message {number}'s tool_calls must be {form}")
    kept = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise UserError(f"{where}: message {number}'s tool_calls[{index}] has arguments written as text that "
                                f"is not JSON ({e.msg} at character {e.pos}); write them as an object or as JSON "
                                "text") from None  # fmt: skip
        if not isinstance(name, str) or not name.strip() or not isinstance(arguments, dict):
            raise UserError(f"{where}: message {number}'s tool_calls[{index}] is not a call: it must be {form[10:]}")
        kept.append({**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}})
    return kept


def _tools(tools, where: str) -> tuple:
    """A record's `tools`: JSON schemas of functions ({type: function, function: {name, ...}}), a list or its JSON
    text (as Hugging Face datasets often store it); null or missing is none."""
    if tools is None:
        return ()
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise UserError(f"{where}: `tools` is text that is not JSON; give a list of tool schemas") from None
    form = "a list of {type: function, function: {name, description, parameters}}"
    if not isinstance(tools, list):
        raise UserError(f"{where}: `tools` must be {form}")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise UserError(f"{where}: tools[{index}] is not a tool schema: `tools` must be {form}")
    return tuple(tools)


def read_tools(tools, flag: str = "--tools") -> tuple:
    """Tool schemas given with every prompt (`finetune generate --tools`): a JSON file's path, or the schemas. The
    file holds a list of them (or {"tools": [...]}), each OpenAI's {type: function, function: {name, ...}} or a bare
    {name, description, parameters}, as a tool-chat record's `tools`."""
    where = flag
    if isinstance(tools, (str, os.PathLike)):
        where = f"{flag} {tools}"
        try:
            text = open(os.path.expanduser(tools), encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{where}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        try:
            tools = json.loads(text)
        except ValueError:
            raise UserError(f"{where} is not JSON; give a list of tool schemas") from None
    if isinstance(tools, dict) and "tools" in tools:
        tools = tools["tools"]
    found = _tools(_bare_tools(list(tools) if isinstance(tools, tuple) else tools, where), where)
    if not found:
        raise UserError(f"{where} holds no tools; give a list of tool schemas, or leave {flag} out")
    return found


def answered(prompt, completion: str) -> Record:
    """A prompt (text, or messages as a conversational prompt record has them) and one answer to it, as a pair
    whose chosen side is that answer: what a reward model scores (methods/reward.py). The answer may be empty."""
    if isinstance(prompt, list):
        record = _chat_record([*prompt, {"role": "assistant", "content": "-"}], "", "prompt", ("role", "content"),
                              ROLES)  # fmt: skip
        turns = (*record.turns[:-1], ("assistant", completion))
        return Record(instruction=record.instruction, response=completion, turns=turns, rejected=completion or "-")
    return Record(instruction=prompt, response=completion, rejected=completion or "-")


def _prompt_record(obj: dict, where: str) -> Record:
    """A prompt alone (TRL's prompt-only form): text, or messages ending with the user's; its other keys kept."""
    if "completion" in obj or "chosen" in obj:
        raise UserError(f"{where}: a file of prompts (for --method grpo) holds no answers; this record has one")
    columns = {key: value for key, value in obj.items() if key not in ("prompt", "images")}
    if isinstance(obj["prompt"], list):
        # Read as a chat whose answer is still to come: checked as one with an answer, which is then taken off.
        last = obj["prompt"][-1] if obj["prompt"] else None
        if not isinstance(last, dict) or ROLES.get(last.get("role")) != "user":
            raise UserError(f"{where}: a prompt's last message must be the user's, which the model answers")
        answered = [*obj["prompt"], {"role": "assistant", "content": "-"}]
        record = _chat_record(answered, where, "prompt", ("role", "content"), ROLES)
        return dataclasses.replace(
            record, response="", turns=record.turns[:-1], messages=record.messages[:-1], where=where, columns=columns
        )
    return Record(instruction=_field(obj, "prompt", where), response="", where=where, columns=columns)


# === Preference pairs: TRL's forms (docs/preference.md) ===

HH_TURN = "\n\nAssistant:"  # Anthropic HH's texts end each human turn so; the answer follows the last


def _pair_record(obj: dict, where: str, fmt: str) -> Record:
    """A preference pair: prompt and chosen answer as an SFT record has them, plus the rejected answer."""
    for name in ("chosen", "rejected"):
        if name not in obj:
            raise UserError(
                f"{where}: record has no {name!r} field; this file holds preference pairs (chosen, rejected), "
                "as its first record does"
            )
    record = _text_pair(obj, where) if fmt == "preference" else _chat_pair(obj, where)
    if record.response == record.rejected:
        raise UserError(f"{where}: chosen and rejected are the same answer; a pair must tell a better from a worse")
    return record


def _text_pair(obj: dict, where: str) -> Record:
    if isinstance(obj.get("prompt"), list):
        raise UserError(
            f"{where}: the prompt is a list of messages but chosen and rejected are text; give all three as "
            "messages, or all three as text"
        )
    chosen, rejected = _field(obj, "chosen", where), _field(obj, "rejected", where)
    if obj.get("prompt") is not None:
        prompt = _field(obj, "prompt", where, required=False)
    elif chosen == rejected:
        prompt = ""  # refused as identical by the caller
    else:
        prompt, chosen, rejected = implicit_prompt(chosen, rejected)
        if not chosen.strip() or not rejected.strip():
            empty = "chosen" if not chosen.strip() else "rejected"
            raise UserError(f"{where}: the {empty} answer is empty once the prompt the two share is taken off")
    return Record(instruction=prompt, response=chosen, rejected=rejected, where=where)


def implicit_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) of two full texts: the prompt is their longest shared beginning.

    As TRL's extract_prompt: a space before the first difference goes with the answers, and where one text
    begins the other the last shared character does too. Where the shared beginning holds Anthropic HH's
    "\n\nAssistant:", the prompt ends after the last one, so that each answer is the assistant's whole turn
    even where both open with the same words.
    """
    shortest = min(len(chosen), len(rejected))
    cut = next((i for i in range(shortest) if chosen[i] != rejected[i]), shortest - 1)
    if cut > 0 and chosen[cut - 1] == " ":
        cut -= 1
    turn = chosen.rfind(HH_TURN, 0, cut)
    if turn >= 0:
        cut = turn + len(HH_TURN)
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _chat_pair(obj: dict, where: str) -> Record:
    """Conversational pairs: a `prompt` of messages and one assistant message each in chosen and rejected, or
    chosen and rejected as whole conversations whose leading messages (the prompt) are the same."""
    prompt = obj.get("prompt")
    for name in ("chosen", "rejected"):
        if not isinstance(obj[name], list) or not obj[name]:
            kind = "an empty list" if obj[name] == [] else documents.kind_of(obj[name])
            raise UserError(f"{where}: `{name}` must be a non-empty list of {{role, content}} messages, got {kind}")
    chosen, rejected = obj["chosen"], obj["rejected"]
    if chosen == rejected:
        raise UserError(f"{where}: chosen and rejected are the same answer; a pair must tell a better from a worse")
    if isinstance(prompt, list):
        messages = prompt
    else:  # no prompt, or UltraFeedback's prompt text beside whole conversations: the shared messages are it
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        messages, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    answers = [_answer(side, name, where) for side, name in ((chosen, "chosen"), (rejected, "rejected"))]
    if not messages:
        raise UserError(f"{where}: the pair has no prompt: give `prompt` messages, or conversations that share them")
    record = _chat_record([*messages, chosen[0]], where, "prompt", ("role", "content"), ROLES)
    return Record(
        instruction=record.instruction,
        response=answers[0],
        turns=record.turns,
        rejected=answers[1],
        where=where,
        messages=record.messages,
    )


def _answer(messages: list, name: str, where: str) -> str:
    """The text of the one assistant message a pair's `name` side adds after the prompt."""
    message = messages[0] if len(messages) == 1 else None
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(role, str) or ROLES.get(role) != "assistant" or not isinstance(message.get("content"), str):
        first = messages[0].get("role") if messages and isinstance(messages[0], dict) else None
        raise UserError(
            f"{where}: after the prompt, `{name}` must be one assistant message {{role: assistant, content}}; it "
            f"is {len(messages)} message(s)" + (f", the first with role {first!r}" if messages else "")
        )
    content = message["content"]
    _check_text(content, where, f"the {name} answer")
    if not content.strip():
        raise UserError(f"{where}: the {name} answer is empty; remove the pair or fill it in")
    return content


def filter_records(records, *, drop_context=False, categories=(), max_records=None, source="", fix=None):
    """Apply the data filters; an empty result is a user error, ending with `fix` (by default: the flags to relax)."""
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
        fix = fix or "relax --category / --drop-context or use another file"
        found = sorted({r.category for r in records if r.category})
        held = ""
        if categories:  # what the file holds, for a category mistyped (Open_QA for open_qa)
            shown = ", ".join(found[:12]) + (f" and {len(found) - 12} more" if len(found) > 12 else "")
            held = f"; its categories are {shown}" if found else "; its records name no category"
        raise UserError(
            f"no usable records in {source or 'the data'} after filters ({', '.join(applied) or 'none'}){held}; {fix}"
        )
    return kept


def fingerprint(records) -> str:
    """sha256 of the records' text: a resume refuses data that changed since its checkpoint."""
    digest = hashlib.sha256()
    for r in records:
        fields = [r.instruction, r.context, r.response, r.category] + ([r.turns] if r.turns else [])
        fields += [[pictures.key(p) for p in r.images]] if r.images else []
        fields += [["audio", *r.audios]] if r.audios else []
        fields += [r.rejected] if r.rejected else []  # SFT records' fingerprints stay as they were
        fields += [r.columns] if r.columns else []
        fields += [list(r.messages), list(r.tools)] if r.uses_tools else []  # other chats' turns say it all
        digest.update(json.dumps(fields, default=str).encode("utf-8"))
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


def _check_placeholders(texts, items: tuple, where: str, placeholder: str, item: str) -> None:
    """One `placeholder` (<image>, <audio>) in the record's texts per picture or clip it names."""
    found = sum(text.count(placeholder) for text in texts)
    if found != len(items):
        raise UserError(f"{where}: the record has {found} {placeholder} placeholder(s) and {len(items)} {item}(s); "
                        f"each {item.split()[-1]} needs one placeholder where it goes")  # fmt: skip
