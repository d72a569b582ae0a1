"""A PyTorch train step reads nothing back from the device but the loss weights, once, before the backbone runs.

On a GPU, each read of a device value (a tensor's truth, `.item()`, `.numpy()`) makes the host wait for every op
queued before it. objective.py's chunks of the loss used to choose, each on the device (keras' `ops.cond` is an
`if` on PyTorch), whether they weigh anything: 32 reads a step at a 256k vocabulary and 4096 positions, each after
the whole forward was queued. Now the weights are read once, before the backbone is queued
(objective.weighted_on_host), and the chunks are chosen in Python.

The reads are counted with a TorchFunctionMode inside keras' train_step, for every method, with chunks of 16
positions so that each step has several, some of them padding alone. The method's own loss, its metrics and the
optimizer's update (float32: no loss scale, whose finite check is keras' own read) read nothing.
"""

import collections
import traceback

import numpy as np
import pytest
from conftest import BACKEND, make_records, write_jsonl
from test_grpo import story_prompts
from test_preference_runs import learnable_pairs

from finetune.methods import registry

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="reads that make the host wait: PyTorch runs eagerly")

READS = {"__bool__", "item", "tolist", "numpy", "__int__", "__float__", "__index__", "nonzero", "__array__"}


def _count_reads_in_train_steps(monkeypatch):
    """Patch keras' PyTorch train_step to count, by the function of ours that made it, each read of the device."""
    from keras.src.backend.torch import trainer
    from torch.overrides import TorchFunctionMode

    reads, steps = collections.Counter(), []

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in READS:
                ours = [f.name for f in traceback.extract_stack() if "/finetune/" in f.filename]
                reads[ours[-1] if ours else "keras"] += 1
            return func(*args, **(kwargs or {}))

    own = trainer.TorchTrainer.train_step

    def train_step(self, data):
        steps.append(1)
        with Reads():
            return own(self, data)

    monkeypatch.setattr(trainer.TorchTrainer, "train_step", train_step)
    return reads, steps


@pytest.mark.parametrize("method", list(registry.METHODS))
def test_a_train_step_reads_the_device_once_whatever_the_method(method, tmp_path, monkeypatch):
    import finetune
    from finetune.platform import backend

    monkeypatch.setattr(backend, "LOSS_CHUNK_MAX", 16)  # several chunks a step, the last ones padding
    reads, steps = _count_reads_in_train_steps(monkeypatch)
    taken = registry.get(method)
    records = (learnable_pairs(8) if taken.paired else story_prompts()[:8] if taken.prompted
               else [{"text": f"record {i}", "label": i % 2} for i in range(8)] if taken.labelled
               else make_records(8))  # fmt: skip
    settings = {"model.preset": "tiny", "backend": "torch", "model.precision": "float32", "model.seq_len": 48,
                "train.method": method, "train.max_steps": 2, "train.samples": 0, "train.batch_size": 2,
                "data.path": str(write_jsonl(tmp_path / "records.jsonl", records)), "data.eval_fraction": 0.0,
                "output.dir": str(tmp_path / "run")}  # fmt: skip
    if taken.prompted:
        settings.update({"train.reward": ["format:The"], "train.num_generations": 2,
                         "train.max_completion_length": 4})  # fmt: skip
    finetune.run(finetune.load_config(None, settings))

    assert len(steps) >= 2
    # The token losses' weights, once a step (.numpy(); .cpu() is no read); a score head (reward, classify): none.
    assert reads == ({} if method in ("reward", "classify") else {"weighted_on_host": len(steps)})


def test_chunks_chosen_from_the_host_s_weights_train_as_the_device_s_choice(monkeypatch):
    """The same losses and gradients with the chunks chosen in Python as with keras' `ops.cond` on the device."""
    import keras

    from finetune.model import objective

    rng = np.random.default_rng(0)
    hidden = keras.ops.convert_to_tensor(rng.normal(size=(40, 8)).astype("float32"))
    kernel = keras.ops.convert_to_tensor(rng.normal(size=(30, 8)).astype("float32"))
    labels = keras.ops.convert_to_tensor(rng.integers(0, 30, 40).astype("int32"))
    weights = np.zeros(40, "float32")
    weights[[1, 5, 20, 21]] = 1.0  # chunks of 8: the 1st and 3rd carry weight, the 2nd, 4th and 5th are padding
    weights = keras.ops.convert_to_tensor(weights)

    def losses_and_gradient(weighted):
        import torch

        h = hidden.detach().clone().requires_grad_(True)
        out = objective.token_losses(objective.Targets(h, labels, weights, kernel, None, weighted), 8)
        (out * torch.arange(1.0, 41.0)).sum().backward()
        return out.detach().numpy(), h.grad.numpy()

    on_device = losses_and_gradient(None)
    on_host = losses_and_gradient(objective.weighted_on_host(weights))
    np.testing.assert_array_equal(on_host[0], on_device[0])
    np.testing.assert_array_equal(on_host[1], on_device[1])
    made = [bool(on_host[0][start : start + 8].any()) for start in range(0, 40, 8)]
    assert made == [True, False, True, False, False]  # the chunks of padding alone skipped, the weighted ones made
