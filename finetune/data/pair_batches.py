"""Preference pairs in batches: B pairs are 2B rows, the chosen answers' then the rejected answers'.

Each pair (anything with `.chosen` and `.rejected` batching.Examples, weighted
1 on its answer) is padded to seq_len in two arrays, one per side. A batch
takes the same pairs from both, so row i and row B + i are one pair's, as TRL's
concatenated forward has them, and is cut to its longest row as SFT batches
are. Beside the model inputs and the gathered targets it carries
`loss_sequence` (each target slot's row) and `loss_reference` (each row's
reference log-probability), which model/pair_view.py reads.

Packed, the pairs' sequences lie end to end instead, R rows a micro-batch (pair_packing.py); held-out scoring and
DPO's reference pass keep these batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from finetune.data import batching

# What each column of a pair view's output holds (model/pair_view.py), for each pair: its loss, then TRL's metrics.
# The sample weights have as many columns, column 0 the loss's.
COLUMNS = ("loss", "rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin", "logps_chosen",
           "logps_rejected")  # fmt: skip
METRICS = COLUMNS[1:]


@dataclass
class PairArrays:
    """N pairs, padded: chosen and rejected as batching.pad makes them, and each side's reference log-probability.

    reference: (N, 2) float32, the chosen and rejected answers' summed log-probability under the base (DPO's);
        zeros until reference() fills it, and for the methods without one.
    whole_chosen: bool. Every token of the chosen sequences is a target too, prompt and answer (ORPO's NLL, as
        TRL's ORPOTrainer takes it); `loss_answer` then marks the answer's slots.
    packed: pair_packing.Packed, where the pairs train packed (its micro-batches); None where they train a
        sequence a row.
    """

    chosen: dict
    rejected: dict
    reference: np.ndarray
    whole_chosen: bool = False
    packed: object = None

    def __len__(self) -> int:
        return len(self.chosen["token_ids"])


def pad(pairs, seq_len: int, whole_chosen: bool = False) -> PairArrays:
    """The pairs' two sides, one sequence a row, right-padded. whole_chosen: see PairArrays."""
    chosen = batching.pad([p.chosen for p in pairs], seq_len)
    rejected = batching.pad([p.rejected for p in pairs], seq_len)
    return PairArrays(chosen, rejected, np.zeros((len(pairs), 2), np.float32), whole_chosen)


def subset(arrays: PairArrays, pairs: np.ndarray) -> PairArrays:
    """The pairs `pairs` (indices) of `arrays`, with their reference log-probabilities."""
    return PairArrays({key: value[pairs] for key, value in arrays.chosen.items()},
                      {key: value[pairs] for key, value in arrays.rejected.items()}, arrays.reference[pairs],
                      arrays.whole_chosen)  # fmt: skip


def _targets(arrays: PairArrays, side: str) -> np.ndarray:
    """Each row's target weights: its answer's, or every real token of a chosen row where whole_chosen."""
    rows = getattr(arrays, side)
    if side == "chosen" and arrays.whole_chosen:
        return rows["padding_mask"].astype(np.float32) * (1 - media_labels(rows))
    return rows["weights"]


def media_labels(rows) -> np.ndarray:
    """(rows, seq_len) float32, 1 where the target is a picture's or clip's soft token: the next position's input
    is one (vision_mask, audio_mask). A soft token is never a target, even of ORPO's every-token NLL."""
    soft = np.zeros(rows["padding_mask"].shape, np.float32)
    for key in ("vision_mask", "audio_mask"):
        if key in rows:
            soft[:, :-1] = np.maximum(soft[:, :-1], rows[key][:, 1:] != 0)
    return soft


def both_sides(arrays: PairArrays) -> dict:
    """The chosen rows and the rejected rows as one padded array set (for padding shares and token counts)."""
    return {key: np.concatenate([arrays.chosen[key], arrays.rejected[key]]) for key in arrays.chosen}


def target_width(arrays: PairArrays, pairs_per_batch: int, shards: int = 1) -> int:
    """Target slots per row: room for the answer tokens of any of a data shard's rows, a batch of `pairs_per_batch`
    pairs (2B rows) split over `shards`."""
    both = {"weights": np.concatenate([_targets(arrays, "chosen"), _targets(arrays, "rejected")])}
    return batching.target_width(both, 2 * pairs_per_batch // shards)


def tokens(arrays: PairArrays, pairs: np.ndarray) -> tuple[int, int]:
    """Non-padding input tokens of `pairs`, both sides, and the tokens their loss is taken on: the answers', and
    with them every token of the chosen sequences where whole_chosen (ORPO's NLL trains the prompts too)."""
    fed = sum(int(side["padding_mask"][pairs].sum()) for side in (arrays.chosen, arrays.rejected))
    return fed, int(sum(_targets(arrays, side)[pairs].sum() for side in ("chosen", "rejected")))


def nll_scale(arrays: PairArrays, pairs: np.ndarray) -> float:
    """ORPO's NLL weight of each chosen token, as a pair's share: `pairs`' count over their chosen sequences' tokens.
    Summed over a step's pairs at each pair's share (1 / its pairs), a pair's chosen tokens times this make the
    token mean over the step's chosen sequences, TRL's NLL over one batch, however the step is split."""
    return len(pairs) / max(float(_targets(arrays, "chosen")[pairs].sum()), 1.0)


def inputs(arrays: PairArrays, pairs: np.ndarray, width: int, feed: batching.Feed, real=None, scale=None):
    """(x, labels, sample weights) of the batch of `pairs` (indices): 2B rows, chosen then rejected, this process's
    part of them, fed as `feed` says (its length step, the model's inputs, this process's data shards).

    scale: float. nll_scale of the step's pairs (ORPO); None takes this batch's real pairs'.
    real: bool per pair; False marks a filler (a copy that fills the last batch of an epoch), whose tokens and
        weight are zeroed. The sample weights are (2B, len(COLUMNS)): 1 in column 0 of each real pair's row, the rest 0.
    feed.part: (first, end, n). The data shards of the 2B rows this process feeds. Each shard's
        loss positions index its own rows, as SFT's do (batching.targets); `loss_sequence` names each slot's row
        in the whole batch, which the view sums each answer's log-probability over.
    """
    length_step, names, part = feed.length_step, feed.inputs, feed.part
    real = np.ones(len(pairs), bool) if real is None else real
    rows = {key: np.concatenate([arrays.chosen[key][pairs], arrays.rejected[key][pairs]]) for key in arrays.chosen}
    both = np.concatenate([real, real])
    answers = np.where(both[:, None], rows["weights"], np.float32(0))
    targets = np.concatenate([_targets(arrays, "chosen")[pairs], _targets(arrays, "rejected")[pairs]])
    rows["weights"] = np.where(both[:, None], targets, np.float32(0))
    seq_len = rows["token_ids"].shape[1]
    length = None
    if length_step is not None:
        length = batching.batch_length(np.count_nonzero(rows["padding_mask"], axis=1), length_step, seq_len)
    first, end, shards = part
    local = batching.local(np.arange(2 * len(pairs)), part)
    x, labels, _ = batching.inputs(rows, local, end - first, width, length, names)
    if arrays.whole_chosen:  # the answers' slots among every target's, laid out as the targets are
        marked = batching.inputs({**rows, "labels": (answers > 0).astype(np.int32)}, local, end - first, width, length,
                                 names)[1]  # fmt: skip
        x["loss_answer"] = marked.astype(np.float32)
        scale = nll_scale(arrays, pairs[real]) if scale is None else scale
        x["loss_nll_scale"] = np.full(len(local), scale, np.float32)
    per_shard = 2 * len(pairs) // shards
    first_row = (first + np.arange(len(local)) // per_shard) * per_shard  # each slot row's shard, in the batch
    x["loss_sequence"] = (first_row[:, None] + x["loss_positions"] // (length or seq_len)).astype(np.int32)
    reference = arrays.reference[pairs]
    x["loss_reference"] = np.concatenate([reference[:, 0], reference[:, 1]])[local].astype(np.float32)
    weights = np.zeros((2 * len(pairs), len(COLUMNS)), np.float32)
    weights[: len(pairs), 0] = real
    return x, np.zeros_like(weights[local]), weights[local]


def sequence_lengths(arrays: PairArrays) -> np.ndarray:
    """(N, 2) int: each pair's chosen and rejected sequence's positions."""
    return np.stack([arrays.chosen["padding_mask"].sum(1), arrays.rejected["padding_mask"].sum(1)], axis=1)


class PairOrder(batching.Order):
    """batching.TrainOrder for pairs: the pairs of every optimizer step, a pure function of (seed, step).

    Epoch e trains the pairs of permutation(seed + e) (grouped by length with feed.grouped: batching.EpochRows),
    batch_size x grad_accum at a time; the last step of an
    epoch is filled with weight-0 copies. Each real pair weighs grad_accum / (the step's real pairs): summed
    (objective.TokenShare) and averaged over the micro-batches (Keras' accumulation), the loss is the mean over
    the step's pairs, as one batch of them all gives.
    """

    def __init__(self, arrays: PairArrays, batch_size: int, seed: int, feed: batching.Feed, grad_accum: int = 1):
        self.arrays = arrays
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.feed = feed
        longer = sequence_lengths(arrays).max(1) if feed.grouped else None  # what the pair's two rows are cut to
        self._rows = batching.EpochRows(len(arrays), batch_size * grad_accum, seed, longer)
        self.steps_per_epoch = self._rows.steps_per_epoch
        self.width = target_width(arrays, batch_size, feed.part[2])

    def rows(self, step: int) -> np.ndarray:
        """The pairs optimizer step `step` trains."""
        return self._rows(step)

    def micro_batches(self, step: int) -> list:
        pairs = self.rows(step)
        size = self.batch_size * self.grad_accum
        filled = np.concatenate([pairs, pairs[np.arange(size - len(pairs)) % len(pairs)]])
        real = np.arange(size) < len(pairs)
        share = np.float32(self.grad_accum / len(pairs))
        out = []
        for micro in range(self.grad_accum):
            group = slice(micro * self.batch_size, (micro + 1) * self.batch_size)
            x, labels, weights = inputs(self.arrays, filled[group], self.width, self.feed, real[group],
                                        nll_scale(self.arrays, pairs))  # fmt: skip
            out.append((x, labels, weights * share))
        return out

    def metric_weights(self, step: int) -> list[int]:
        """The real pairs of each of the step's micro-batches: the weight of its reported metrics (each a mean over
        its own real pairs, objective.ColumnMean) in the step's mean. A micro-batch of filler pairs alone reports 0s, which
        weigh nothing."""
        real = len(self.rows(step))
        return [min(max(real - micro * self.batch_size, 0), self.batch_size) for micro in range(self.grad_accum)]

    def tokens(self, step: int) -> tuple[int, int]:
        return tokens(self.arrays, self.rows(step))


@dataclass
class Batches:
    """Every pair of `arrays` once, in order, batch_size at a time, the last filled with weight-0 copies: for
    scoring and the reference pass. Iterating gives (pair indices, (x, labels, weights))."""

    arrays: PairArrays
    batch_size: int
    feed: batching.Feed

    @property
    def rows(self) -> int:
        """The pairs (as batching.Batches' rows, which the run's log counts)."""
        return len(self.arrays)

    def __iter__(self):
        arrays, size = self.arrays, self.batch_size
        width = target_width(arrays, size, self.feed.part[2])
        for start in range(0, len(arrays), size):
            pairs = np.arange(start, min(start + size, len(arrays)))
            real = np.arange(size) < len(pairs)
            filled = np.concatenate([pairs, np.arange(size - len(pairs)) % len(arrays)])
            yield pairs, inputs(arrays, filled, width, self.feed, real)
