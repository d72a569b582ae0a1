"""Documents read from outside: a value of the shape asked for, or one message naming the document and the field.

tests/test_properties.py throws arbitrary JSON at the documents that use it.
"""

import pytest

from finetune.platform import documents
from finetune.platform.documents import Document, DocumentError

pytestmark = pytest.mark.one_backend  # no Keras backend in these: they run in one suite


def test_a_field_of_the_kind_asked_for_is_given_back():
    doc = Document({"rank": 4, "alpha": 8, "name": "x", "targets": ["query"], "pool": {"a": 1}}, "adapter.json")
    assert doc.field("rank", int, check=documents.at_least(1)) == 4
    assert doc.field("alpha", float) == 8  # an integer is a number
    assert doc.items("targets", str) == ["query"]
    assert doc.section("pool").field("a", int) == 1
    assert doc.field("missing", str, required=False, default="d") == "d"
    assert doc.items("missing", str, required=False) == []


@pytest.mark.parametrize(
    "value, kind, message",
    [
        (True, int, "adapter.json: rank must be an integer, got true"),  # true is no integer in JSON
        (float("nan"), float, "adapter.json: rank must be a number, got NaN"),  # nor NaN a number we take
        ([4], int, "adapter.json: rank must be an integer, got a list"),
        ("4", int, "adapter.json: rank must be an integer, got text"),
        (0, int, "adapter.json: rank must be at least 1, got 0"),
        (None, int, "adapter.json has no rank; copy it back"),
    ],
)
def test_a_field_of_another_kind_is_named_with_the_document(value, kind, message):
    with pytest.raises(DocumentError) as error:
        Document({"rank": value}, "adapter.json", "copy it back").field("rank", kind, check=documents.at_least(1))
    assert str(error.value).startswith(message) and str(error.value).endswith("; copy it back")
    assert error.value.what in str(error.value) and "copy it back" not in error.value.what


def test_nested_fields_are_named_by_their_path():
    doc = Document({"cluster": {"pool": ["h:1", 7]}, "list": [{"a": "x"}, 3]}, "CLUSTER_SPEC")
    with pytest.raises(DocumentError, match=r"^CLUSTER_SPEC: cluster.pool\[1\] must be text, got a number$"):
        doc.section("cluster").items("pool", str)
    with pytest.raises(DocumentError, match=r"list\[1\] must be an object, got a number"):
        doc.items("list", dict)
    with pytest.raises(DocumentError, match=r"^status.json is not an object \(it holds null\)$"):
        Document(None, "status.json")


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "is not valid JSON"),
        ("[" * 50_000, "is nested too deeply to read"),
        ("1" * 5000, "cannot be read"),  # past Python's 4300 digits
        (b"\xff\xfe{", "cannot be read"),
    ],
)
def test_text_that_is_not_json_is_one_message(text, message):
    with pytest.raises(DocumentError, match=f"^metrics.json {message}"):
        documents.parse_json(text, "metrics.json")


def test_values_are_named_in_json_words():
    words = [documents.kind_of(v) for v in (None, True, 1, 1.5, "a", [1], {"a": 1}, b"x")]
    assert words == ["null", "true", "a number", "a number", "text", "a list", "an object", "binary data"]
