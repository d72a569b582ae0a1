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
    from finetune.model import distribution

    replicas = distribution.data_replicas()
    padded = prompts + [prompts[-1]] * (-len(prompts) % replicas)
    with preprocessor_attached(lm, preprocessor):
        outputs = lm.generate(padded, max_length=longest + max_new_tokens, stop_token_ids=stop_ids)
    if isinstance(outputs, str):
        outputs = [outputs]
    outputs = outputs[: len(prompts)]
    return [out[len(p) :] if out.startswith(p) else out for p, out in zip(prompts, outputs)]


class HeldOut:
    """The records a run holds out: metrics over them, and generations on the first few's prompts (samples.md).

    Args:
        scorer: keras.Model. builder.scorer() of the run's model.
        batches: batching.Batches. The held-out rows, one record each.
        model: builder.Model. The run's model: its causal LM and preprocessor generate the samples.
        samples: list of data.Record. The held-out records to generate for; their responses are the references.
        template: templates.Template. Puts each sample's prompt in the run's format.
        max_new_tokens: int. The longest generation.
    """

    def __init__(self, scorer, batches, model, samples, template, max_new_tokens: int):
        self.scorer = scorer
        self.batches = batches
        self.lm = model.lm
        self.preprocessor = model.preprocessor
        self.samples = samples
        self.prompts = [template.sample_prompt(r) for r in samples]
        self.stop_tokens = template.stop_tokens
        self.max_new_tokens = max_new_tokens

    def metrics(self) -> dict:
        """Per-token loss, perplexity and accuracy over the held-out records, as the model stands."""
        return metrics(self.scorer, self.batches)

    def generate(self, when: str, phase=print) -> list[str]:
        """The samples' generations as the model stands; `when` (before, after) names the phase in the log."""
        if self.prompts:
            phase(f"generating {len(self.prompts)} samples {when} training")
        return generate(self.lm, self.preprocessor, self.prompts, self.max_new_tokens, self.stop_tokens)

    def sample_rows(self, before: list[str], after: list[str]) -> list[dict]:
        """samples.md's rows (outputs.write_samples)."""
        return [
            {"prompt": p, "reference": r.response, "before": b, "after": a}
            for p, r, b, a in zip(self.prompts, self.samples, before, after)
        ]
