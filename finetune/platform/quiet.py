"""Keep the frameworks' own log lines off the terminal, so that what a user reads is the tool's.

TensorFlow (which keras-hub imports on every backend), XLA and SentencePiece
write C++ log lines straight to file descriptor 2: the absl banner, oneDNN and
CUDA-stub notes, `E0000 ... failed call to cuInit` on a machine without a GPU
(which a CPU user reads as a failure), SentencePiece's normalizer note. Some
come before absl's logging starts, so TF_CPP_MIN_LOG_LEVEL does not remove
them. `install()` puts a filter on descriptor 2 before any framework is
imported: a pipe whose reader thread passes on every line except those, and
the frameworks' Python warnings are ignored. The CLI installs it first thing,
and the Python API when it chooses the backend (backend.select), so a Jupyter
kernel's output holds no such line either: ipykernel forwards descriptor 2 to
the notebook, and the filter sits in front of it. `--verbose` (or
FINETUNE_VERBOSE=1) skips it.
"""

from __future__ import annotations

import atexit
import os
import re
import select
import sys
import threading
import warnings

# C++ log lines in glog/absl form ("I0000 00:00:1795325987.734281   15909 port.cc:153] ..."; torch's Python
# logging writes the same form with a path: "W1129 06:30:19.954000 32681 torch/_dynamo/convert_frame.py:1994]"), the
# absl pre-initialisation banner, SentencePiece's LOG(INFO) lines, and the connection lines of Gloo
# (JAX's CPU collectives in a multi-process job). TensorFlow's CPU-feature note runs over two lines, and
# the second has no log prefix: it appears where TF_CPP_MIN_LOG_LEVEL is unset (`finetune data`, which
# chooses no backend) on a CPU with instructions the TensorFlow build leaves out (AVX-512).
NOISE = re.compile(
    rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.\-/]+:\d+\]"  # a path: torch's (torch/_dynamo/...)
    rb"|To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler flags\.$"
    rb"|[\w.\-]+\.cc\(\d+\) LOG\(INFO\)"
    rb"|\[Gloo\] Rank \d+ is connected to \d+ peer ranks)"
)
FRAMEWORKS = r"(keras|keras_hub|tensorflow|tf_keras|jax|jaxlib|torch|absl|google\.protobuf)(\.|$)"
# tqdm.auto in a Jupyter kernel without ipywidgets (datasets imports it) warns "IProgress not found. Please update
# jupyter and ipywidgets", then uses its text bars anyway: advice about a package finetune does not use.
WIDGET_WARNING = r"IProgress not found"
# A line whose end has not come within this many seconds is passed on as it stands. `python -i` writes its `>>> `
# prompt to stderr and waits for input: held back, the prompt did not show, and the next line written, absl's
# banner when a second finetune.run imported TensorFlow, was read as the prompt's tail and let through. The
# frameworks write each log line whole, in one write, so none is split this way.
PARTIAL_LINE_WAIT = 0.05
# The prompts `python -i` writes to stderr. A log line that comes within PARTIAL_LINE_WAIT of one (TensorFlow's
# cuInit error on a machine without a GPU did) is read as the prompt's tail: the prompt is kept, the line dropped.
PROMPT = re.compile(rb"^(?:>>> |\.\.\. )+")
_installed: dict = {}
_verbose: list = []


def is_noise(line: bytes) -> bool:
    return bool(NOISE.match(line))


def _shown(line: bytes, end: bytes = b"\n") -> bytes:
    """What of `line` reaches the terminal: all of it, nothing where it is noise, or the prompts before noise."""
    prompts = PROMPT.match(line)
    head = prompts.group(0) if prompts else b""
    return head if is_noise(line[len(head) :]) else line + end


def keep_verbose() -> None:
    """--verbose: install() does nothing for the rest of this process."""
    _verbose.append(True)


def install() -> None:
    """Filter descriptor 2 for the rest of this process (idempotent). Call before importing any framework."""
    if _installed or _verbose or os.environ.get("FINETUNE_VERBOSE") or not hasattr(os, "pipe"):
        return
    warnings.filterwarnings("ignore", module=FRAMEWORKS)
    warnings.filterwarnings("ignore", message=WIDGET_WARNING)
    sys.stderr.flush()
    terminal = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    pump = threading.Thread(target=_pass_on, args=(read_end, terminal), name="finetune-stderr", daemon=True)
    pump.start()
    _installed.update(terminal=terminal, pump=pump, pipe=_identity(2))
    atexit.register(_uninstall)


def _identity(fd: int) -> tuple:
    stat = os.fstat(fd)
    return stat.st_dev, stat.st_ino


def _pass_on(read_end: int, terminal: int) -> None:
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        pending = b""
        while True:
            if pending and not is_noise(pending) and not _readable_within(pipe, PARTIAL_LINE_WAIT):
                os.write(terminal, _shown(pending, end=b""))  # a prompt, waiting for its reader: shown now, and
                pending = b""  # the next line is judged on its own
            chunk = pipe.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if shown := _shown(line):
                    os.write(terminal, shown)
            if pending and not NOISE.match(pending[:120]) and len(pending) > 8192:
                os.write(terminal, pending)  # a long line without an end: pass it on as it comes
                pending = b""
        if pending and not is_noise(pending):
            os.write(terminal, pending)


def _readable_within(pipe, seconds: float) -> bool:
    try:
        return bool(select.select([pipe], [], [], seconds)[0])
    except (OSError, ValueError):  # where select takes no pipes (Windows): wait for the line's end, as before
        return True


def _uninstall() -> None:
    """Put the terminal back on descriptor 2 and let the reader pass on what is left in the pipe."""
    if not _installed:
        return
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    try:
        ours = _identity(2) == _installed["pipe"]
    except OSError:
        ours = False
    if ours:
        os.dup2(_installed["terminal"], 2)  # closes our write end of the pipe: the reader sees its end
        _installed["pump"].join(timeout=2)
    else:  # someone (pytest's capture, a notebook's) has put another file on descriptor 2 since: leave it there
        os.close(_installed["terminal"])
    _installed.clear()
