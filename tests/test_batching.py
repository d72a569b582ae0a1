import numpy as np
import pytest

from finetune.data import batching, templates
from finetune.data.formats import Record
from finetune.model import presets

pytestmark = pytest.mark.one_backend  # no Keras backend in these: they run in one suite


@pytest.fixture(scope="module")
def tokenizer():
    return presets.tiny_tokenizer()


def ids(tokenizer, text):
    return [int(t) for t in np.asarray(tokenizer.tokenize(text))]


def test_prompt_positions_carry_weight_zero(tokenizer):
    prompt, response = templates.get("dolly").apply(Record(instruction="What is 2 plus 2?", response="4."))
    (example,), dropped = batching.tokenize([(prompt, response)], tokenizer, seq_len=64)
    n_prompt, n_response = len(ids(tokenizer, prompt)), len(ids(tokenizer, response))
    assert dropped == []
    assert example.token_ids[0] == batching.BOS and example.token_ids[-1] == batching.EOS
    assert example.token_ids[1 : 1 + n_prompt] == ids(tokenizer, prompt)
    assert example.weights == [0.0] * (1 + n_prompt) + [1.0] * (n_response + 1)


def test_train_on_prompt_weights_prompt_tokens(tokenizer):
    (example,), _ = batching.tokenize([("Question:\n", "Answer.")], tokenizer, seq_len=64, train_on_prompt=True)
    assert example.weights[0] == 0.0  # <bos> is never a target
    assert all(w == 1.0 for w in example.weights[1:])


def test_long_examples_are_cut_and_prompt_only_ones_dropped(tokenizer):
    long_response = ("word " * 100).strip()
    pairs = [("Q:\n", long_response), ("very long prompt " * 40, "A.")]
    examples, dropped = batching.tokenize(pairs, tokenizer, seq_len=32)
    assert dropped == [1]
    assert len(examples) == 1 and len(examples[0].token_ids) == 33  # seq_len inputs + 1 shifted target


def test_pad_shifts_targets_and_masks_padding(tokenizer):
    examples, _ = batching.tokenize([("Q:\n", "Yes."), ("Question two:\n", "No way.")], tokenizer, seq_len=24)
    arrays = batching.pad(examples, seq_len=24)
    assert arrays["token_ids"].shape == (2, 24)
    for row, example in enumerate(examples):
        n = len(example.token_ids) - 1
        np.testing.assert_array_equal(arrays["token_ids"][row, :n], example.token_ids[:-1])
        np.testing.assert_array_equal(arrays["labels"][row, :n], example.token_ids[1:])
        np.testing.assert_array_equal(arrays["weights"][row, :n], example.weights[1:])
        assert arrays["padding_mask"][row, :n].all() and not arrays["padding_mask"][row, n:].any()
        assert not arrays["weights"][row, n:].any()
        np.testing.assert_array_equal(arrays["segment_ids"][row], arrays["padding_mask"][row].astype(np.int32))


def test_training_batches_are_full_and_reshuffled_per_epoch(tokenizer):
    examples, _ = batching.tokenize([(f"Q{i}:\n", f"A{i}.") for i in range(10)], tokenizer, seq_len=16)
    arrays = batching.pad(examples, 16)
    train = batching.TrainOrder(arrays, batch_size=4, seed=1)
    assert train.steps_per_epoch == 3  # the short last batch trains too (tests/test_optimizer.py)
    first = np.concatenate([train.batch(s)[0]["token_ids"] for s in (0, 1, 2)])
    second = np.concatenate([train.batch(s)[0]["token_ids"] for s in (3, 4, 5)])
    assert first.shape == (12, 16) and not np.array_equal(first, second)
    evaluation = batching.Batches(arrays, batch_size=4)
    assert len(evaluation) == 3  # every held-out row is seen
    x, y, w = evaluation[2]
    assert x["token_ids"].shape == (4, 16) and len(y["loss"]) == 4  # the same shape as every other batch
    assert w["loss"].sum() == arrays["weights"][8:].sum()  # the filler rows count for nothing
    np.testing.assert_array_equal(x["token_ids"][:2], arrays["token_ids"][8:])


def test_a_step_s_batch_does_not_depend_on_what_ran_before(tokenizer):
    """Exact resume: a fresh order asked for step 5 first gives what a run reaching step 5 trains."""
    examples, _ = batching.tokenize([(f"Q{i}:\n", f"A{i} " * (i + 1)) for i in range(11)], tokenizer, seq_len=32)
    arrays = batching.pad(examples, 32)
    running = batching.TrainOrder(arrays, batch_size=3, seed=7)
    trained = [running.batch(s) for s in range(7)]
    resumed = batching.TrainOrder(arrays, batch_size=3, seed=7)
    for step in (5, 6):
        x, y, w = resumed.batch(step)
        np.testing.assert_array_equal(x["token_ids"], trained[step][0]["token_ids"])
        np.testing.assert_array_equal(w, trained[step][2])


def test_counted_tokens_are_those_of_the_trained_batch(tokenizer):
    examples, _ = batching.tokenize([(f"Q{i}:\n", "word " * (i + 1)) for i in range(9)], tokenizer, seq_len=32)
    arrays = batching.pad(examples, 32)
    order = batching.TrainOrder(arrays, batch_size=2, seed=3)
    for step in range(8):  # steps 4 and 9 are short, filled with weight-0 copies that count for nothing
        x, _, _ = order.batch(step)
        rows = len(order.rows(step))
        assert order.tokens(step) == (int(x["padding_mask"][:rows].sum()), int(x["loss_weights"].sum()))


def test_template_overhead_counts_fixed_text(tokenizer):
    overhead = batching.template_overhead(tokenizer, templates.get("alpaca"))
    assert overhead > batching.template_overhead(tokenizer, templates.get("dolly")) > 2


@pytest.mark.parametrize("count, size", [(1000, 8), (37, 4), (5, 4)])
def test_grouped_epochs_train_every_row_once_in_steps_of_like_length(count, size):
    """--group-by-length: an epoch is still every row once, in the same count of steps; each stretch of steps
    (the shuffled order cut in GROUP_STEPS steps, or a quarter of the epoch) holds the plain order's rows of those
    steps, longest first, but the epoch's longest row, which trades places with the first; another seed groups
    other rows; the same (seed, step) gives the same rows, asked in any order (exact resume)."""
    lengths = np.random.default_rng(0).integers(1, 500, count)
    plain, grouped = batching.EpochRows(count, size, 3), batching.EpochRows(count, size, 3, lengths)
    assert grouped.steps_per_epoch == plain.steps_per_epoch
    for epoch in range(2):
        steps = range(epoch * grouped.steps_per_epoch, (epoch + 1) * grouped.steps_per_epoch)
        rows = [grouped(step) for step in steps]
        assert sorted(np.concatenate(rows).tolist()) == list(range(count))
        assert [len(r) for r in rows] == [len(plain(step)) for step in steps]
        stretch = max(1, min(batching.GROUP_STEPS, -(-grouped.steps_per_epoch // 4)))
        assert lengths[rows[0][0]] == lengths.max()  # the epoch's longest row in its first step
        differ = []
        for first in range(0, len(rows), stretch):
            mine = np.concatenate(rows[first : first + stretch])
            assert (np.diff(lengths[mine[1:]]) <= 0).all()  # longest first, but for the row traded with the first
            theirs = np.concatenate([plain(steps[i]) for i in range(first, min(first + stretch, len(rows)))])
            if sorted(mine.tolist()) != sorted(theirs.tolist()):
                assert len(set(mine) ^ set(theirs)) == 2  # one row traded
                differ.append(first)
        assert not differ or (len(differ) == 2 and differ[0] == 0)  # the first stretch and the longest's, if apart
    assert not np.array_equal(grouped(0), batching.EpochRows(count, size, 4, lengths)(0)) or count <= size
    fresh = batching.EpochRows(count, size, 3, lengths)
    for step in (grouped.steps_per_epoch + 1, 2):
        np.testing.assert_array_equal(fresh(step), grouped(step))


def test_grouped_batches_of_padded_rows_carry_less_padding(tokenizer):
    """What grouping is for: the rows of each step cut to its longest (PyTorch's length step), for examples of
    10 to 80 tokens, carry less than half the shuffled order's padding, and train the same tokens."""
    examples, _ = batching.tokenize([(f"Q{i}:\n", "word " * (1 + (i * 37) % 30)) for i in range(96)], tokenizer,
                                    seq_len=80)  # fmt: skip
    arrays = batching.pad(examples, 80)

    def positions(grouped: bool) -> tuple[int, int]:
        order = batching.TrainOrder(arrays, 4, seed=0, feed=batching.Feed(length_step=16, grouped=grouped))
        batches = [order.batch(step)[0] for step in range(order.steps_per_epoch)]
        return sum(x["token_ids"].size for x in batches), sum(int(x["padding_mask"].sum()) for x in batches)

    (plain, tokens), (grouped, same) = positions(False), positions(True)
    assert same == tokens and grouped - tokens < 0.5 * (plain - tokens)  # the padding halved, at least


def test_a_compiled_step_takes_few_lengths_on_every_backend():
    """Each length is a compiled program under XLA and under torch.compile (--compile): eighths of seq_len there;
    an eager PyTorch step and TensorFlow's dynamic graph on a CPU follow the rows to within 16 positions."""
    assert batching.length_step("jax", 512) == 64
    assert batching.length_step("torch", 512) == batching.length_step("tensorflow", 512) == 16
    assert batching.length_step("torch", 512, compiled=True) == batching.length_step("tensorflow", 512, compiled=True)
    assert batching.length_step("torch", 512, compiled=True) == 64
    assert batching.length_step("tensorflow", 512, "gpu") == 64
