"""The TensorBoard log, read back from its event files."""

import types

import pytest
from conftest import tensorboard_scalars

from finetune import callbacks


def test_tensorboard_log_writes_train_and_eval_tensorboard_scalars(tmp_path):
    board = callbacks.TensorBoardLog(tmp_path, types.SimpleNamespace(learning_rate=0.5))
    board.on_test_end({"step": 0, "loss": 3.0, "accuracy": 0.25, "perplexity": 20.0, "examples": 4})
    board.on_train_batch_end(1, {"loss": 2.5, "tokens": 100, "seconds": 0.5})
    board.on_train_batch_end(2, {"loss": 2.0, "tokens": 50, "seconds": 0.25})
    board.on_test_end({"loss": 1.5, "accuracy": 0.5, "perplexity": 4.5})  # after the last step trained
    board.on_train_end()
    train, held_out = tensorboard_scalars(tmp_path / "train"), tensorboard_scalars(tmp_path / "eval")
    assert train["loss"] == {1: 2.5, 2: 2.0} and train["learning_rate"] == {1: 0.5, 2: 0.5}
    assert train["tokens_per_second"] == {1: pytest.approx(200.0), 2: pytest.approx(200.0)}
    assert held_out == {"loss": {0: 3.0, 2: 1.5}, "accuracy": {0: 0.25, 2: 0.5}, "perplexity": {0: 20.0, 2: 4.5}}
