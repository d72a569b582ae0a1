"""SFT (methods/supervised.py): its held-out score over the response tokens alone."""

import keras
import numpy as np
from conftest import float32_policy

from finetune.config import LoraConfig
from finetune.data import batching
from finetune.methods import supervised
from finetune.model import builder, presets
from finetune.platform import backend


def test_loss_is_averaged_over_response_tokens_only():
    backend.set_seed(0)
    with float32_policy():  # compared with a float64 computation below
        lm, preprocessor = builder.build(presets.Source("tiny", "tiny", "gemma"), seq_len=48)
    builder.enable_lora(lm, LoraConfig(rank=2, targets=["query", "value"]))
    pairs = [
        ("Instruction:\nA long prompt about " + "many things " * i + "\n\nResponse:\n", "Short.") for i in range(5)
    ]
    examples, _ = batching.tokenize(pairs, preprocessor.tokenizer, seq_len=48)
    arrays = batching.pad(examples, 48)
    result = supervised.scores(builder.scorer(lm, 2), batching.Batches(arrays, batch_size=2))  # a ragged last batch

    out = keras.ops.convert_to_numpy(lm({"token_ids": arrays["token_ids"], "padding_mask": arrays["padding_mask"]}))
    shifted = out - out.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, arrays["labels"][..., None], axis=-1)[..., 0]
    w = arrays["weights"]
    expected = float((nll * w).sum() / w.sum())
    correct = (out.argmax(-1) == arrays["labels"]).astype(np.float32)

    np.testing.assert_allclose(result["loss"], expected, rtol=1e-4)
    np.testing.assert_allclose(result["accuracy"], float((correct * w).sum() / w.sum()), rtol=1e-4)
    np.testing.assert_allclose(result["perplexity"], np.exp(expected), rtol=1e-3)
    # Keras' default reduction would have divided by every position, padding included.
    assert abs(expected - float((nll * w).sum() / w.size)) > 0.5
    # And an unweighted mean over the real tokens would have counted the prompts.
    assert abs(expected - float(nll[arrays["padding_mask"]].mean())) > 1e-3
