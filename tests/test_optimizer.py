"""The optimizer-step controls: --max-steps, the partial last batch, --lr-schedule and warmup, --grad-accum,
--max-grad-norm; each against its reference (transformers' schedules, torch's clip_grad_norm_, the K-times larger
batch), through the Python API and as the command is typed."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import BACKEND, make_records, write_jsonl

import finetune
from finetune import config
from finetune.data import batching
from finetune.model import optimizer
from finetune.platform.errors import UserError

HF_SCHEDULES = {
    "constant": "get_constant_schedule_with_warmup",
    "linear": "get_linear_schedule_with_warmup",
    "cosine": "get_cosine_schedule_with_warmup",
    "cosine_with_min_lr": "get_cosine_with_min_lr_schedule_with_warmup",
}


def transformers_rates(schedule: str, warmup: int, total: int, peak: float, min_lr_ratio: float) -> list[float]:
    """The learning rate of each of `total` updates under transformers' scheduler, stepped after each update."""
    import torch
    import transformers

    weight = torch.nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([weight], lr=peak)
    make = getattr(transformers, HF_SCHEDULES[schedule])
    extra = {"min_lr_rate": min_lr_ratio} if schedule == "cosine_with_min_lr" else {}
    extra |= {} if schedule == "constant" else {"num_training_steps": total}
    scheduler = make(sgd, num_warmup_steps=warmup, **extra)
    rates = []
    for _ in range(total):
        rates.append(sgd.param_groups[0]["lr"])  # the rate this update applies
        sgd.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("schedule", optimizer.SCHEDULES)
@pytest.mark.parametrize("warmup,grad_accum", [(0, 1), (3, 1), (4, 3)])
def test_each_update_s_learning_rate_is_transformers(schedule, warmup, grad_accum):
    from keras import ops

    total, peak = 13, 2e-4
    expected = transformers_rates(schedule, warmup, total, peak, 0.1)
    schedule_ = optimizer.WarmupSchedule(peak, schedule, warmup, total, grad_accum, 0.1)
    # Keras evaluates it at the micro-step count before the update: K s + K - 1 at optimizer step s's update.
    applied = [float(ops.convert_to_numpy(schedule_(s * grad_accum + grad_accum - 1))) for s in range(total)]
    np.testing.assert_allclose(applied, expected, rtol=1e-5, atol=1e-11)  # float32, as the update applies it
    np.testing.assert_allclose([schedule_.at_step(s) for s in range(total)], expected, rtol=1e-12, atol=0)
    if warmup:
        assert applied[0] == 0.0  # transformers' first warmup update is made at 0


def test_the_schedule_survives_keras_serialization():
    import keras

    schedule = optimizer.WarmupSchedule(1e-4, "cosine", 2, 10, 2, 0.0)
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert again.get_config() == schedule.get_config()


def test_warmup_ratio_rounds_up_as_transformers_does():
    assert optimizer.warmup_steps_for(13, None, 0.1) == 2 and optimizer.warmup_steps_for(13, 5, None) == 5
    assert optimizer.warmup_steps_for(13, None, None) == 0


@pytest.mark.parametrize("max_norm", [0.5, 100.0, None])
def test_clipping_is_torch_s_clip_grad_norm(max_norm):
    import keras
    import torch

    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(3, 4)).astype("float32"), rng.normal(size=(5,)).astype("float32")]
    variables = [keras.Variable(np.zeros_like(a)) for a in arrays]
    adamw = optimizer.clipped_adamw()(max_grad_norm=max_norm, learning_rate=1e-3)
    adamw.build(variables)
    clipped = adamw._clip_gradients([keras.ops.convert_to_tensor(a) for a in arrays])
    tensors = [torch.nn.Parameter(torch.zeros(a.shape)) for a in arrays]
    for tensor, a in zip(tensors, arrays):
        tensor.grad = torch.tensor(a)
    norm = torch.nn.utils.clip_grad_norm_(tensors, max_norm if max_norm else math.inf)
    assert float(keras.ops.convert_to_numpy(adamw.grad_norm.value)) == pytest.approx(float(norm), rel=1e-6)
    for ours, theirs in zip(clipped, tensors):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(ours), theirs.grad.numpy(), rtol=1e-6)


def test_on_pytorch_the_optimizer_keeps_keras_fused_adamw():
    import keras

    adamw = optimizer.adamw(optimizer.Controls(1e-3))
    assert isinstance(adamw, keras.optimizers.AdamW) and isinstance(adamw, optimizer.Clipping)
    if BACKEND == "torch":  # keras' own PyTorch AdamW updates every variable in one torch._foreach op
        assert "torch" in type(adamw).__mro__[2].__module__


def test_config_lists_the_schedules_optimizer_implements():
    assert config.LR_SCHEDULES == optimizer.SCHEDULES


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"train.warmup_steps": 2, "train.warmup_ratio": 0.1}, "pass one of them"),
        ({"train.max_grad_norm": -1}, "max grad norm must be a number at least 0"),
        ({"train.max_grad_norm": "off"}, "or `none`"),
        ({"train.grad_accum": 0}, "gradient accumulation must be at least 1"),
        ({"train.lr_schedule": "step"}, "choose one of constant, linear, cosine"),
    ],
)
def test_wrong_controls_are_refused_in_a_line(settings, message):
    with pytest.raises(UserError, match=message):
        config.load(None, settings)


def test_clipping_is_off_at_0_or_none():
    assert config.load(None, {"train.max_grad_norm": "none"}).train.clip_norm() is None
    assert config.load(None, {"train.max_grad_norm": 0}).train.clip_norm() is None
    assert config.load(None, {}).train.clip_norm() == 1.0


def _arrays(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 16, size=n)
    ids = np.zeros((n, 16), np.int32)
    weights = np.zeros((n, 16), np.float32)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(3, 100, size=length)
        weights[row, length // 2 : length] = 1.0  # the second half is the response
    present = ids > 0
    return {"token_ids": ids, "padding_mask": present, "segment_ids": present.astype(np.int32), "labels": ids,
            "weights": weights}  # fmt: skip


def test_every_row_trains_each_epoch_and_the_short_last_batch_is_filled_with_weight_0():
    arrays = _arrays(10)
    order = batching.TrainOrder(arrays, batch_size=4, seed=1)
    assert order.steps_per_epoch == 3  # 4 + 4 + 2: none dropped
    for epoch in range(2):
        steps = range(epoch * 3, epoch * 3 + 3)
        assert sorted(np.concatenate([order.rows(s) for s in steps])) == list(range(10))
    x, _, w = order.batch(2)
    assert x["token_ids"].shape[0] == 4  # the shape of every other batch
    real = order.rows(2)
    assert x["loss_weights"].sum() == arrays["weights"][real].sum() == order.tokens(2)[1]
    assert w.sum() == pytest.approx(1.0)  # each token's share of the step


def test_micro_batches_split_the_larger_batch_and_share_its_tokens():
    arrays = _arrays(11)
    whole = batching.TrainOrder(arrays, batch_size=4, seed=3)
    split = batching.TrainOrder(arrays, batch_size=1, seed=3, grad_accum=4)
    assert split.steps_per_epoch == whole.steps_per_epoch == 3
    for step in range(6):
        np.testing.assert_array_equal(split.rows(step), whole.rows(step))
        micro = split.micro_batches(step)
        assert len(micro) == 4
        # Weighted by the step's tokens, not each micro-batch's own: Keras averages the 4, so they sum to 4.
        assert sum(float(w.sum()) for _, _, w in micro) == pytest.approx(4.0)
        assert sum(float(x["loss_weights"].sum()) for x, _, _ in micro) == whole.tokens(step)[1]


def test_a_step_s_micro_batches_do_not_depend_on_what_ran_before():
    arrays = _arrays(13)
    running = batching.TrainOrder(arrays, batch_size=2, seed=7, grad_accum=2)
    trained = [running.micro_batches(s) for s in range(9)]
    resumed = batching.TrainOrder(arrays, batch_size=2, seed=7, grad_accum=2)
    for step in (8, 5):
        for (x, _, w), (x0, _, w0) in zip(resumed.micro_batches(step), trained[step]):
            np.testing.assert_array_equal(x["token_ids"], x0["token_ids"])
            np.testing.assert_array_equal(w, w0)


def _run(tmp_path, name: str, **settings) -> tuple[dict, list[dict]]:
    out = tmp_path / name
    data = write_jsonl(tmp_path / "data.jsonl", make_records(40))
    base = {
        "backend": BACKEND, "output.dir": str(out), "data.path": str(data), "model.seq_len": 64,
        "model.precision": "float32", "data.packing": "off", "data.eval_fraction": 0.2, "train.samples": 0,
        "train.max_steps": 4,
    }  # fmt: skip
    metrics = finetune.run(finetune.load_config("tiny", {**base, **settings}))
    return metrics, list(csv.DictReader((out / "history.csv").open()))


def test_four_micro_batches_of_one_train_as_one_batch_of_four(tmp_path):
    """--grad-accum 4 --batch-size 1 and --batch-size 4 train the same rows to the same held-out loss."""
    whole, whole_rows = _run(tmp_path, "whole", **{"train.batch_size": 4})
    split, split_rows = _run(tmp_path, "split", **{"train.batch_size": 1, "train.grad_accum": 4})
    assert split["steps"] == whole["steps"] == 4 and split["grad_accum"] == 4
    assert split["trained_tokens"] == whole["trained_tokens"]
    assert split["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-4)
    assert split["eval_loss"] != pytest.approx(split["eval_loss_before"], rel=1e-3)  # it did train
    norms = [(float(a["grad_norm"]), float(b["grad_norm"])) for a, b in zip(whole_rows, split_rows) if a["grad_norm"]]
    assert len(norms) == 4 and all(a == pytest.approx(b, rel=1e-3) for a, b in norms)
    # The free-space check sizes a checkpoint with the summed gradients that --grad-accum keeps (one copy more).
    from finetune.training import train

    for out, run in ((tmp_path / "whole", whole), (tmp_path / "split", split)):
        newest = sorted((out / "checkpoints").iterdir())[-1]
        written = sum(f.stat().st_size for f in newest.glob("*.npz"))
        planned = train.checkpoint_bytes(run["trainable_parameters"], run["grad_accum"]) - 2**20
        assert 0.95 * planned < written <= planned + 2**20, (out.name, written, planned)


def test_history_logs_each_step_s_learning_rate_and_finite_gradient_norm(tmp_path):
    metrics, rows = _run(tmp_path, "cosine", **{"train.batch_size": 2, "train.lr_schedule": "cosine",
                                                 "train.warmup_steps": 1, "train.max_grad_norm": 0.5})  # fmt: skip
    steps = [row for row in rows if row["train_loss"]]
    expected = transformers_rates("cosine", 1, 4, metrics["learning_rate"], 0.0)
    np.testing.assert_allclose([float(r["learning_rate"]) for r in steps], expected, rtol=1e-9)
    assert all(math.isfinite(float(r["grad_norm"])) and float(r["grad_norm"]) > 0 for r in steps)


def test_a_non_finite_gradient_norm_stops_the_run_with_advice(tmp_path, monkeypatch):
    from keras import ops

    def nan_norm(self, grads):
        self.grad_norm.assign(ops.convert_to_tensor(float("nan")))
        return grads

    monkeypatch.setattr(optimizer.Clipping, "_clip_gradients", nan_norm)
    with pytest.raises(UserError, match=r"gradient norm is nan at step 1: training diverged(.|\n)*lower learning rate"):
        _run(tmp_path, "nan", **{"train.batch_size": 2})


@pytest.mark.backend_neutral  # the steps are resolved in Python; the rates are checked above
def test_max_steps_trains_that_many_steps_over_epochs_as_typed(tmp_path):
    """24 records, 8 held out, steps of 2 micro-batches of 4: 2 steps an epoch; --max-steps 3 trains 3 steps."""
    data = write_jsonl(tmp_path / "small.jsonl", make_records(24))
    command = [sys.executable, "-m", "finetune", "gemma", "--preset", "tiny", "--backend", BACKEND, "--data",
               str(data), "--seq-len", "64", "--eval-fraction", "0.34", "--batch-size", "4", "--grad-accum", "2", "--max-steps", "3",
               "--lr-schedule", "linear", "--warmup-ratio", "0.5", "--max-grad-norm", "none", "--set",
               "train.samples=0", "--output", "run"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    decided = [line for line in done.stdout.splitlines() if line.split()[:2] == ["steps", "3"]]  # the table
    assert decided and "max steps 3: 1.5 passes of 2 steps; --epochs is ignored" in decided[0], done.stdout
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["epochs"] == 2 and metrics["lr_schedule"] == "linear"
    rows = [r for r in csv.DictReader((tmp_path / "run" / "history.csv").open()) if r["train_loss"]]
    expected = transformers_rates("linear", 2, 3, metrics["learning_rate"], 0.0)
    np.testing.assert_allclose([float(r["learning_rate"]) for r in rows], expected, rtol=1e-9)
    assert [r["epoch"] for r in rows] == ["1", "1", "2"]
