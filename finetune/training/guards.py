"""The checks that a run which trained without an error did not fail silently, each said with its reason.

The most reported failure of fine-tuning a new Gemma is a run that "trains" and learns nothing (transformers
#45242, unsloth #5230, unsloth-zoo #813): no NaN, no error, an adapter that is all zeros or a model that never
saw its weights. Three checks here read what a run already measured:

- broken_forward: a pretrained model whose held-out loss before training is near ln(vocabulary size), the loss of
  a uniform guess, is not computing what it was trained to.
- adapter_unchanged: at the end of a run, every LoRA B factor still exactly 0 (keras-hub starts them so) or the
  held-out loss the same before and after means the adapter changes nothing.
- held_out_worse: the published adapter scores its held-out records worse than the base did before training.

The third, float16 on Gemma 3, 3n and 4, is a rule of --precision auto (backend.precision_rule).
"""

from __future__ import annotations

import math

BROKEN_FORWARD_MARGIN = 0.1
"""A first held-out loss within this share of ln(vocabulary size), or above it, is a broken forward."""
LOSS_DIGITS = 4
"""The held-out loss's digits as the summary prints it: equal to these, before and after, it did not change."""


def broken_forward(loss: float, vocabulary_size: int) -> str | None:
    """The warning for a pretrained model whose held-out loss before training, `loss` (token cross-entropy), is
    within 10% of ln(vocabulary_size) or above it; None otherwise.

    A pretrained Gemma scores about 1 to 3 on text it can read; ln(262,144) = 12.5 is what a model that guesses
    every token uniformly scores, so a loss near it says the forward computes nothing learned.
    """
    uniform = math.log(vocabulary_size)
    if not math.isfinite(loss) or loss < (1 - BROKEN_FORWARD_MARGIN) * uniform:
        return None
    return (
        f"the held-out loss before training, {loss:.4f}, is within {BROKEN_FORWARD_MARGIN:.0%} of "
        f"ln({vocabulary_size:,}) = {uniform:.4f} or above it, what a uniform guess scores: a pretrained model this "
        "far off computes nothing it learned. Likely causes: the weights were not loaded (a preset or checkpoint "
        "with random or missing weights), the wrong tokenizer or chat template for this model (--template), or a "
        "precision overflow (float16 on Gemma 3, 3n or 4: try --precision float32)"
    )


def b_factors_all_zero(backbone) -> bool:
    """Whether every LoRA B factor of `backbone` is still exactly 0, as keras-hub's enable_lora starts them: the
    adapter adds nothing to any layer. False under DoRA, whose magnitude changes the layer on its own."""
    import numpy as np

    from finetune.model import builder
    from finetune.training import adapter

    layers = adapter.layers_with_weights(backbone)
    adapted = [layers[index] for index in getattr(backbone, "_lora_enabled_layers", ())]
    if not adapted:  # --full: no LoRA; the held-out loss alone says whether the model changed
        return False
    if any(hasattr(layer, adapter.MAGNITUDE) for layer in adapted):
        return False
    b_factors = [getattr(layer, name) for layer in adapted for name in builder.lora_weight_names(layer)
                 if name.endswith("_b")]  # fmt: skip
    return all(not np.any(np.asarray(b.numpy())) for b in b_factors)


def adapter_unchanged(zero_b: bool, before: float | None, after: float | None, rows: list, response_tokens: int,
                      learning_rate: float) -> str | None:  # fmt: skip
    """Why the adapter did not change, and what may have caused it; None when it changed.

    zero_b: bool. b_factors_all_zero of the published adapter.
    before, after: the held-out loss before training and of the published adapter; None where nothing was held out.
    rows: the loop's rows (loop.Progress.rows) of the steps trained, each with the learning_rate and grad_norm it
        applied where known.
    response_tokens: int. The tokens the loss was taken on, over every step trained.
    learning_rate: float. The run's peak learning rate (--lr).
    """
    same = before is not None and after is not None and round(before, LOSS_DIGITS) == round(after, LOSS_DIGITS)
    if not (zero_b or same):
        return None
    seen = "every LoRA B factor is still exactly 0" if zero_b else f"the held-out loss is {after:.4f} before and after"
    causes = []
    if not rows:
        causes.append("the run trained 0 steps")
    elif all(row.get("learning_rate") == 0 for row in rows):
        causes.append("every step trained at learning rate 0 (a warm-up's first step is at 0: --max-steps within "
                      "--warmup-steps)")  # fmt: skip
    if rows and response_tokens == 0:
        causes.append("every token was masked out of the loss (no response tokens: check the template and data)")
    elif rows and all(row.get("grad_norm") == 0 for row in rows):
        causes.append("every gradient was 0 (every token masked out of the loss?)")
    if not causes:
        causes.append(f"a learning rate too small to move it (--lr {learning_rate:g}), too few steps, or every token "
                      "masked out of the loss")  # fmt: skip
    return f"{seen}: {'; '.join(causes)}"


def held_out_worse(
    before: float | None, after: float | None, best_step: int | None, learning_rate: float
) -> str | None:
    """Why to doubt an adapter whose held-out loss, `after`, is above the base's before training, `before`, to the
    digits the summary prints; None otherwise or where nothing was held out.

    best_step: int or None. With --keep-best, the step of the published (best) evaluation: even it is worse.
    """
    if before is None or after is None or round(after, LOSS_DIGITS) <= round(before, LOSS_DIGITS):
        return None
    which = "the adapter" if best_step is None else f"even the best evaluation's adapter (step {best_step})"
    fix = "" if best_step is not None else ", or --eval-every N with --keep-best to publish the best evaluation"
    return (
        f"the held-out loss rose in training, {before:.4f} -> {after:.4f}: {which} scores the held-out records "
        f"worse than the base did. Likely causes: a learning rate too high (--lr {learning_rate:g}), too many "
        f"epochs (overfitting), or held-out records unlike the training data; try a lower --lr or fewer "
        f"--epochs{fix}"
    )
