"""The suite's own machinery (tests/conftest.py): the order its workers take the test files in."""

from collections import OrderedDict

import pytest
from conftest import TESTS, longest_first, stored_durations

pytestmark = pytest.mark.one_backend


def test_the_stored_durations_name_test_files_that_exist():
    stored = stored_durations()
    assert set(stored) == {"jax", "torch", "tensorflow"}
    for backend, seconds in stored.items():
        missing = [path for path in seconds if not (TESTS.parent / path).is_file()]
        assert not missing, f"{backend}: {missing} (rerun that suite with --store-durations)"
        assert all(isinstance(s, (int, float)) and s >= 0 for s in seconds.values())


def test_the_longest_file_is_handed_out_first_and_an_unmeasured_one_counts_a_second_a_test():
    queue = OrderedDict(
        (path, dict.fromkeys(range(n), False)) for path, n in (("a", 30), ("b", 1), ("c", 3), ("d", 40))
    )
    seconds = {"a": 5.0, "b": 118.0, "c": 2.0}
    order = []
    while queue:
        longest_first(queue, seconds)
        order.append(queue.popitem(last=False)[0])
    assert order == ["b", "d", "a", "c"]  # d: unmeasured, 40 tests
