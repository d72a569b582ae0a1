"""model/score_head.py: the hidden state each sequence is scored at (its last target slot, packed or not), and a
head that starts alike on every backend."""

import numpy as np
from keras import ops

from finetune.model import score_head


def test_each_sequence_is_read_at_its_last_slot():
    """Two rows of 4 slots: row 0 holds sequences 0 and 2 (packed), row 1 sequence 1 and a padding slot; sequence
    3 (a filler's) has no slot and reads slot 0."""
    hidden = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)
    weights = np.array([1, 1, 1, 1, 1, 1, 1, 0], np.float32)
    sequence = np.array([0, 0, 2, 2, 1, 1, 1, 0], np.int32)
    states = ops.convert_to_numpy(score_head.last_states(hidden, weights, sequence, 4))
    np.testing.assert_array_equal(states, hidden[[1, 6, 3, 0]])


def test_the_head_starts_from_its_seed_and_scores_in_float32():
    a, b, c = score_head.ScoreHead(3, 16, seed=1), score_head.ScoreHead(3, 16, seed=1), score_head.ScoreHead(3, 16)
    np.testing.assert_array_equal(a.kernel.numpy(), b.kernel.numpy())
    assert not np.array_equal(a.kernel.numpy(), c.kernel.numpy())
    assert 0.1 < float(np.std(a.kernel.numpy())) < 0.4  # 1 / sqrt(16)
    states = np.ones((2, 16), np.float32)
    scores = ops.convert_to_numpy(a(ops.cast(states, "bfloat16")))
    assert scores.shape == (2, 3) and scores.dtype == np.float32
    np.testing.assert_allclose(scores, states @ a.kernel.numpy(), rtol=1e-6)
