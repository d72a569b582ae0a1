"""Measure a short run at gemma3_4b's dims with one 896x896 picture an example, and print `finetune plan`'s for it.

There are no weights here, so the model is gemma3_4b's architecture (finetune/model/archs.py: the decoder and
its SigLIP encoder) built in place of tiny-gemma3-vision's model, with the real vocabulary (262,144) so that the
embedding and the logits cost what they do, and tiny-gemma3-vision's tokenizer, which has Gemma 3's image
tokens. The float weights start as zeros (a random draw of four billion weights takes minutes on 2 cores and
holds the same bytes); a quantized base's codes and scales are drawn (quantized.fill_random), as `finetune bench`
does. The run is `finetune gemma`'s, through finetune.run: the records read and their pictures converted, the
rows made, the loop's steps, and metrics.json's peak resident memory.

usage: python tools/vision_peak.py OUT_DIR [--backend torch] [--seq-len 384] [--precision float32]
           [--quantize int8] [--steps 2] [--threads 2]
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

PRESET = "gemma3_4b"


def pictures(folder: Path, count: int) -> Path:
    """`count` records in TRL's form, each with one 896x896 picture of noise."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(folder / "pictures.jsonl", "w", encoding="utf-8") as f:
        for index in range(count):
            name = f"{index}.png"
            Image.fromarray(rng.integers(0, 256, (896, 896, 3), dtype=np.uint8)).save(folder / name)
            question = [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]
            answer = [{"type": "text", "text": "Noise, in every colour, from edge to edge."}]
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages, "images": [name]}) + "\n")
    return folder / "pictures.jsonl"


def gemma3_4b_base(source, seq_len: int, dtype=None, quantize=None):
    """builder.load_base's result for gemma3_4b's architecture: (causal LM without preprocessor, preprocessor)."""
    import keras
    import keras_hub

    from finetune.model import archs, builder, layouts, presets, quantized

    arch = archs.ARCHS[PRESET]
    policy = dtype or keras.config.dtype_policy().name
    if quantize is not None:
        dims = layouts.Dims.from_backbone_config(arch.config, arch.family)
        policy = quantized.policies(policy, quantize, layouts.rules_for(dims))
    with builder.zeros_until_loaded():
        encoder = keras_hub.models.Gemma3VisionEncoder(**arch.vision)
        backbone = keras_hub.models.Gemma3Backbone(
            **arch.config, image_size=arch.vision["image_size"], vision_encoder=encoder,
            use_sliding_window_attention=True, sliding_window_size=1024, dtype=policy,
        )  # fmt: skip
    if quantize is not None:
        quantized.weights_only(backbone)
        quantized.fill_random(backbone)
    size = arch.vision["image_size"]
    preprocessor = keras_hub.models.Gemma3CausalLMPreprocessor(
        tokenizer=presets.tiny_tokenizer("tiny-gemma3-vision"),
        image_converter=keras_hub.layers.Gemma3ImageConverter(image_size=(size, size), scale=1 / 127.5, offset=-1.0),
        num_vision_tokens_per_image=archs.tokens_per_image(arch.vision),
        sequence_length=1024,  # its constructor wants room for max_images_per_prompt pictures; from_preset's has it
    )
    preprocessor.sequence_length = seq_len  # as builder.load_base sets a preset's
    return keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=None), preprocessor


def measure(args) -> float:
    """The run's peak resident memory in MiB (metrics.json's peak_memory_mb)."""
    import finetune
    from finetune.model import presets
    from finetune.platform import backend

    # As `finetune gemma` does before keras loads: the backend, and the frameworks the family needs (TensorFlow
    # for Gemma 3's preprocessor) kept, the others left out.
    backend.select(args.backend, 1.0, presets.frameworks_needed("tiny-gemma3-vision"))
    from finetune.model import builder

    builder.load_base = gemma3_4b_base  # build() calls it by name: the tiny preset's model becomes gemma3_4b's
    data = pictures(args.out / "data", args.steps)
    settings = {
        "backend": args.backend,
        "model": {"preset": "tiny-gemma3-vision", "seq_len": args.seq_len, "precision": args.precision,
                  "quantize": args.quantize, "remat": "off"},
        "lora": {"rank": 4},
        "data": {"path": str(data), "eval_fraction": 0.0},
        "train": {"batch_size": 1, "max_steps": args.steps, "samples": 0, "threads": args.threads},
        "output": {"dir": str(args.out / "run"), "overwrite": True},
    }  # fmt: skip
    return finetune.run(settings)["peak_memory_mb"]


def planned(args) -> str:
    command = [sys.executable, "-m", "finetune", "plan", "--preset", PRESET, "--images", "1", "--seq-len", str(args.seq_len),
               "--batch-size", "1", "--precision", args.precision, "--backend", args.backend,
               "--device-memory", "cpu", "--remat", "off"]  # fmt: skip
    if args.quantize:
        command += ["--quantize", args.quantize]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode not in (0, 3):  # 3: printed, and does not fit this host
        raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.quantize = args.quantize or None
    table = planned(args)
    print(table, flush=True)
    peak = measure(args) * 2**20
    total = next(line for line in table.splitlines() if line.strip().startswith("total"))
    plan = float(total.split()[-2]) * (2**30 if total.endswith("GiB") else 2**20)
    print(f"measured peak {peak / 2**30:.2f} GiB ({peak / 2**20:,.0f} MiB); plan {plan / 2**30:.2f} GiB; "
          f"plan - measured {plan / peak - 1:+.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
