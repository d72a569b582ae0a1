"""TensorBoard event files written without TensorFlow (events.py), framed as TensorFlow frames them.

pytestmark = pytest.mark.one_backend  # no Keras backend in these: they run in one suite

That TensorBoard's own reader charts what a run writes is test_callbacks.py's.
"""


def test_event_records_carry_crc32c_and_tensorflow_s_layout(tmp_path):
    """CRC-32C's published check value, and a record as TFRecord frames it (length, its masked CRC, data, CRC)."""
    import struct

    from finetune.training import events

    assert events.crc32c(b"123456789") == 0xE3069283
    framed = events.record(b"abc")
    assert struct.unpack("<Q", framed[:8])[0] == 3 and framed[12:15] == b"abc" and len(framed) == 19
