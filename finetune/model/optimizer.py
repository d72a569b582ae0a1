"""AdamW as a run trains with it: Hugging Face's learning-rate schedules, global-norm clipping, and accumulation.

- The schedules are transformers' (get_constant/linear/cosine_schedule_with_warmup and
  get_cosine_with_min_lr_schedule_with_warmup), step for step. transformers steps its
  scheduler after each optimizer step, so the update at optimizer step s (from 0) uses
  lr_lambda(s): the first update of a warmup is made at learning rate 0. Keras evaluates a
  schedule at the optimizer's iteration count before that count is incremented, which is
  the same index, so the learning rate of every update equals transformers' (tests/test_optimizer.py).
- Clipping scales the gradients by max_norm / (norm + 1e-6) when the norm is larger, as
  torch.nn.utils.clip_grad_norm_ does. The norm before clipping is kept in an optimizer
  variable (`grad_norm`), so the loop logs it and stops on a non-finite one.
- Accumulation uses Keras' own (`gradient_accumulation_steps`), which averages the K
  micro-batches' gradients; batching.TrainOrder weights each micro-batch's loss by its
  share of the step's response tokens (TokenShare), so the average equals the gradient of
  the mean over all of them, as the K-times larger batch would give. Keras evaluates the
  schedule at its micro-step count, so the schedule divides it by K.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import keras
from keras import ops

from finetune.model import experts, tokens
from finetune.platform import keras_compat

SCHEDULES = ("constant", "linear", "cosine", "cosine_with_min_lr")


@dataclass(frozen=True)
class Controls:
    """The optimizer-step settings of a run, decided: what `adamw` builds from.

    Args:
        learning_rate: float. The peak learning rate.
        weight_decay: float. AdamW's decoupled decay.
        schedule: str. One of SCHEDULES.
        warmup_steps: int. Optimizer steps of linear warmup from 0.
        total_steps: int. The optimizer steps the run trains (the schedule's end).
        grad_accum: int. Micro-batches per optimizer step.
        max_grad_norm: float or None. Clip the gradients' global norm to this; None does not clip.
        min_lr_ratio: float. cosine_with_min_lr's floor, a fraction of the peak.
        plus_ratio: float or None. LoRA+: the B factors and DoRA's magnitudes learn at this many times the learning
            rate of the A factors (steps_fast_under_lora_plus).
        embedding_ratio: float or None. --add-tokens' embedding rows learn at this many times the learning rate
            (--embedding-lr over --lr); None: at the learning rate.
    """

    learning_rate: float
    weight_decay: float = 0.01
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    min_lr_ratio: float = 0.1
    plus_ratio: float | None = None
    embedding_ratio: float | None = None


def warmup_steps_for(total_steps: int, steps: int | None, ratio: float | None) -> int:
    """The warmup's optimizer steps: `steps`, or ceil(total x ratio) as transformers' TrainingArguments makes it."""
    if steps is not None:
        return steps
    return math.ceil(total_steps * ratio) if ratio else 0


def lr_factor(step: int, schedule: str, warmup: int, total: int, min_lr_ratio: float = 0.0) -> float:
    """transformers' lr_lambda at optimizer step `step`, in Python: what the history logs and tests compare."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    progress = (step - warmup) / max(1, total - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    floor = min_lr_ratio if schedule == "cosine_with_min_lr" else 0.0
    return max(0.0, factor * (1 - floor) + floor)


@keras.saving.register_keras_serializable(package="finetune")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A transformers schedule as a Keras one, fed the optimizer's micro-step count.

    Args:
        learning_rate: float. The peak.
        schedule: str. constant, linear, cosine or cosine_with_min_lr.
        warmup_steps: int. Linear warmup from 0, in optimizer steps.
        total_steps: int. The run's optimizer steps.
        grad_accum: int. Micro-steps per optimizer step: Keras counts micro-steps.
        min_lr_ratio: float. cosine_with_min_lr's floor.
    """

    def __init__(self, learning_rate, schedule, warmup_steps, total_steps, grad_accum=1, min_lr_ratio=0.0):
        self.learning_rate = learning_rate
        self.schedule = schedule
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.grad_accum = grad_accum
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, iterations):
        step = ops.cast(ops.floor_divide(iterations, self.grad_accum), "float32")
        warmup = float(self.warmup_steps)
        rising = step / max(1.0, warmup)
        if self.schedule == "constant":
            after = ops.ones_like(step)
        elif self.schedule == "linear":
            after = ops.maximum(0.0, (float(self.total_steps) - step) / max(1.0, self.total_steps - warmup))
        else:
            progress = (step - warmup) / max(1.0, self.total_steps - warmup)
            floor = self.min_lr_ratio if self.schedule == "cosine_with_min_lr" else 0.0
            cosine = 0.5 * (1.0 + ops.cos(math.pi * progress))
            after = ops.maximum(0.0, cosine * (1.0 - floor) + floor)
        return self.learning_rate * ops.where(step < warmup, rising, after)

    def at_step(self, step: int) -> float:
        """The learning rate of optimizer step `step` (from 0), as __call__ gives it at that step's updates."""
        factor = lr_factor(step, self.schedule, self.warmup_steps, self.total_steps, self.min_lr_ratio)
        return self.learning_rate * factor

    def get_config(self):
        return {
            "learning_rate": self.learning_rate,
            "schedule": self.schedule,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "grad_accum": self.grad_accum,
            "min_lr_ratio": self.min_lr_ratio,
        }


class Clipping:
    """A mixin for keras' AdamW: clips the global gradient norm as torch does, keeping the norm before clipping.

    Args:
        max_grad_norm: float or None. The largest global norm an update uses; None does not clip.
        **kwargs: keras.optimizers.AdamW's.
    """

    def __init__(self, max_grad_norm=None, **kwargs):
        super().__init__(**kwargs)
        self.max_grad_norm = max_grad_norm
        self.schedule = kwargs.get("learning_rate")

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        # An optimizer variable, so that JAX's stateless step returns it and a checkpoint keeps it.
        self.grad_norm = self.add_variable((), initializer="zeros", dtype="float32", name="grad_norm")

    def _clip_gradients(self, grads):
        squares = [ops.sum(ops.square(ops.cast(g, "float32"))) for g in grads if g is not None]
        norm = ops.sqrt(ops.sum(ops.stack(squares)))
        self.grad_norm.assign(norm)
        if not self.max_grad_norm:
            return grads
        scale = ops.minimum(1.0, self.max_grad_norm / (norm + 1e-6))
        return [g if g is None else g * ops.cast(scale, g.dtype) for g in grads]

    def get_config(self):
        return {**super().get_config(), "max_grad_norm": self.max_grad_norm}


@functools.cache
def clipped_adamw():
    """The class of the optimizer a run uses: Clipping on the backend's own AdamW.

    On PyTorch keras.optimizers.AdamW(...) makes an instance of a fused class of its
    own (one torch._foreach op per update step for every variable); a subclass of
    keras.optimizers.AdamW would not get it. __new__ alone tells which class that is,
    without making an optimizer (no variable, so nothing touches the devices early).
    """
    backend_adamw = type(keras.optimizers.AdamW.__new__(keras.optimizers.AdamW))
    return type("ClippedAdamW", (Clipping, backend_adamw), {})


def adamw(controls: Controls) -> Clipping:
    """The optimizer a run trains with, from its decided `controls`; biases and norm scales are not decayed."""
    schedule = WarmupSchedule(
        controls.learning_rate, controls.schedule, controls.warmup_steps, controls.total_steps,
        controls.grad_accum, controls.min_lr_ratio,
    )  # fmt: skip
    optimizer = clipped_adamw()(
        max_grad_norm=controls.max_grad_norm,
        learning_rate=schedule,
        weight_decay=controls.weight_decay,
        gradient_accumulation_steps=controls.grad_accum if controls.grad_accum > 1 else None,
    )
    # DoRA's magnitudes are per-output scales, kept from decay like the norms' (decay would shrink each output).
    optimizer.exclude_from_weight_decay(var_names=["bias", "scale", "lora_magnitude"])
    if controls.plus_ratio is not None:
        keras_compat.learning_rate_ratio(optimizer, steps_fast_under_lora_plus, controls.plus_ratio)
    if controls.embedding_ratio is not None:  # Unsloth's embedding_learning_rate, in one optimizer as LoRA+'s
        keras_compat.learning_rate_ratio(optimizer, tokens.is_rows, controls.embedding_ratio)
    return optimizer


def steps_fast_under_lora_plus(variable) -> bool:
    """Whether LoRA+ steps `variable` at the plus ratio times the learning rate, as PEFT's create_loraplus_optimizer
    sorts parameters: its fast group holds the B factors and every vector, DoRA's magnitudes among them. Its third
    group, LoRA factors of an embedding at their own rate, has nothing here: LoRA adapts no embedding (builder)."""
    expert_b = tuple(name for name in experts.FACTORS if name.endswith("_b"))  # the expert banks' B factors
    return variable.path.endswith(("lora_kernel_b", "lora_magnitude", *expert_b))


def step_record(optimizer, step: int) -> dict:
    """{learning_rate, grad_norm} of optimizer step `step` (from 0), just trained; {} for another optimizer."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # float16's loss-scaling wrapper
    if not isinstance(optimizer, Clipping):
        return {}
    schedule = optimizer.schedule
    return {
        "learning_rate": schedule.at_step(step) if isinstance(schedule, WarmupSchedule) else None,
        "grad_norm": float(ops.convert_to_numpy(optimizer.grad_norm.value)),
    }
