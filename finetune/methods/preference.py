"""Preference tuning: DPO, IPO, ORPO and SimPO, on pairs of a chosen and a rejected answer to one prompt.

Records become Pairs (data/pairs.py): two Examples that begin with the same
prompt ids, weighted on their answers. A batch of B pairs is 2B rows
(data/pair_batches.py), and model/pair_view.py turns each row's answer
log-probability into the pair's loss with the method's `loss` below. The
constants and their defaults are TRL's where TRL has the method
(docs/preference.md, "Losses and defaults").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from finetune.data import audio, batching, images, packing, pair_batches, pair_packing, pairs, templates
from finetune.methods import prepare
from finetune.methods.method import Method
from finetune.platform.errors import UserError

COLUMNS, METRICS = pair_batches.COLUMNS, pair_batches.METRICS  # the pair view's output, and TRL's metrics


TRAITS = ("averaged", "needs_reference", "whole_chosen")


class Preference(Method):
    """A preference method: its loss, its constants' defaults, and whether it needs the base's log-probabilities.

    loss: callable(chosen, rejected, reference, count, objective) -> (loss, rewards), in keras ops: see
        model/pair_view.Objective.
    averaged: bool. The answers' log-probabilities are per token (ORPO, SimPO), else summed.
    needs_reference: bool. Scored against the base, once, before training (DPO, IPO).
    whole_chosen: bool. The loss takes the NLL of the chosen sequences' every token, prompt and answer (ORPO).
    """

    paired = True
    sequences_per_example = 2
    held_out = held_out_history = ("reward_accuracy", "reward_margin")
    examples = "pairs"
    why = "set"  # --method is how a preference method is chosen

    def __init__(self, name: str, title: str, loss, defaults: dict, traits: tuple = ()):
        """traits: of "averaged", "needs_reference" and "whole_chosen", the ones this method has (each above)."""
        self.name, self.title, self.loss, self.defaults = name, title, loss, defaults
        self.averaged, self.needs_reference, self.whole_chosen = (t in traits for t in TRAITS)

    def objective(self, train):
        from finetune.model import pair_view  # keras: imported once the backend is chosen

        # Each constant as decided, or its default where `train` leaves it unset (the bench's TrainConfig()).
        given = {name: getattr(train, name, None) for name in self.defaults}
        value = {name: default if given[name] is None else given[name] for name, (default, _) in self.defaults.items()}
        return pair_view.Objective(self.name, self.loss, value["beta"], value.get("label_smoothing", 0.0),
                                   value.get("simpo_gamma", 0.0), self.averaged, self.needs_reference,
                                   self.whole_chosen)  # fmt: skip

    # === Prepare ===

    def prepare(self, records, preprocessor, cfg, *, packed=None, probe=None, every_record_of=None):
        """records -> template -> a chosen and a rejected Example each -> split -> pairs padded a side to a row, and
        packed where `packed` (pair_packing.py). The batch size counts pairs, or rows where packed."""
        seq_len = cfg.model.seq_len
        template = templates.get(cfg.data.template)
        tokenizer = prepare.tokenizer_of(preprocessor)
        prepare.check_seq_len(tokenizer, template, seq_len)
        usable = pair_examples(records, template, preprocessor, cfg, every_record_of or cfg.data.path)
        batch_size, why = cfg.train.batch_size, None
        if batch_size == "auto":
            batch_size, why = self._probe(usable, seq_len, bool(packed), probe, cfg.train.grad_accum)
        train, held_out = prepare.split(usable, cfg, every_record_of)
        held_out_rows = self.pad([p for _, p in held_out], seq_len)
        prepared = prepare.Prepared(template, train, held_out, batch_size, held_out_rows, packed=bool(packed))
        prepared.batch_size_why = why
        if packed is not None:
            prepared.rows = self.pad([p for _, p in train], seq_len)
            share = packing.padding_fraction(pair_batches.both_sides(prepared.rows))
            prepared.padding = {"padding_fraction": share, "unpacked": share}
            if packed and batch_size == 1 and cfg.data.packing == "auto" and _longest_pair(prepared.rows) > seq_len:
                print(f"note: packing off: a pair is longer than one row of --seq-len {seq_len}, and --batch-size 1 "
                      "packs a micro-batch of one row")  # fmt: skip
                packed = prepared.packed = False
            if packed:
                prepared.rows.packed = _packed(prepared.rows, batch_size, seq_len)
                prepared.padding["padding_fraction"] = prepared.rows.packed.padding_fraction()
                print(f"packing: {len(train)} pairs in {len(prepared.rows.packed.bundles)} micro-batches of "
                      f"{batch_size} rows of {seq_len} tokens (--batch-size counts rows), each sequence a segment; "
                      f"padding {share:.0%} -> {prepared.padding['padding_fraction']:.0%}")  # fmt: skip
            elif len(train) < batch_size:
                raise UserError(f"{len(train)} training pairs are fewer than one batch of {batch_size}; lower "
                                "--batch-size or add pairs")  # fmt: skip
        return prepared

    def _probe(self, usable, seq_len: int, packed: bool, probe, grad_accum: int) -> tuple[int, str]:
        """--batch-size auto: trial steps on the first pairs, as SFT probes its rows: batches of 2B rows, or
        packed micro-batches of B rows (the first, of the longest pairs)."""
        trial = self.pad([p for _, p in usable[:64]], seq_len)

        def batch_of(size, names):
            feed = batching.Feed(inputs=names)
            fits = pair_batches.sequence_lengths(trial).sum(1) <= size * seq_len  # a pair in one micro-batch
            if packed and fits.any():
                laid = pair_packing.pack(pair_batches.subset(trial, np.flatnonzero(fits)), size)
                return pair_packing.inputs(laid, laid.bundles[0], feed)
            return pair_batches.inputs(trial, np.arange(size), pair_batches.target_width(trial, size), feed)

        if packed:  # the rows all the pairs' sequences fill, packed
            every = self.pad([p for _, p in usable], seq_len)
            lengths = pair_batches.sequence_lengths(every).ravel().tolist()
            entries = len(packing.best_fit_decreasing(lengths, seq_len))
        else:
            entries = len(usable)
        # With --grad-accum K a step takes K micro-batches: the probe sizes one, for steps enough of K.
        batch_size, why = probe(batch_of, entries // grad_accum)
        print(f"batch size auto: {batch_size} {'rows' if packed else 'pairs'} ({why})")
        return batch_size, why

    def evaluated_on(self, prepared, records, preprocessor, cfg):
        seq_len = cfg.model.seq_len
        prepared.held_out = pair_examples(records, prepared.template, preprocessor, cfg, cfg.eval.data)
        prepared.held_out_rows = self.pad([p for _, p in prepared.held_out], seq_len)
        return prepared

    def pad(self, pairs, seq_len: int):
        """The pairs padded as this method's view reads them (pair_batches.pad)."""
        return pair_batches.pad(pairs, seq_len, self.whole_chosen)

    def order(self, prepared, cfg, feed, model=None):
        if prepared.packed:
            return pair_packing.PackedPairOrder(prepared.rows.packed, cfg.train.seed, feed, cfg.train.grad_accum)
        return pair_batches.PairOrder(prepared.rows, prepared.batch_size, cfg.train.seed, feed, cfg.train.grad_accum)

    # === Score ===

    def held_out_scores(self, model, rows, batch_size: int, feed, shards: int = 1):
        # Scored by the training view itself, in inference mode.
        batches = pair_batches.Batches(rows, batch_size, feed)
        return lambda after_batch=None: pair_metrics(model.trainer, batches, after_batch)

    def scores_base(self, train) -> bool:
        return self.needs_reference

    def reference(self, trainer, sets: dict, batch_size: int, feed, saved: dict | None, phase) -> dict | None:
        """DPO's reference log-probabilities of every training and held-out pair: scored once by a fresh run,
        before training, or read back from the checkpoint a resumed run continues from."""
        if not self.needs_reference:
            return None
        if saved is not None:
            for name, arrays in sets.items():
                arrays.reference[:] = np.asarray(saved[name], np.float32).reshape(-1, 2)
            return saved
        from finetune.model import builder

        phase(f"scoring the reference: {sum(map(len, sets.values()))} pairs under the base, once")
        # The base itself, LoRA switched off (PEFT's disable_adapter, as TRL takes its reference), as `finetune
        # eval` scores it: a fresh adapter is the base's function, but not its bits in bfloat16 (DoRA's path).
        # A view of its own, as the trainer's compiled call would keep the LoRA state it was traced with.
        with builder.lora_off(trainer.lm):
            view = builder.objective_view(trainer.lm, trainer.objective, trainer.shards)
            for arrays in sets.values():
                reference_logps(view, pair_batches.Batches(arrays, batch_size, feed), phase.guarded)
        return {name: arrays.reference.tolist() for name, arrays in sets.items()}

    def evaluate(self, lm, cfg, rows, directory=None) -> dict:
        """The held-out metrics of the adapted `lm`; DPO's reference scored first with LoRA switched off (the
        base, as the run scored it before training)."""
        from finetune.model import builder

        objective = self.objective(cfg.train)
        batches = pair_batches.Batches(rows, cfg.train.batch_size, batching.Feed(inputs=builder.input_names(lm)))
        if self.needs_reference:
            with builder.lora_off(lm):  # a view of its own: a compiled call keeps the LoRA state it was traced with
                reference_logps(builder.objective_view(lm, objective), batches)
        return pair_metrics(builder.objective_view(lm, objective), batches)

    def run_metrics(self, train, rows: list) -> dict:
        last = next((row for row in reversed(rows) if "rewards_chosen" in row), {})
        return {**super().run_metrics(train, rows), **{name: last.get(name) for name in METRICS}}

    # === Plan ===

    def plan_note(self, cfg, packed: bool = False) -> str | None:
        reference = (
            f" ({self.title}'s reference is 8 bytes a pair, scored once: no second base)"
            if self.needs_reference
            else ""
        )
        if packed:
            return (f"--method {self.name} packed: --batch-size counts rows of --seq-len, whole pairs laid in them, so "
                    f"the activations are an SFT batch's of as many rows{reference}")  # fmt: skip
        return (f"--method {self.name}: each of the batch's pairs is two sequences, so the activations are twice an "
                f"SFT batch's{reference}")  # fmt: skip


def _longest_pair(arrays) -> int:
    """The positions of the longest pair's two sequences together: what a packed micro-batch of one row holds."""
    return int(pair_batches.sequence_lengths(arrays).sum(1).max())


def _packed(arrays, rows: int, seq_len: int):
    """The training pairs packed into micro-batches of `rows` rows; refuses a pair one micro-batch cannot hold."""
    if rows == 1 and _longest_pair(arrays) > seq_len:
        raise UserError(f"a pair of {_longest_pair(arrays)} tokens does not fit one row of --seq-len {seq_len}, "
                        "and packed pairs keep both sequences in one micro-batch of --batch-size rows; pass "
                        "--batch-size 2 or more, or --packing off")  # fmt: skip
    return pair_packing.pack(arrays, rows)


def cuts_its_media(record, pair: pairs.Pair) -> bool:
    """Whether fitting the pair to seq_len cut its prompt, which holds pictures or clips: the cut would take some of
    their soft tokens, so the pair is skipped (pair_examples; `finetune data` counts them)."""
    return pair.prompt_cut and bool(record.images or record.audios)


def pair_examples(records, template, preprocessor, cfg, source: str = "") -> list:
    """(record, pairs.Pair) of each preference record; says how many were cut to seq_len.

    Pictures and audio clips, in the prompt (both answers follow it), are written as the family's tokens and
    attached to both sides, as SFT's examples are (prepare.Media). A pair with them whose prompt would be cut from
    its left is skipped instead: the cut would take some of their tokens. So is a pair whose answers the cut left
    the same tokens: it has no preference to learn (a loss of ln 2 and no gradient, in DPO), and a held-out one
    would score the same before and after.
    """
    seq_len = cfg.model.seq_len
    media = prepare.Media.of(records, preprocessor, cfg.model.preset, source)
    for record in records if media is not None else ():
        for answer in (record.response, record.rejected) if record.images or record.audios else ():
            if images.PLACEHOLDER in answer or audio.PLACEHOLDER in answer:
                raise UserError(f"{record.where or source}: a pair's pictures and audio clips go in its prompt, "
                                "which both answers follow; this one has a placeholder in an answer")  # fmt: skip
    written = template if media is None else media.written(template)
    made, _ = pairs.pairs(records, written, prepare.tokenizer_of(preprocessor), seq_len)
    kept = [(r, p) for r, p in zip(records, made) if not cuts_its_media(r, p)]
    skipped = len(made) - len(kept)
    alike = [(r, p) for r, p in kept if p.alike]
    if alike:
        kept = [(r, p) for r, p in kept if not p.alike]
        print(f"note: {len(alike)} pairs skipped: cut to --seq-len {seq_len}, their chosen and rejected answers are "
              f"the same tokens (the first: {alike[0][0].where or source}); raise --seq-len to keep them")  # fmt: skip
    if not kept:
        raise UserError(f"no usable pairs in {source}: the prompts with pictures or audio fill --seq-len {seq_len} "
                        "with their answers, or the cut leaves both answers the same; raise --seq-len")  # fmt: skip
    if skipped:
        print(f"note: {skipped} pairs with pictures or audio skipped: their prompt and answer do not fit --seq-len "
              f"{seq_len}, and cutting the prompt would cut its image or audio tokens")  # fmt: skip
    cut = sum(p.cut for _, p in kept)
    if cut:  # the pairs kept: those skipped are counted above
        print(f"note: {cut} of {len(made)} pairs cut to --seq-len {seq_len}: the prompt from its left (keeping at "
              "least half the sequence), then the answers at their end")  # fmt: skip
    if media is None:
        return kept
    return [(r, dataclasses.replace(p, chosen=media.attached(p.chosen, r), rejected=media.attached(p.rejected, r)))
            for r, p in kept]  # fmt: skip


# === Scoring pairs ===


def pair_outputs(view, batches):
    """(pair indices, the view's (pairs, 7) output) of each of `batches` (pair_batches.Batches), with the view in
    inference mode: each pair's loss and metrics (COLUMNS)."""
    import keras

    from finetune.model import distribution

    # TensorFlow's predict function relaxes the target width to unknown once it sees a second one (the held-out
    # pairs' after the training pairs'), which the loss's chunks cannot take: there the view is called as it is.
    eager = keras.config.backend() == "tensorflow"
    for indices, (x, _, _) in batches:
        # distribution.predicted: in a job of several processes, x is this process's part of the batch
        values = keras.ops.convert_to_numpy(view(x, training=False)) if eager else distribution.predicted(view, x)
        yield indices, np.asarray(values, np.float64)[: len(indices)]


def pair_metrics(view, batches, after_batch=None) -> dict:
    """The mean of each COLUMNS over the held-out pairs (reward_accuracy and reward_margin among them)."""
    total, count = 0.0, 0
    for indices, values in pair_outputs(view, batches):
        total, count = total + values.sum(axis=0), count + len(indices)
        if after_batch is not None:  # a run's stop check (loop.check_stop)
            after_batch()
    return {name: float(value) for name, value in zip(COLUMNS, total / max(count, 1))}


def reference_logps(view, batches, guard=iter) -> None:
    """DPO's reference pass: each pair's chosen and rejected log-probability under the model as `view` sees it
    (the base: LoRA switched off), into arrays.reference; in the run's precision, in inference mode."""
    reference = batches.arrays.reference
    reference[:] = 0.0  # the view subtracts the reference: zeros leave the policy's own log-probabilities
    for indices, values in pair_outputs(view, guard(batches)):  # guard: a run's stop between batches (Phases)
        reference[indices] = values[:, 5:7]


# === The losses: each (chosen, rejected, reference, count, objective, nll) -> (loss, (reward chosen, reward rejected))


def dpo_loss(chosen, rejected, reference, count, objective, nll=None):
    """DPO's sigmoid loss on the log-ratio margin, with label smoothing (cDPO) as TRL's loss_type sigmoid."""
    from keras import ops

    half = chosen.shape[0]
    chosen_ratio, rejected_ratio = chosen - reference[:half], rejected - reference[half:]
    logits = objective.beta * (chosen_ratio - rejected_ratio)
    eps = objective.label_smoothing
    loss = -(1.0 - eps) * ops.log_sigmoid(logits) - eps * ops.log_sigmoid(-logits)
    return loss, (objective.beta * chosen_ratio, objective.beta * rejected_ratio)


def ipo_loss(chosen, rejected, reference, count, objective, nll=None):
    """TRL's IPO: the log ratios per answer token, squared against 1 / (2 tau)."""
    from keras import ops

    half = chosen.shape[0]
    ratios = (ops.concatenate([chosen, rejected]) - reference) / ops.maximum(count, 1.0)
    loss = ops.square(ratios[:half] - ratios[half:] - 1.0 / (2.0 * objective.beta))
    return loss, (objective.beta * (chosen - reference[:half]), objective.beta * (rejected - reference[half:]))


def orpo_loss(chosen, rejected, reference, count, objective, nll=None):
    """ORPO: the chosen sequences' NLL plus lambda times the log odds ratio's loss, of the two answers' average token
    probabilities: log(p / (1 - p)) of each, subtracted. The NLL is TRL's: the mean cross-entropy of every token
    of the step's chosen sequences, prompt and answer (Objective.whole_chosen): each pair carries its chosen tokens'
    share of it (pair_batches.nll_scale), so the step's mean is TRL's token mean however the step is split."""
    from keras import ops

    # A filler pair (count 0) has a mean log-probability of 0: log(1 - 1) is -inf, and its zero weight times the
    # NaN it makes is still NaN, in the loss and in the gradient. Its rows read -1 instead, before the log, so
    # neither path ever sees the infinity, and its loss is an exact 0.
    half = chosen.shape[0]
    real = ops.logical_and(count[:half] > 0, count[half:] > 0)
    chosen, rejected = ops.where(real, chosen, -1.0), ops.where(real, rejected, -1.0)
    log_odds = (chosen - rejected) - (ops.log1p(-ops.exp(chosen)) - ops.log1p(-ops.exp(rejected)))
    loss = ops.where(real, nll - objective.beta * ops.log_sigmoid(log_odds), 0.0)
    return loss, (objective.beta * chosen, objective.beta * rejected)


def simpo_loss(chosen, rejected, reference, count, objective, nll=None):
    """SimPO: the sigmoid loss on the length-averaged margin, less the target margin gamma."""
    from keras import ops

    loss = -ops.log_sigmoid(objective.beta * (chosen - rejected) - objective.gamma)
    return loss, (objective.beta * chosen, objective.beta * rejected)


DPO = Preference("dpo", "DPO", dpo_loss, traits=("needs_reference",), defaults={
    "beta": (0.1, "DPO's beta, as TRL's DPOConfig (the DPO paper's 0.1 to 0.5, at its low end)"),
    "label_smoothing": (0.0, "none asked"),
})  # fmt: skip
IPO = Preference("ipo", "IPO", ipo_loss, traits=("needs_reference",), defaults={
    "beta": (0.1, "IPO's tau, as TRL's DPOConfig's beta for loss_type ipo"),
})  # fmt: skip
ORPO = Preference("orpo", "ORPO", orpo_loss, traits=("averaged", "whole_chosen"), defaults={
    "beta": (0.1, "ORPO's lambda, as TRL's ORPOConfig's beta (the ORPO paper's 0.1)"),
})  # fmt: skip
SIMPO = Preference("simpo", "SimPO", simpo_loss, traits=("averaged",), defaults={
    "beta": (2.0, "SimPO's beta, as the SimPO paper (2.0 to 2.5; TRL's CPOConfig's 0.1 is CPO's)"),
    "simpo_gamma": (0.5, "SimPO's target margin, as TRL's CPOConfig's simpo_gamma"),
})  # fmt: skip
