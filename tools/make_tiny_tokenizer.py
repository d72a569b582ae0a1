"""Train a tiny model's SentencePiece tokenizer on finetune/assets/dolly-sample.jsonl.

The result ships as finetune/assets/<preset>/tokenizer.spm: `tiny` (and
`tiny-gemma3`, which reads the same file through Gemma 3's tokenizer class),
`tiny-gemma4` (and `tiny-gemma4-moe`), `tiny-gemma3n` (and `tiny-gemma3n-vision`),
`tiny-gemma3-vision` (Gemma 3's text tokens plus its image tokens), `tiny-gemma4-vision`
(Gemma 4's plus its image tokens) and `tiny-gemma4-audio` (Gemma 4's plus its audio tokens). Each keeps Gemma's
special-token layout (<pad>=0, <eos>=1, <bos>=2, <unk>=3, then the family's
own special tokens: its chat turn markers, and for Gemma 3n the multimodal
tokens its tokenizer class requires) and Gemma's text handling (no dummy
prefix, no whitespace folding, byte fallback), so keras_hub's tokenizer of
the family treats it exactly like the real one and any UTF-8 text round-trips.

The tiny base weights are trained on its ids: after changing tiny's, rerun
tools/make_tiny_weights.py.

usage: python tools/make_tiny_tokenizer.py [DATA.jsonl] [OUT.spm] [--vocab N] [--family gemma|gemma4|gemma3n|gemma3-vision|gemma4-vision|gemma4-audio]
"""

import argparse
import io
import json
from pathlib import Path

import sentencepiece as spm

HERE = Path(__file__).resolve().parent.parent
# Each family's special tokens, after <pad> <eos> <bos> <unk>: what its keras-hub tokenizer looks up.
SPECIAL = {
    "gemma": ["<start_of_turn>", "<end_of_turn>"],
    "gemma4": ["<|turn>", "<turn|>"],
    # Gemma 3's image tokens: the preprocessor expands <start_of_image> into <img> soft tokens between them.
    "gemma3-vision": ["<start_of_turn>", "<end_of_turn>", "<img>", "<start_of_image>", "<end_of_image>"],
    # Gemma 4's: its preprocessor expands its soft token <|image|> into <|image>, the soft tokens, then <image|>.
    "gemma4-vision": ["<|turn>", "<turn|>", "<|image>", "<|image|>", "<image|>"],
    # Gemma 4's audio tokens: its preprocessor expands <|audio|> into <|audio>, a clip's soft tokens, then <audio|>.
    "gemma4-audio": ["<|turn>", "<turn|>", "<|audio>", "<|audio|>", "<audio|>"],
    "gemma3n": [
        "<start_of_turn>", "<end_of_turn>", "<image_soft_token>", "<audio_soft_token>", "<start_of_image>",
        "<end_of_image>", "<start_of_audio>", "<end_of_audio>", "<mask>", "[multimodal]",
    ],
}  # fmt: skip
DEFAULT_OUT = {
    "gemma": "tiny",
    "gemma4": "tiny-gemma4",
    "gemma3n": "tiny-gemma3n",
    "gemma3-vision": "tiny-gemma3-vision",
    "gemma4-vision": "tiny-gemma4-vision",
    "gemma4-audio": "tiny-gemma4-audio",
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="?", default=HERE / "finetune" / "assets" / "dolly-sample.jsonl")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--family", choices=sorted(SPECIAL), default="gemma")
    args = parser.parse_args()
    args.out = args.out or HERE / "finetune" / "assets" / DEFAULT_OUT[args.family] / "tokenizer.spm"

    texts = []
    with open(args.data, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            texts += [record["instruction"], record["context"], record["response"]]
    # The template words, so that prompts tokenize into few pieces.
    texts += [
        "Instruction:\n",
        "Context:\n",
        "Response:\n",
        "### Instruction:\n",
        "### Input:\n",
        "### Response:\n",
        "user\n",
        "model\n",
    ] * 50
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(t for t in texts if t),
        model_writer=model,
        vocab_size=args.vocab,
        model_type="unigram",
        character_coverage=1.0,
        byte_fallback=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        split_digits=True,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=SPECIAL[args.family],
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(model.getvalue())
    print(f"wrote {args.out} ({len(model.getvalue())} bytes)")


if __name__ == "__main__":
    main()
