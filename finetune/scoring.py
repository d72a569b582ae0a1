"""Held-out metrics over response tokens, and greedy generations.

Loss and accuracy come from the weighted metrics of model.scorer(): each
accumulates sum(weight * value) / sum(weight) over every held-out gathered
position, so padding and prompt positions (weight 0) never enter the average,
and a ragged last batch's filler rows neither.
"""

from __future__ import annotations

import contextlib
import math


def metrics(scorer, batches) -> dict:
    """Per-token loss, perplexity and accuracy over the weighted tokens of `batches`."""
    logs = scorer.evaluate(batches, verbose=0, return_dict=True)
    # Keras names each output's metric after the output: loss_token_loss, correct_token_accuracy.
    loss = float(next(v for k, v in logs.items() if k.endswith("token_loss")))
    accuracy = float(next(v for k, v in logs.items() if k.endswith("token_accuracy")))
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": accuracy}


@contextlib.contextmanager
def preprocessor_attached(lm, preprocessor):
    """generate() takes strings, so it needs the preprocessor that fit() must not see."""
    lm.preprocessor = preprocessor
    try:
        yield lm
    finally:
        lm.preprocessor = None


def generate(lm, preprocessor, prompts: list[str], max_new_tokens: int, stop_tokens=("<eos>",)) -> list[str]:
    """Greedy continuations of `prompts`, without the prompt text."""
    if not prompts:
        return []
    tokenizer = preprocessor.tokenizer
    longest = max(len(tokenizer.tokenize(p)) for p in prompts) + 1  # + <bos>
    stop_ids = tuple(tokenizer.token_to_id(t) for t in stop_tokens)
    # Under a distribution the prompts are split over the data axis, which must divide their count.
    from finetune import distribution

    replicas = distribution.data_replicas()
    padded = prompts + [prompts[-1]] * (-len(prompts) % replicas)
    with preprocessor_attached(lm, preprocessor):
        outputs = lm.generate(padded, max_length=longest + max_new_tokens, stop_token_ids=stop_ids)
    if isinstance(outputs, str):
        outputs = [outputs]
    outputs = outputs[: len(prompts)]
    return [out[len(p) :] if out.startswith(p) else out for p, out in zip(prompts, outputs)]
