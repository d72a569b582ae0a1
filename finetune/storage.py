"""Durable local writes: a file or a rename survives a crash once these return.

Shared by checkpoints and the run's results. gs:// and /gcs/ outputs will live
here too (stage locally, then copy), so that one module knows where bytes land.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_synced(path: Path, payload: bytes) -> None:
    """Write `payload` to `path` and fsync it."""
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_directory(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
