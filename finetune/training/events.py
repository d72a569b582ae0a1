"""TensorBoard event files, written without TensorFlow.

An event file is a sequence of TFRecords, each an `Event` protocol buffer.
TensorFlow's own writer (tf.summary) costs a JAX or PyTorch process the
import of TensorFlow, about 590 MiB of resident memory (measured: 1,146 MiB
after `import keras, keras_hub` with TensorFlow importable, 560 MiB without),
for a few scalars a step. So the handful of fields a scalar needs are encoded
here by hand, as tf.summary.write lays them out: the scalars plugin's
metadata and a float32 scalar tensor, which TensorBoard charts.

Wire format, from the protocol buffer definitions TensorBoard reads
(event.proto, summary.proto, tensor.proto):
- Event: wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5, session_log = 7;
- SessionLog: status = 1 (START is 1). Each session of a run opens with one, as TensorFlow's supervisor did: the
  first one seen starts the run, and each later one, at step N, makes TensorBoard drop the events before it of
  step N and later (a restarted job's purge_step, as tensorboardX writes it);
- Summary: value = 1 (repeated); Summary.Value: tag = 1, tensor = 8, metadata = 9;
- SummaryMetadata: plugin_data = 1; PluginData: plugin_name = 1;
- TensorProto: dtype = 1 (DT_FLOAT is 1), tensor_shape = 2 (empty: a scalar), float_val = 5.
- A TFRecord is the length (uint64, little-endian), its masked CRC-32C, the
  bytes, and their masked CRC-32C.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

_CASTAGNOLI = 0x82F63B78  # CRC-32C's polynomial, bit-reversed


def _crc_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CASTAGNOLI if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits, plus a constant."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord holding `data`."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked(crc32c(length))) + data + struct.pack("<I", _masked(crc32c(data)))


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # a negative int64 takes ten bytes, two's complement
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): strings, bytes and nested messages."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    return _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step) + body


_SCALAR_METADATA = _field(9, _field(1, _field(1, b"scalars")))  # Value.metadata.plugin_data.plugin_name


def scalar_event(tag: str, value: float, step: int, wall_time: float | None = None) -> bytes:
    """An Event with one float32 scalar, as tf.summary.write with the scalars plugin's metadata writes it."""
    tensor = _varint(1 << 3) + _varint(1) + _field(2, b"") + _field(5, struct.pack("<f", value))
    summary_value = _field(1, tag.encode("utf-8")) + _field(8, tensor) + _SCALAR_METADATA
    return _event(time.time() if wall_time is None else wall_time, step, _field(5, _field(1, summary_value)))


class EventFile:
    """One session's event file, `events.out.tfevents.<time>.<host>.<ns>.finetune` in `log_dir`, flushed after every
    write.

    purge_from: int. The first step this session logs (its SessionLog.START's step): after a kill, a session resumed
        from a checkpoint logs again steps that an earlier one logged, and TensorBoard hides those of the earlier.
    """

    def __init__(self, log_dir: Path, purge_from: int = 0):
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        # A file of its own (x), never another session's: one started in the same second had the same name, and
        # was appended to. The nanoseconds sort a later session's file after an earlier one's, as TensorBoard
        # reads a run's files in name order (the session start's purge needs it).
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{time.time_ns()}.finetune"
        self.path = log_dir / name
        self._file = open(self.path, "xb")  # noqa: SIM115 - held open until close()
        self._file.write(record(_event(now, 0, _field(3, b"brain.Event:2"))))
        self._file.write(record(_event(now, purge_from, _field(7, _varint(1 << 3) + _varint(1)))))
        self._file.flush()

    def scalars(self, step: int, values: dict) -> None:
        now = time.time()
        self._file.write(b"".join(record(scalar_event(tag, float(v), step, now)) for tag, v in values.items()))
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
