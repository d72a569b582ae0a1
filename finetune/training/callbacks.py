"""What watches the training loop from outside it: the TensorBoard log.

The loop (loop.py) is not keras' fit(), so it calls these keras Callbacks'
hooks itself: on_train_batch_end after each optimizer step (with the run's
step, not the batch index in the epoch), on_test_end after each held-out
evaluation and on_train_end when training ends.
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np

from finetune.training import events


def step_scalars(logs: dict) -> dict:
    """What every tracker logs of a step: its loss, the learning rate and gradient norm it applied, and the
    method's own metrics (a preference step's rewards and log-probabilities, GRPO's rewards and completion lengths),
    the columns history.csv has; each a finite number. The step's tokens and seconds are its speed, not a metric."""
    return {name: float(value) for name, value in logs.items() if name not in ("tokens", "seconds") and _scalar(value)}


def held_out_scalars(logs: dict) -> dict:
    """What every tracker logs of an evaluation: the held-out loss and every metric the method scores beside it
    (perplexity and accuracy; a preference method's reward accuracy and margin, a classifier's macro F1, GRPO's
    reward), each a finite number."""
    return {name: float(value) for name, value in logs.items() if name not in ("step", "examples") and _scalar(value)}


def _scalar(value) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and bool(np.isfinite(value))


class TensorBoardLog(keras.callbacks.Callback):
    """Scalars for TensorBoard: per step the train loss, learning rate and tokens/s; per evaluation the held-out loss.

    Written by events.py, without TensorFlow, whatever the Keras backend, into
    two runs under `log_dir`: train/ and eval/, so that TensorBoard draws both
    losses in one `loss` chart. Every write is flushed: a checkpoint copies the
    logs out (to gs:// or AIP_TENSORBOARD_LOG_DIR) as they stand.

    Args:
        log_dir: Path. The TensorBoard log directory (`<run>/tensorboard`).
        optimizer: keras.optimizers.Optimizer. Its learning rate is logged for a step whose logs do not
            name the rate the step applied.
        resumed_at: int. The checkpoint's step, for a run resumed from one: the steps after it, which a killed
            session may have logged already, are logged again, and TensorBoard shows the new ones alone.
    """

    def __init__(self, log_dir: Path, optimizer, resumed_at: int | None = None):
        super().__init__()
        # === Config ===
        self.log_dir = Path(log_dir)
        self.optimizer = optimizer
        # === Writers ===
        purge = 0 if resumed_at is None else resumed_at + 1
        self._files = {run: events.EventFile(self.log_dir / run, purge) for run in ("train", "eval")}
        self._step = 0

    def on_train_batch_end(self, batch, logs=None):
        """batch: int. The run's step just taken; logs: loss, tokens and seconds of that step, and the learning
        rate and gradient norm it applied (optimizer.step_record) where the optimizer reports them."""
        self._step = batch
        scalars = step_scalars(logs)
        if scalars.get("learning_rate") is None:  # by now the optimizer's rate is the next step's: the best there is
            scalars["learning_rate"] = float(np.asarray(keras.ops.convert_to_numpy(self.optimizer.learning_rate)))
        if logs.get("seconds"):
            scalars["tokens_per_second"] = logs["tokens"] / logs["seconds"]
        self._files["train"].scalars(batch, scalars)

    def on_test_end(self, logs=None):
        """logs: the held-out metrics (held_out_scalars); `step` when not the last step trained."""
        self._files["eval"].scalars(logs.get("step", self._step), held_out_scalars(logs))

    def on_train_end(self, logs=None):
        for file in self._files.values():
            file.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc) -> None:
        self.on_train_end()  # closes its writers, also when the run failed or stopped
