"""Pairs packed (pair_packing.py): every pair once, whole, both its sequences in one micro-batch and none across a
row; the sequences' segments, positions and slots as the pair view reads them. That each packed pair scores as
it does unpacked, on every backend, is test_preference.py's."""

import numpy as np
import pytest
from test_preference import tiny_pairs

from finetune.data import batching, pair_batches, pair_packing

pytestmark = pytest.mark.one_backend  # numpy layout: the view on it is test_preference's


def test_every_pair_is_placed_once_whole_within_its_micro_batch_s_rows():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 60, size=(300, 2))
    bundles = pair_packing.place(lengths, 4, 64)
    placed = np.concatenate([b.pairs for b in bundles])
    assert sorted(placed.tolist()) == list(range(300))
    for bundle in bundles:
        used = np.zeros((4, 64), int)
        for slot, pair in enumerate(bundle.pairs):
            for side in (0, 1):
                row, start = bundle.rows[slot, side], bundle.starts[slot, side]
                assert start + lengths[pair, side] <= 64  # never across a row
                used[row, start : start + lengths[pair, side]] += 1
        assert used.max() == 1  # no two sequences overlap
    fill = lengths.sum() / (len(bundles) * 4 * 64)
    assert fill > 0.9  # the micro-batches are full
    again = pair_packing.place(lengths, 4, 64)
    assert all((a.pairs == b.pairs).all() and (a.starts == b.starts).all() for a, b in zip(again, bundles))


def test_a_packed_micro_batch_lays_each_sequence_as_a_segment_with_its_slot():
    arrays = pair_batches.pad(tiny_pairs(7), 96)
    arrays.reference[:] = np.arange(14, dtype=np.float32).reshape(7, 2)
    packed = pair_packing.pack(arrays, 2)
    bundle = packed.bundles[0]
    x, y, weights = pair_packing.inputs(packed, bundle, batching.Feed(inputs=(*batching.INPUTS, "position_ids")))
    slots, held = packed.slots, len(bundle.pairs)
    assert x["token_ids"].shape == (2, 96) and y.shape == weights.shape == (2 * slots, 7)
    assert x["padding_mask"].max() >= 2  # several sequences a row, each a segment of its own
    # The reference of slot j's chosen is at j, its rejected's at S + j; the filler slots read 0.
    reference = x["loss_reference"].reshape(2, slots)
    np.testing.assert_array_equal(reference[:, :held], arrays.reference[bundle.pairs].T)
    assert not reference[:, held:].any()
    # Each target slot names its sequence; each sequence's slots are its answer's tokens, labels as unpacked.
    weighted = x["loss_weights"].ravel() > 0
    sequences = x["loss_sequence"].ravel()[weighted]
    labels = x["loss_labels"].ravel()[weighted]
    for slot, pair in enumerate(bundle.pairs):
        for column, side in enumerate((arrays.chosen, arrays.rejected)):
            expected = side["labels"][pair][side["weights"][pair] > 0]
            np.testing.assert_array_equal(labels[sequences == slot + column * slots], expected)
    # Positions count from 0 at each segment's start, as in a row of its own.
    starts = bundle.starts[bundle.rows == 0]
    assert (x["position_ids"][0, starts] == 0).all()
    filler = pair_packing.inputs(packed, bundle, batching.Feed(), real=False)
    assert not filler[0]["loss_weights"].any() and not filler[2].any()
