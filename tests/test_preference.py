"""The preference methods' losses (methods/preference.py, trained through model/pair_view.py) on pairs laid out
as data/pair_batches.py lays them out.

Each is checked against the same quantities computed another way: every row's log-probability from the
causal LM's full logits, the losses written out in numpy from their papers.
"""

from dataclasses import dataclass

import keras
import numpy as np
import pytest
from conftest import float32_policy, forward, lora_model

from finetune.config import TrainConfig
from finetune.data import batching, pair_batches, pair_packing
from finetune.methods import preference, registry
from finetune.model import builder, objective, pair_view, presets


@dataclass
class Pair:
    chosen: batching.Example
    rejected: batching.Example


def tiny_pairs(n=6, seq_len=48):
    """Pairs whose chosen answer counts things and whose rejected answer does not; prompts and lengths vary."""
    tokenizer = presets.tiny_tokenizer()
    prompts = [f"Instruction:\nName {i} things.\n\nResponse:\n" for i in range(n)]
    chosen, _ = batching.tokenize([(p, "thing " * (i % 3 + 1)) for i, p in enumerate(prompts)], tokenizer, seq_len)
    rejected, _ = batching.tokenize([(p, "no " * (i % 4 + 2)) for i, p in enumerate(prompts)], tokenizer, seq_len)
    return [Pair(c, r) for c, r in zip(chosen, rejected)]


def full_logps(lm, arrays, pairs, whole=False):
    """Each pair's (chosen, rejected) summed log-probability and answer length, from the LM's full logits; whole:
    of every token, prompt and answer."""
    out = []
    for side in (arrays.chosen, arrays.rejected):
        side = {**side, "weights": side["padding_mask"].astype(np.float32)} if whole else side
        logits = forward(lm, {"token_ids": side["token_ids"][pairs], "padding_mask": side["padding_mask"][pairs]})
        logits = logits.astype(np.float64)
        logits = logits - logits.max(-1, keepdims=True)
        log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        picked = np.take_along_axis(log_softmax, side["labels"][pairs][..., None], -1)[..., 0]
        out.append(((picked * side["weights"][pairs]).sum(1), side["weights"][pairs].sum(1)))
    return out


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def expected_losses(method, beta, chosen, rejected, reference=(0.0, 0.0), smoothing=0.0, gamma=0.0, whole=None):
    (c, nc), (r, nr) = chosen, rejected
    if method == "ipo":
        return (((c - reference[0]) / nc - (r - reference[1]) / nr) - 1 / (2 * beta)) ** 2
    if method == "dpo":
        logits = beta * ((c - reference[0]) - (r - reference[1]))
        return -(1 - smoothing) * log_sigmoid(logits) - smoothing * log_sigmoid(-logits)
    c, r = c / nc, r / nr
    if method == "orpo":
        log_odds = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
        # TRL's NLL, every token of the batch's chosen sequences, a mean over them: each pair carries its chosen
        # tokens' share of it, so the pairs' mean loss is TRL's batch loss.
        nll = -whole[0] * len(whole[0]) / whole[1].sum()
        return nll - beta * log_sigmoid(log_odds)
    return -log_sigmoid(beta * (c - r) - gamma)


def objective_of(method: str, **constants):
    """The method's objective with its default constants, but those given (TrainConfig's names)."""
    return registry.get(method).objective(TrainConfig(method=method, **constants))


OBJECTIVES = {
    "dpo": objective_of("dpo", label_smoothing=0.1),
    "orpo": objective_of("orpo"),
    "ipo": objective_of("ipo"),
    "simpo": objective_of("simpo"),
}


@pytest.mark.parametrize("method", ["dpo", "ipo", "orpo", "simpo"])
def test_each_pair_s_loss_is_its_paper_s_on_the_full_logits(method):
    """Four pairs of different lengths (padding slots, a filler pair): per-pair loss and log-probabilities."""
    with float32_policy():
        lm, _ = lora_model()
        objective = OBJECTIVES[method]
        arrays = pair_batches.pad(tiny_pairs(), 48, objective.whole_chosen)
        arrays.reference[:] = np.array([[-3.0, -5.0]])  # any reference: DPO subtracts it
        view = pair_view.PreferenceView(lm, 8, objective)
        pairs = np.array([0, 3, 4, 4])
        real = np.array([True, True, True, False])
        feed = batching.Feed(length_step=16, inputs=builder.input_names(lm))
        width = pair_batches.target_width(arrays, 4)
        x, _, weights = pair_batches.inputs(arrays, pairs, width, feed, real)
        got = forward(view, x)
        chosen, rejected = full_logps(lm, arrays, pairs[:3])
        whole = full_logps(lm, arrays, pairs[:3], whole=True)[0]
        expected = expected_losses(method, objective.beta, chosen, rejected, (-3.0, -5.0), objective.label_smoothing,
                                   objective.gamma, whole)  # fmt: skip
        np.testing.assert_allclose(got[:3, 0], expected, rtol=1e-5, atol=1e-6)
        per_token = method in ("orpo", "simpo")
        np.testing.assert_allclose(got[:3, 5], chosen[0] / chosen[1] if per_token else chosen[0], rtol=1e-5)
        np.testing.assert_allclose(got[:3, 6], rejected[0] / rejected[1] if per_token else rejected[0], rtol=1e-5)
        assert np.all(got[4:] == 0) and weights[:, 0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


def lora_values(lm):
    return np.concatenate([keras.ops.convert_to_numpy(v).ravel() for v in lm.trainable_variables])


def test_dpo_starts_at_ln2_and_grad_accum_is_exact():
    """With the reference the fresh model's own (LoRA's B is zero), every pair's DPO loss is ln 2; a step of 3 pairs
    and a step of 2 x 2 micro-batches (a filler pair in the last) move LoRA alike under SGD; the metrics are
    reported."""
    with float32_policy():
        results = []
        for batch_size, accum in ((3, 1), (2, 2)):
            lm, _ = lora_model()
            feed = batching.Feed(inputs=builder.input_names(lm))
            arrays = pair_batches.pad(tiny_pairs(3), 48)
            trainer = pair_view.PreferenceView(lm, 8, objective_of("dpo"))
            sgd = keras.optimizers.SGD(0.5, gradient_accumulation_steps=accum if accum > 1 else None)
            trainer.compile(optimizer=sgd, loss=objective.TokenShare(), weighted_metrics=pair_view.metrics())
            for pairs, (x, _, _) in pair_batches.Batches(arrays, 4, feed):
                arrays.reference[pairs] = trainer.predict_on_batch(x)[: len(pairs), 5:7]
            before = lora_values(lm)
            order = pair_batches.PairOrder(arrays, batch_size, 0, feed, accum)
            logs = [trainer.train_on_batch(x, y, sample_weight=w, return_dict=True) for x, y, w in
                    order.micro_batches(0)]  # fmt: skip
            results.append((lora_values(lm) - before, logs))
        (one, logs_one), (accumulated, _) = results
        assert logs_one[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)
        # The rewards are 0 to rounding (the training step is compiled apart from the reference pass on JAX).
        assert logs_one[0]["rewards_chosen"] == pytest.approx(0, abs=1e-5)
        assert logs_one[0]["reward_margin"] == pytest.approx(0, abs=1e-5)
        assert set(preference.METRICS) <= set(logs_one[0])
        assert np.abs(one).max() > 0
        np.testing.assert_allclose(accumulated, one, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("dora", [False, True])
def test_a_fresh_adapter_scores_as_the_base_with_lora_switched_off(dora):
    """Why DPO's reference pass needs no second model: LoRA's B starts at zero and DoRA's magnitudes at the weights'
    norms, so a fresh run's log-probabilities are the base's (builder.lora_off), to float32 rounding."""
    from finetune.config import LoraConfig
    from finetune.platform import backend

    with float32_policy():
        backend.set_seed(0)
        lm, _ = builder.build(presets.Source("tiny", "tiny", "gemma"), 48, "float32")
        builder.enable_lora(lm, LoraConfig(rank=2, targets=["query", "value", "ffw_linear"], dora=dora), seed=0)
        arrays = pair_batches.pad(tiny_pairs(4), 48)
        batches = pair_batches.Batches(arrays, 4, batching.Feed(inputs=builder.input_names(lm)))
        objective_ = objective_of("dpo")
        ((_, fresh),) = preference.pair_outputs(builder.objective_view(lm, objective_), batches)
        with builder.lora_off(lm):
            ((_, base),) = preference.pair_outputs(builder.objective_view(lm, objective_), batches)
        np.testing.assert_allclose(fresh[:, 5:7], base[:, 5:7], rtol=1e-6, atol=1e-5)
        lm.trainable_variables[1].assign(np.ones(lm.trainable_variables[1].shape))  # an adapter that is not fresh
        ((_, moved),) = preference.pair_outputs(builder.objective_view(lm, objective_), batches)
        assert np.abs(moved[:, 5:7] - base[:, 5:7]).max() > 1e-3


def test_the_reference_keeps_float32_in_a_bfloat16_run():
    """keras casts a view's float inputs to the compute dtype: the reference log-probabilities (sums over an answer)
    lost up to 0.5 nats in bfloat16, and a fresh DPO run scored 0.696, not ln 2. They stay float32 now."""
    import keras

    before = keras.config.dtype_policy()
    try:
        lm, _ = lora_model("bfloat16")
        feed = batching.Feed(inputs=builder.input_names(lm))
        tokenizer = presets.tiny_tokenizer()
        long = [(f"Instruction:\nWrite {i}.\n\nResponse:\n", "word " * (20 + i)) for i in range(4)]
        sides = [batching.tokenize(long, tokenizer, 64)[0], batching.tokenize(long[::-1], tokenizer, 64)[0]]
        arrays = pair_batches.pad([Pair(c, r) for c, r in zip(*sides)], 64)
        view = builder.objective_view(lm, objective_of("dpo"))
        batches = pair_batches.Batches(arrays, 4, feed)
        preference.reference_logps(view, batches)
        assert np.abs(arrays.reference).max() > 20  # sums large enough for bfloat16 to round away a tenth
        scored = preference.pair_metrics(view, batches)
        assert scored["loss"] == pytest.approx(np.log(2), abs=1e-5)
        # the trackers log these names: reward accuracy once, not again as `accuracy`
        assert set(scored) == set(preference.COLUMNS) and "accuracy" not in scored
    finally:
        keras.config.set_dtype_policy(before)


def test_a_step_s_metrics_are_means_over_its_real_pairs_when_a_micro_batch_is_all_filler():
    """6 pairs, batch 2, --grad-accum 2: the epoch's second step holds 2 pairs, so its second micro-batch is filler
    alone and reports 0s. Weighed equally, it halved the step's rewards_chosen and reward_accuracy; the step's
    metrics are the means over its 2 real pairs, as TRL's (computed here from the view's own per-pair output)."""
    import os

    from finetune.training import loop

    with float32_policy():
        lm, _ = lora_model()
        feed = batching.Feed(inputs=builder.input_names(lm))
        arrays = pair_batches.pad(tiny_pairs(6), 48)
        arrays.reference[:] = np.array([[-30.0, -20.0]])  # any reference: the rewards are not 0
        trainer = pair_view.PreferenceView(lm, 8, objective_of("dpo"))
        trainer.compile(optimizer=keras.optimizers.SGD(0.0, gradient_accumulation_steps=2),
                        loss=objective.TokenShare(), weighted_metrics=pair_view.metrics())  # fmt: skip
        order = pair_batches.PairOrder(arrays, 2, 0, feed, 2)
        real = order.rows(1)
        assert len(real) == 2 and order.metric_weights(1) == [2, 0]
        x, _, _ = pair_batches.inputs(arrays, real, order.width, batching.Feed(inputs=feed.inputs))
        expected = np.asarray(forward(trainer, x), np.float64)[:2].mean(axis=0)
        hooks = loop.Hooks(loop.Evaluation(None), lambda progress: None, out=open(os.devnull, "w"))
        progress = loop.Loop(trainer, order, loop.Progress(step=1), loop.Plan(2, checkpoint_every=100), hooks).run()
        row = progress.rows[-1]
        for index, name in enumerate(preference.METRICS, start=1):
            assert row[name] == pytest.approx(expected[index], rel=1e-5, abs=1e-6), name
        assert row["reward_accuracy"] > 0 and abs(row["rewards_chosen"]) > 0.1  # a real comparison: not zeros


@pytest.mark.one_backend  # numpy layout: the view on two devices is test_distribution's DPO run
def test_each_process_feeds_its_shards_of_a_pair_batch():
    """Two processes of one shard each feed the two halves of the rows one process of both shards feeds, the
    loss positions local to each shard and `loss_sequence` naming each slot's row in the whole batch; the pairs
    path fed every process the whole batch."""
    arrays = pair_batches.pad(tiny_pairs(6), 48)
    arrays.reference[:] = np.arange(12, dtype=np.float32).reshape(6, 2)
    pairs, real = np.array([0, 3, 5, 5]), np.array([True, True, True, False])
    width = pair_batches.target_width(arrays, 4, 2)
    whole = pair_batches.inputs(arrays, pairs, width, batching.Feed((0, 2, 2), 16), real)
    halves = [pair_batches.inputs(arrays, pairs, width, batching.Feed((k, k + 1, 2), 16), real) for k in (0, 1)]
    assert len(halves[0][0]["token_ids"]) == 4
    for index in range(3):
        if index == 0:
            for key in whole[0]:
                np.testing.assert_array_equal(np.concatenate([h[0][key] for h in halves]), whole[0][key], key)
        else:
            np.testing.assert_array_equal(np.concatenate([h[index] for h in halves]), whole[index])
    x = whole[0]
    assert x["loss_positions"][4:].max() < 4 * x["token_ids"].shape[1]  # the second shard's own rows
    weighted = x["loss_weights"] > 0
    assert set(x["loss_sequence"][4:][weighted[4:]]) == {4, 5, 6}  # its rejected rows (the filler's weigh 0)
    assert x["loss_reference"].tolist() == [0, 6, 10, 10, 1, 7, 11, 11]


@pytest.mark.parametrize("method", ["dpo", "ipo", "orpo", "simpo"])
def test_packed_pairs_score_each_pair_as_unpacked(method):
    """Issue 34: 7 pairs packed into micro-batches of 2 rows of 96, each sequence a segment of its own, give each
    pair the log-probabilities and loss it has a sequence a row, within 1e-5 in float32 (ORPO's NLL, a mean over a
    micro-batch's chosen sequences, compared over the same pairs); the filler slots weigh 0."""
    with float32_policy():
        lm, _ = lora_model()
        objective = OBJECTIVES[method]
        arrays = pair_batches.pad(tiny_pairs(7), 96, objective.whole_chosen)
        arrays.reference[:] = -3.0 - 1.5 * np.arange(14, dtype=np.float32).reshape(7, 2)
        view = pair_view.PreferenceView(lm, 8, objective)
        feed = batching.Feed(length_step=16, inputs=builder.input_names(lm))
        packed = pair_packing.pack(arrays, 2)
        assert len(packed.bundles) < 7 and packed.slots >= 2  # several pairs a micro-batch of 2 rows
        seen = []
        # The unpacked batches in one shape (one program on JAX): as many pairs as the fullest bundle holds, the
        # rest filler copies, each row the full 96 tokens.
        most = max(len(bundle.pairs) for bundle in packed.bundles)
        width, whole_rows = pair_batches.target_width(arrays, most), batching.Feed(inputs=feed.inputs)
        for bundle in packed.bundles:
            x, y, weights = pair_packing.inputs(packed, bundle, feed)
            held = len(bundle.pairs)
            assert x["token_ids"].shape[0] == 2 and y.shape == weights.shape == (2 * packed.slots, 7)
            got = forward(view, x)
            pairs = np.concatenate([bundle.pairs, np.repeat(bundle.pairs[-1:], most - held)])
            real = np.arange(most) < held
            unpacked = forward(view, pair_batches.inputs(arrays, pairs, width, whole_rows, real)[0])
            np.testing.assert_allclose(got[:held], unpacked[:held], rtol=1e-5, atol=1e-5)
            assert weights[:, 0].tolist() == [1.0] * held + [0.0] * (2 * packed.slots - held)
            seen += bundle.pairs.tolist()
        assert sorted(seen) == list(range(7))


def test_packed_order_trains_every_pair_once_an_epoch_and_a_step_is_the_mean_over_its_pairs():
    """PackedPairOrder: the micro-batches of an epoch hold every pair once; with --grad-accum 2 the last step of an
    epoch may end on a weight-0 copy; a step's loss (learning rate 0) is the mean of its pairs' unpacked losses."""
    with float32_policy():
        lm, _ = lora_model()
        feed = batching.Feed(inputs=builder.input_names(lm))
        arrays = pair_batches.pad(tiny_pairs(9), 96)
        arrays.reference[:] = np.array([[-30.0, -20.0]])
        packed = pair_packing.pack(arrays, 2)
        order = pair_packing.PackedPairOrder(packed, 3, feed, grad_accum=2)
        assert order.steps_per_epoch == -(-len(packed.bundles) // 2)
        epoch = [order.rows(step) for step in range(order.steps_per_epoch)]
        assert sorted(np.concatenate(epoch).tolist()) == list(range(9))
        trainer = pair_view.PreferenceView(lm, 8, objective_of("dpo"))
        trainer.compile(optimizer=keras.optimizers.SGD(0.0, gradient_accumulation_steps=2),
                        loss=objective.TokenShare(), weighted_metrics=pair_view.metrics())  # fmt: skip
        for step in range(order.steps_per_epoch):
            losses = [float(trainer.train_on_batch(x, y, sample_weight=w, return_dict=True)["loss"])
                      for x, y, w in order.micro_batches(step)]  # fmt: skip
            pairs = order.rows(step)
            x = pair_batches.inputs(arrays, pairs, pair_batches.target_width(arrays, len(pairs)), feed)[0]
            expected = forward(trainer, x)[: len(pairs), 0].mean()
            assert np.mean(losses) == pytest.approx(expected, rel=1e-5)
            assert sum(order.metric_weights(step)) == len(pairs)
