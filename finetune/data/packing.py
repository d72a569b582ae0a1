"""Pack several examples into each row: best-fit decreasing, exact per example.

Dolly-style records fill about 41% of a 512-token row, so most of a padded
step is padding. Packing puts several examples in one row, each a contiguous
segment with its own id (1, 2, 3...; 0 is padding). Labels are shifted inside
each example, so no target crosses into the next one, and attention.py keeps
each example from attending to the others: every example gets the loss it
would get alone in a row of its own.
"""

from __future__ import annotations

import bisect

import numpy as np


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, no bin over `capacity`; longest items first, each into the fullest bin it fits.

    Deterministic (ties by index), and O(n log n) lookups: fast enough for Dolly's 15k records.
    """
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin index), sorted
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = lengths[item]
        k = bisect.bisect_left(free, (size, -1))
        if k < len(free):
            space, b = free.pop(k)
        else:
            space, b = capacity, len(bins)
            bins.append([])
        bins[b].append(item)
        if space - size > 0:
            bisect.insort(free, (space - size, b))
    return bins


def pack(examples, seq_len: int) -> dict[str, np.ndarray]:
    """Examples packed into rows of `seq_len`: the arrays batching.pad makes, with segment ids 1, 2, 3...

    An example of n ids fills n - 1 positions: inputs ids[:-1], targets ids[1:].
    """
    lengths = [len(e.token_ids) - 1 for e in examples]
    bins = best_fit_decreasing(lengths, seq_len)
    ids = np.zeros((len(bins), seq_len), np.int32)
    labels = np.zeros((len(bins), seq_len), np.int32)
    weights = np.zeros((len(bins), seq_len), np.float32)
    segments = np.zeros((len(bins), seq_len), np.int32)
    for row, members in enumerate(bins):
        start = 0
        for segment, index in enumerate(members, start=1):
            example, n = examples[index], lengths[index]
            ids[row, start : start + n] = example.token_ids[:-1]
            labels[row, start : start + n] = example.token_ids[1:]
            weights[row, start : start + n] = example.weights[1:]
            segments[row, start : start + n] = segment
            start += n
    return {
        "token_ids": ids,
        "padding_mask": segments > 0,
        "segment_ids": segments,
        "labels": labels,
        "weights": weights,
    }


def padding_fraction(arrays) -> float:
    """The share of row positions that hold no token."""
    present = arrays["padding_mask"]
    return float(1.0 - present.sum() / present.size) if present.size else 0.0
