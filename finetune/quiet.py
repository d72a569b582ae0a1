"""Keep the frameworks' own log lines off the terminal, so that what a user reads is the tool's.

TensorFlow (which keras-hub imports on every backend), XLA and SentencePiece
write C++ log lines straight to file descriptor 2: the absl banner, oneDNN and
CUDA-stub notes, `E0000 ... failed call to cuInit` on a machine without a GPU
(which a CPU user reads as a failure), SentencePiece's normalizer note. Some
come before absl's logging starts, so TF_CPP_MIN_LOG_LEVEL does not remove
them. `install()` puts a filter on descriptor 2 before any framework is
imported: a pipe whose reader thread passes on every line except those, and
the frameworks' Python warnings are ignored. `--verbose` skips it.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import warnings

# C++ log lines in glog/absl form ("I0000 00:00:1795325987.734281   15909 port.cc:153] ..."), the
# absl pre-initialisation banner, SentencePiece's LOG(INFO) lines, and the connection lines of Gloo
# (JAX's CPU collectives in a multi-process job).
NOISE = re.compile(
    rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.\-]+:\d+\]"
    rb"|[\w.\-]+\.cc\(\d+\) LOG\(INFO\)"
    rb"|\[Gloo\] Rank \d+ is connected to \d+ peer ranks)"
)
FRAMEWORKS = r"(keras|keras_hub|tensorflow|tf_keras|jax|jaxlib|torch|absl|google\.protobuf)(\.|$)"
_installed: dict = {}


def is_noise(line: bytes) -> bool:
    return bool(NOISE.match(line))


def install() -> None:
    """Filter descriptor 2 for the rest of this process (idempotent). Call before importing any framework."""
    if _installed or not hasattr(os, "pipe"):
        return
    warnings.filterwarnings("ignore", module=FRAMEWORKS)
    sys.stderr.flush()
    terminal = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    pump = threading.Thread(target=_pass_on, args=(read_end, terminal), name="finetune-stderr", daemon=True)
    pump.start()
    _installed.update(terminal=terminal, pump=pump)
    atexit.register(_uninstall)


def _pass_on(read_end: int, terminal: int) -> None:
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not is_noise(line):
                    os.write(terminal, line + b"\n")
            if pending and not NOISE.match(pending[:120]) and len(pending) > 8192:
                os.write(terminal, pending)  # a long line without an end: pass it on as it comes
                pending = b""
        if pending and not is_noise(pending):
            os.write(terminal, pending)


def _uninstall() -> None:
    """Put the terminal back on descriptor 2 and let the reader pass on what is left in the pipe."""
    if not _installed:
        return
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.dup2(_installed["terminal"], 2)  # closes our write end of the pipe: the reader sees its end
    _installed["pump"].join(timeout=2)
    _installed.clear()
