"""Best-fit decreasing packing (packing.py): every example placed once, whole, within a row, with less padding.

That a packed example then trains as it would alone is the segment mask's work: test_attention.py.
"""

import numpy as np
import pytest
from conftest import examples_of

from finetune.data import batching, packing

pytestmark = pytest.mark.one_backend  # no Keras backend in these: they run in one suite


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(5, 300, size=500)]
    bins = packing.best_fit_decreasing(lengths, 512)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    # Best-fit decreasing is within 11/9 OPT + 1 bins; the sum bound is a lower bound on OPT.
    assert len(bins) <= 11 / 9 * (sum(lengths) / 512 + 1) + 1
    assert bins == packing.best_fit_decreasing(lengths, 512)  # deterministic


def test_packed_rows_keep_each_example_whole_and_its_targets_inside_it():
    examples = examples_of([20, 9, 14, 30, 6, 11])
    arrays = packing.pack(examples, 32)
    assert arrays["token_ids"].shape[1] == 32 and arrays["token_ids"].shape[0] < len(examples)
    found = []
    for row in range(len(arrays["token_ids"])):
        segments = arrays["segment_ids"][row]
        for segment in range(1, segments.max() + 1):
            where = np.flatnonzero(segments == segment)
            assert (np.diff(where) == 1).all()  # contiguous
            ids = [*arrays["token_ids"][row, where].tolist(), int(arrays["labels"][row, where[-1]])]
            found.append((ids, arrays["weights"][row, where].tolist()))
    assert sorted(map(str, found)) == sorted(str((e.token_ids, e.weights[1:])) for e in examples)
    assert packing.padding_fraction(arrays) < packing.padding_fraction(batching.pad(examples, 32))
