"""Write a small learnable picture task: 32x32 squares of four colours, each record asking for its square's colour.

Each square's colour is jittered (each channel +-30), so the held-out pictures are not the training ones. The
records are in TRL's form, one picture each; chance is 1 in 4. docs/images.md gives what tiny-gemma3-vision learns
from it.

usage: python tools/make_picture_task.py [OUT_DIR] [--train N] [--test N] [--seed S]
then:  finetune gemma --preset tiny-gemma3-vision --data OUT_DIR/train.jsonl --eval-data OUT_DIR/test.jsonl \\
           --eval-fraction 0 --seq-len 64 --batch-size 8 --max-steps 200
       python tools/make_picture_task.py OUT_DIR --score RUN   (greedy answers to the held-out pictures)
"""

import argparse
import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}
QUESTION = "Colour?"


def write(folder: Path, name: str, count: int, rng: random.Random) -> None:
    from PIL import Image

    names = list(COLOURS)
    with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as f:
        for index in range(count):
            colour = names[index % len(names)]
            rgb = tuple(max(0, min(255, c + rng.randint(-30, 30))) for c in COLOURS[colour])
            picture = f"{name}-{index}.png"
            Image.new("RGB", (32, 32), rgb).save(folder / picture)
            question = [{"type": "image"}, {"type": "text", "text": QUESTION}]
            answer = [{"type": "text", "text": colour}]
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages, "images": [picture]}) + "\n")


def score(folder: Path, run: str) -> None:
    """Print how many held-out pictures the run's model names the colour of, greedily."""
    import finetune

    records = [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()]
    right = 0
    for record in records:
        (answer,) = finetune.generate(run, QUESTION, images=[str(folder / record["images"][0])], max_new_tokens=4)
        right += answer.strip().startswith(record["messages"][1]["content"][0]["text"])
    print(f"{right} of {len(records)} held-out pictures named right (chance: {len(records) / len(COLOURS):g})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="pictures")
    parser.add_argument("--train", type=int, default=96)
    parser.add_argument("--test", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--score", metavar="RUN", help="score RUN on OUT's held-out pictures instead of writing")
    args = parser.parse_args()
    folder = Path(args.out)
    if args.score:
        score(folder, args.score)
        return
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    write(folder, "train", args.train, rng)
    write(folder, "test", args.test, rng)
    print(f"wrote {args.train} training and {args.test} held-out pictures to {folder}")


if __name__ == "__main__":
    main()
