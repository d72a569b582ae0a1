"""Pretrain the tiny model's base weights: finetune/assets/tiny/weights.npz.

The tiny preset is a smoke test, but a base model of pure noise makes its
generations unreadable. This gives it a little language first: all weights
are trained as a plain causal LM on raw text from tools/make_sample_data.py
with a different seed (other names, numbers and choices than the shipped
finetune/assets/dolly-sample.jsonl), and no instruction template, so
following the template is still left for LoRA to learn. Weights are stored
as float16 to keep the file small; the run takes about a minute on a laptop
CPU.

usage: KERAS_BACKEND=jax python tools/make_tiny_weights.py [--epochs N]
"""

import argparse
import sys
from pathlib import Path

import keras
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import make_sample_data  # noqa: E402

from finetune.data import batching  # noqa: E402
from finetune.model import presets  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default=presets.TINY_WEIGHTS)
    args = parser.parse_args()

    keras.utils.set_random_seed(7)
    tokenizer = presets.tiny_tokenizer()
    texts = []
    for r in make_sample_data.make_records(args.records, seed=12345):
        texts.append("\n\n".join(t for t in (r["instruction"], r["context"], r["response"]) if t))
    examples, _ = batching.tokenize([("", t) for t in texts], tokenizer, args.seq_len, train_on_prompt=True)
    arrays = batching.pad(examples, args.seq_len)

    import keras_hub

    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=tokenizer.vocabulary_size(), **presets.TINY_CONFIG)
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    lm.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=3e-3, weight_decay=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
    )
    keras.Model.fit(lm, batching.Batches(arrays, 16, shuffle=True, seed=0), epochs=args.epochs, verbose=2)
    weights = {w.path: keras.ops.convert_to_numpy(w).astype(np.float16) for w in backbone.weights}
    np.savez_compressed(args.out, **weights)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} KiB, {backbone.count_params()} parameters)")


if __name__ == "__main__":
    main()
