"""Preference pairs packed: whole pairs fill micro-batches of R rows, each answer's sequence a segment of its own.

Unpacked, a batch of B pairs is 2B rows, one sequence each, and most of each row is padding (59% of the bench's
DPO positions at --seq-len 512). Here, as TRL's padding-free DPO does, the sequences lie end to end: each is a
segment of a row (segment ids 1, 2, 3...; attention.py makes them a per-example mask, batching.model_inputs
counts positions from each segment's start), never crossing a row, and both sequences of a pair lie in the same
micro-batch, so each pair's loss is the one it has unpacked.

The pairs are placed once, as packing.py places SFT's examples once: the largest pairs first, each into the first
micro-batch (Bundle) where both its sequences fit, each best-fit into one of its R rows. The epochs shuffle the
micro-batches (EpochRows, seed + epoch), not the pairs: each epoch has the same count of steps, and a step is
a pure function of (seed, step), which exact resume needs. A micro-batch holds P pairs, up to S (the most any
holds): the chosen sequence of its j-th pair is sequence j and the rejected one S + j of 2S, so
`loss_reference` (2S,) and the view's output (2S, 7) keep one shape; the S - P slots left are fillers of
weight 0. Under --parallel data the R rows split over the n data shards, R / n each, as padded rows do, and the
2S outputs into n equal parts (S rounded up for it), each process feeding its own shards' (batching.Feed.part).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from finetune.data import batching, pair_batches


@dataclass
class Bundle:
    """One packed micro-batch: its pairs, and where each of their two sequences lies.

    pairs: (P,) int. The pairs' indices, in slot order.
    rows, starts: (P, 2) int. Each pair's chosen (column 0) and rejected (column 1) sequence: its row and first
        position.
    """

    pairs: np.ndarray
    rows: np.ndarray
    starts: np.ndarray


@dataclass
class Packed:
    """The training pairs packed: `arrays` (padded a sequence a row, as the reference pass and scoring read them)
    and the micro-batches that lay them `rows` rows of seq_len.

    slots: int. S, the most pairs a micro-batch holds: each micro-batch has 2S sequences.
    targets: (micro-batches, rows) int. The target positions each row of each micro-batch holds.
    """

    arrays: pair_batches.PairArrays
    rows: int
    bundles: list
    slots: int
    targets: np.ndarray

    @property
    def seq_len(self) -> int:
        return self.arrays.chosen["token_ids"].shape[1]

    @property
    def width(self) -> int:
        """Gathered-target slots per row, fed by one data shard: room for the targets of any micro-batch."""
        return self.width_for(1)

    def width_for(self, shards: int) -> int:
        """Gathered-target slots per row of a micro-batch split over `shards` data shards (--parallel data), R / n
        rows each: room for the targets of any shard's rows of any micro-batch, as batching.target_width."""
        per_shard = self.rows // shards
        most = int(self.targets.reshape(len(self.bundles), shards, per_shard).sum(2).max())
        return max(8, -(-most // (8 * per_shard)) * 8)

    def slots_for(self, shards: int) -> int:
        """S over `shards` data shards: the most pairs a micro-batch holds, rounded up so that its 2S sequences'
        outputs (and their sample weights) split evenly over the shards; the slots added are fillers."""
        step = shards // math.gcd(shards, 2)
        return -(-self.slots // step) * step

    def padding_fraction(self) -> float:
        """The share of the packed micro-batches' positions that hold no token."""
        tokens = pair_batches.sequence_lengths(self.arrays).sum()
        return float(1.0 - tokens / (len(self.bundles) * self.rows * self.seq_len))


def place(lengths: np.ndarray, rows: int, seq_len: int) -> list[Bundle]:
    """Bundles of `rows` rows of `seq_len` holding every pair once: the pairs by decreasing size (ties by index),
    each into the first bundle where its longer sequence and then its shorter one fit, each into the row it fills
    the most. Deterministic; vectorised over the bundles (15k pairs in about a second)."""
    count = len(lengths)
    free = np.zeros((count, rows), np.int64)  # each bundle's room per row, bundles as they open
    members: list[list[tuple[int, int, int, int, int]]] = []
    opened = 0
    for pair in sorted(range(count), key=lambda i: (-int(lengths[i].sum()), i)):
        longer = int(lengths[pair, 1] > lengths[pair, 0])
        a, b = int(lengths[pair, longer]), int(lengths[pair, 1 - longer])
        room = free[:opened]
        row_a = np.where(room >= a, room, seq_len + 1).argmin(1)
        after = room.copy()
        after[np.arange(opened), row_a] -= a
        row_b = np.where(after >= b, after, seq_len + 1).argmin(1)
        fits = (room.max(1, initial=0) >= a) & (after[np.arange(opened), row_b] >= b) if opened else np.zeros(0, bool)
        if fits.any():
            bundle = int(fits.argmax())
            ra, rb = int(row_a[bundle]), int(row_b[bundle])
        else:
            if a + b > seq_len and rows == 1:
                raise ValueError(f"a pair of {a + b} positions does not fit one row of {seq_len}")
            bundle, ra, rb = opened, 0, 0 if a + b <= seq_len else 1
            free[bundle] = seq_len
            members.append([])
            opened += 1
        start_a = seq_len - int(free[bundle, ra])
        free[bundle, ra] -= a
        start_b = seq_len - int(free[bundle, rb])
        free[bundle, rb] -= b
        places = [(ra, start_a), (rb, start_b)] if longer == 0 else [(rb, start_b), (ra, start_a)]
        members[bundle].append((pair, *places[0], *places[1]))
    bundles = []
    for held in members:
        table = np.array(held, np.int64)
        bundles.append(Bundle(table[:, 0], table[:, [1, 3]], table[:, [2, 4]]))
    return bundles


def pack(arrays: pair_batches.PairArrays, rows: int) -> Packed:
    """The pairs of `arrays` packed into micro-batches of `rows` rows (place), with the slots and target width
    that every one of them fits."""
    seq_len = arrays.chosen["token_ids"].shape[1]
    if rows * seq_len < 2:
        raise ValueError("a micro-batch needs room for a pair")
    bundles = place(pair_batches.sequence_lengths(arrays), rows, seq_len)
    targets = np.stack([(_side_targets(arrays, side) > 0).sum(1) for side in ("chosen", "rejected")], axis=1)
    per_row = np.zeros((len(bundles), rows), np.int64)  # each row's targets, in each micro-batch
    for index, bundle in enumerate(bundles):
        np.add.at(per_row[index], bundle.rows.ravel(), targets[bundle.pairs].ravel())
    return Packed(arrays, rows, bundles, max(len(b.pairs) for b in bundles), per_row)


def _side_targets(arrays: pair_batches.PairArrays, side: str) -> np.ndarray:
    return pair_batches._targets(arrays, side)


def inputs(packed: Packed, bundle: Bundle, feed: batching.Feed, real: bool = True, scale: float | None = None):
    """(x, labels, sample weights) of one packed micro-batch: `packed.rows` rows of its pairs' sequences, this
    process's part of them (feed.part, as pair_batches.inputs feeds it).

    Beside the model inputs and the gathered targets, as batching.inputs makes them, x carries `loss_sequence`
    (each target slot's sequence, 0..2S-1: the chosen of slot j is j, its rejected S + j), `loss_reference`
    (2S,) and, where the method takes the chosen sequences whole, `loss_answer`, as pair_batches.inputs does
    unpacked. The sample weights are (2S, len(COLUMNS)): 1 in column 0 of each of the bundle's pairs, 0 for the
    filler slots, and 0 everywhere where `real` is False (a filler micro-batch, a copy of a real one).

    Under --parallel data the R rows split into n data shards of R / n rows (each shard's loss positions index
    its own rows, batching.targets) and the 2S sequences' outputs into n equal parts (Packed.slots_for); a
    sequence's slot names it in the whole micro-batch, wherever its row lies, so each pair's loss is the one it
    has on one device.
    """
    arrays, rows, seq_len = packed.arrays, packed.rows, packed.seq_len
    first, end, shards = feed.part
    slots, width = packed.slots_for(shards), packed.width_for(shards)
    laid = {name: np.zeros((rows, seq_len), dtype) for name, dtype in
            (("token_ids", np.int32), ("segment_ids", np.int32), ("labels", np.int32), ("weights", np.float32),
             ("answers", np.float32), ("sequence", np.int32))}  # fmt: skip
    segments = np.zeros(rows, np.int32)
    for slot, pair in enumerate(bundle.pairs):
        for column, side in enumerate(("chosen", "rejected")):
            source = getattr(arrays, side)
            row, start = bundle.rows[slot, column], bundle.starts[slot, column]
            n = int(source["padding_mask"][pair].sum())
            where = (row, slice(start, start + n))
            segments[row] += 1
            laid["token_ids"][where] = source["token_ids"][pair, :n]
            laid["labels"][where] = source["labels"][pair, :n]
            laid["weights"][where] = _side_targets(arrays, side)[pair, :n] if real else 0
            laid["answers"][where] = source["weights"][pair, :n] if real else 0
            laid["segment_ids"][where] = segments[row]
            laid["sequence"][where] = slot + column * slots
    laid["padding_mask"] = laid["segment_ids"] > 0
    length = None
    if feed.length_step is not None:
        length = batching.batch_length(np.count_nonzero(laid["padding_mask"], axis=1), feed.length_step, seq_len)
    mine = batching.local(np.arange(rows), feed.part)  # this process's rows: its shards', R / n each
    x, _, _ = batching.inputs(laid, mine, end - first, width, length, feed.inputs)
    cut = length or seq_len
    per_shard = rows // shards
    # Each slot row's shard's first row in the micro-batch, plus the row its position indexes within the shard.
    shard_first = (first + np.arange(len(mine)) // per_shard) * per_shard
    row, column = shard_first[:, None] + x["loss_positions"] // cut, x["loss_positions"] % cut
    x["loss_sequence"] = laid["sequence"][row, column].astype(np.int32)
    if arrays.whole_chosen:  # the answers' slots among every target's
        x["loss_answer"] = (laid["answers"][row, column] > 0).astype(np.float32)
    outputs = batching.local(np.arange(2 * slots), feed.part)  # this process's part of the 2S sequences
    if arrays.whole_chosen:
        scale = pair_batches.nll_scale(arrays, bundle.pairs) if scale is None else scale  # the step's, in training
        x["loss_nll_scale"] = np.full(len(outputs), scale, np.float32)
    reference = np.zeros((2, slots), np.float32)
    reference[:, : len(bundle.pairs)] = arrays.reference[bundle.pairs].T
    x["loss_reference"] = reference.reshape(-1)[outputs]
    weights = np.zeros((2 * slots, len(pair_batches.COLUMNS)), np.float32)
    weights[: len(bundle.pairs), 0] = 1.0 if real else 0.0
    return x, np.zeros_like(weights[outputs]), weights[outputs]


class PackedPairOrder(batching.Order):
    """pair_batches.PairOrder for packed pairs: the micro-batches of every optimizer step, a pure function of
    (seed, step).

    Epoch e trains the micro-batches of permutation(seed + e), grad_accum at a time; the last step of an epoch is
    filled with weight-0 copies. Each real pair weighs grad_accum / (the step's real pairs): summed
    (objective.TokenShare) and averaged over the micro-batches (Keras' accumulation), the loss is the mean over
    the step's pairs, however many each micro-batch holds.
    """

    def __init__(self, packed: Packed, seed: int, feed: batching.Feed, grad_accum: int = 1):
        self.packed = packed
        self.arrays = packed.arrays
        self.batch_size = packed.rows
        """Rows per micro-batch: --batch-size, which counts rows when pairs are packed."""
        self.grad_accum = grad_accum
        self.seed = seed
        self.feed = feed
        self.width = packed.width_for(feed.part[2])
        self._bundles = batching.EpochRows(len(packed.bundles), grad_accum, seed)
        self.steps_per_epoch = self._bundles.steps_per_epoch

    def bundles(self, step: int) -> list[Bundle]:
        """The micro-batches optimizer step `step` trains: grad_accum, or fewer at an epoch's end."""
        return [self.packed.bundles[index] for index in self._bundles(step)]

    def rows(self, step: int) -> np.ndarray:
        """The pairs optimizer step `step` trains."""
        return np.concatenate([bundle.pairs for bundle in self.bundles(step)])

    def micro_batches(self, step: int) -> list:
        bundles = self.bundles(step)
        share = np.float32(self.grad_accum / sum(len(b.pairs) for b in bundles))
        out = []
        for micro in range(self.grad_accum):
            real = micro < len(bundles)
            x, labels, weights = inputs(self.packed, bundles[micro % len(bundles)], self.feed, real,
                                        pair_batches.nll_scale(self.arrays, self.rows(step)))  # fmt: skip
            out.append((x, labels, weights * share))
        return out

    def metric_weights(self, step: int) -> list[int]:
        """The real pairs of each of the step's micro-batches (PairOrder.metric_weights); a filler weighs 0."""
        held = [len(bundle.pairs) for bundle in self.bundles(step)]
        return held + [0] * (self.grad_accum - len(held))

    def tokens(self, step: int) -> tuple[int, int]:
        return pair_batches.tokens(self.arrays, self.rows(step))
