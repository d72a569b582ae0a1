"""Supervised fine-tuning (SFT): the cross-entropy of the response tokens, over records of a prompt and a response.

Records become Examples in the run's template (pictures written as the
family's image tokens), are split, and train packed several to a row or padded
one to a row (data/packing.py, data/batching.py). The held-out score is the
mean loss and accuracy over every held-out response token (builder.scorer).
"""

from __future__ import annotations

import math

import numpy as np

from finetune.data import batching, templates
from finetune.methods import prepare
from finetune.methods.method import Method


class Supervised(Method):
    name = "sft"
    title = "SFT"
    why = "supervised: the response tokens' cross-entropy"
    prompt_loss = True

    def objective(self, train):
        from finetune.model import objective  # keras: imported once the backend is chosen

        return objective.ResponseTokens()

    def prepare(self, records, preprocessor, cfg, *, packed=None, probe=None, every_record_of=None):
        seq_len = cfg.model.seq_len
        template = templates.get(cfg.data.template)
        prepare.check_seq_len(prepare.tokenizer_of(preprocessor), template, seq_len)
        usable = self.usable_examples(records, template, preprocessor, cfg, every_record_of or cfg.data.path)
        batch_size, why = cfg.train.batch_size, None
        if batch_size == "auto":
            tokenized = [e for _, e in usable]
            # With --grad-accum K a step takes K micro-batches: the probe sizes one, for steps enough of K.
            rows = prepare.row_count(tokenized, seq_len, packed) // cfg.train.grad_accum
            trial = batching.pad(tokenized[:64], seq_len)

            def batch_of(size, names):
                return batching.inputs(trial, np.arange(size), 1, batching.target_width(trial, size), names=names)

            batch_size, why = probe(batch_of, rows)
            print(f"batch size auto: {batch_size} ({why})")
        train, held_out = prepare.split(usable, cfg, every_record_of)
        prepared = prepare.Prepared(template, train, held_out, batch_size,
                                    batching.pad([e for _, e in held_out], seq_len))  # fmt: skip
        prepared.batch_size_why = why
        if packed is not None:
            prepared.rows, prepared.padding = prepare.training_rows(train, batch_size, seq_len, packed)
            prepared.packed = packed
        return prepared

    def evaluated_on(self, prepared, records, preprocessor, cfg):
        held_out = self.usable_examples(records, prepared.template, preprocessor, cfg, cfg.eval.data)
        prepared.held_out = held_out
        prepared.held_out_rows = batching.pad([e for _, e in held_out], cfg.model.seq_len)
        return prepared

    def usable_examples(self, records, template, preprocessor, cfg, source: str) -> list:
        """(record, Example) of each usable record of `source`, in `template`, pictures included."""
        return prepare.pictured_examples(records, template, preprocessor, cfg, source)

    def order(self, prepared, cfg, feed, model=None):
        return batching.TrainOrder(prepared.rows, prepared.batch_size, cfg.train.seed, feed, cfg.train.grad_accum)

    def held_out_scores(self, model, rows, batch_size: int, feed, shards: int = 1):
        from finetune.model import builder

        scorer = builder.scorer(model.lm, batch_size, shards=shards)
        batches = batching.Batches(rows, batch_size, feed)
        return lambda after_batch=None: scores(scorer, batches, after_batch)

    def evaluate(self, lm, cfg, rows, directory=None) -> dict:
        from finetune.model import builder

        batches = batching.Batches(rows, cfg.train.batch_size, batching.Feed(inputs=builder.input_names(lm)))
        return scores(builder.scorer(lm, cfg.train.batch_size), batches)


def scores(scorer, batches, after_batch=None) -> dict:
    """Per-token loss, perplexity and accuracy over the weighted tokens of `batches` (batching.Batches), by
    `scorer` (builder.scorer)."""
    import keras

    # after_batch: a run's stop check (loop.check_stop), after each compiled batch.
    hooks = [keras.callbacks.LambdaCallback(on_test_batch_end=lambda batch, logs: after_batch())] if after_batch else []
    logs = scorer.evaluate(batches, verbose=0, return_dict=True, callbacks=hooks)
    # Keras names each output's metric after the output: loss_token_loss, correct_token_accuracy.
    loss = float(next(v for k, v in logs.items() if k.endswith("token_loss")))
    accuracy = float(next(v for k, v in logs.items() if k.endswith("token_accuracy")))
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": accuracy}


SFT = Supervised()
