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


def test_a_packed_micro_batch_splits_over_data_shards_and_processes():
    """--parallel data: each shard's R / n rows gather their own targets, each slot still names its sequence in the
    whole micro-batch, and the 2S outputs split evenly; two processes' parts, together, are the whole."""
    arrays = pair_batches.pad(tiny_pairs(9), 64, whole_chosen=True)
    arrays.reference[:] = np.arange(18, dtype=np.float32).reshape(9, 2)
    packed = pair_packing.pack(arrays, 4)
    assert packed.slots_for(4) % 2 == 0 and packed.slots_for(2) == packed.slots_for(1) == packed.slots

    def targets(x):  # (sequence, label, answer) of each weighted slot, each sequence's in order
        weighted = x["loss_weights"].ravel() > 0
        found = zip(x["loss_sequence"].ravel()[weighted], x["loss_labels"].ravel()[weighted],
                    x["loss_answer"].ravel()[weighted])  # fmt: skip
        return sorted(found, key=lambda t: t[0])  # stable: each sequence's slots keep their order

    for bundle in packed.bundles:
        one = pair_packing.inputs(packed, bundle, batching.Feed(length_step=16), scale=0.5)
        whole = pair_packing.inputs(packed, bundle, batching.Feed((0, 2, 2), 16), scale=0.5)
        assert targets(whole[0]) == targets(one[0]) and len(targets(one[0])) > 0
        assert whole[0]["loss_positions"].max() < 2 * whole[0]["token_ids"].shape[1]  # within a shard's 2 rows
        for name in ("token_ids", "padding_mask", "loss_reference", "loss_nll_scale"):
            np.testing.assert_array_equal(whole[0][name], one[0][name], err_msg=name)
        np.testing.assert_array_equal(whole[2], one[2])
        parts = [pair_packing.inputs(packed, bundle, batching.Feed((i, i + 1, 2), 16), scale=0.5) for i in range(2)]
        for name, value in whole[0].items():
            np.testing.assert_array_equal(np.concatenate([p[0][name] for p in parts]), value, err_msg=name)
        np.testing.assert_array_equal(np.concatenate([p[2] for p in parts]), whole[2])
        assert parts[0][0]["token_ids"].shape[0] == 2 and parts[0][2].shape[0] == packed.slots


@pytest.mark.parametrize("whole", [False, True])
def test_the_tokens_a_run_counts_are_the_slots_its_loss_weighs(whole):
    """response_tokens (metrics.json) is what the loss was taken on: the answers', and with ORPO's NLL every token of
    the chosen sequences, prompts too, as the batch's loss weights mark them."""
    arrays = pair_batches.pad(tiny_pairs(6), 64, whole_chosen=whole)
    pairs = np.arange(6)
    fed, trained = pair_batches.tokens(arrays, pairs)
    x, _, _ = pair_batches.inputs(arrays, pairs, 64, batching.Feed())
    assert trained == int((x["loss_weights"] > 0).sum())
    answers = sum(int(side["weights"].sum()) for side in (arrays.chosen, arrays.rejected))
    assert (trained > answers) if whole else (trained == answers)
    assert fed == sum(int(side["padding_mask"].sum()) for side in (arrays.chosen, arrays.rejected))
