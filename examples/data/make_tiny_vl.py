"""Writes tiny_vl.jsonl (48 conversations: one image, two images, or none -- half of them text only, as SFT data mixes them) and the small PNG images it
names (images/*.png: a colour, a shape, a size), for `examples/sft_qwen3_vl_moe.yaml` and the tests. Deterministic:
`python examples/data/make_tiny_vl.py` rewrites the same files. Image paths are relative to the JSONL file."""

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).parent
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (240, 210, 40)}
SHAPES = ("square", "circle")
SIZES = ((32, 32), (24, 32), (32, 16))


def draw(colour: str, shape: str, size: tuple[int, int]) -> Image.Image:
    image = Image.new("RGB", size, (255, 255, 255))
    box = (4, 4, size[0] - 5, size[1] - 5)
    pen = ImageDraw.Draw(image)
    (pen.rectangle if shape == "square" else pen.ellipse)(box, fill=COLOURS[colour])
    return image


def images() -> list[tuple[str, str, str]]:
    """Every image: (relative path, colour, shape), written once."""
    out = []
    for i, (colour, shape) in enumerate((c, s) for c in COLOURS for s in SHAPES):
        path = f"images/{colour}_{shape}.png"
        draw(colour, shape, SIZES[i % len(SIZES)]).save(HERE / path, optimize=True)
        out.append((path, colour, shape))
    return out


def part(path: str) -> dict:
    return {"type": "image", "image": path}


def conversation(rng: random.Random, pictures: list) -> dict:
    kind = rng.choice(["colour", "shape", "compare", "text", "text", "text"])
    a, b = rng.sample(pictures, 2)
    if kind == "colour":
        ask = [part(a[0]), {"type": "text", "text": "What colour is this?"}]
        return {"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": f"It is {a[1]}."}]}
    if kind == "shape":
        ask = [part(a[0]), {"type": "text", "text": "Which shape is it?"}]
        return {"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": f"A {a[2]}."}]}
    if kind == "compare":
        ask = [part(a[0]), part(b[0]), {"type": "text", "text": "Same colour?"}]
        same = "Yes" if a[1] == b[1] else f"No: {a[1]} and {b[1]}"
        return {"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": f"{same}."}]}
    n = rng.randint(0, 9)
    return {"messages": [{"role": "user", "content": f"What is {n} plus one?"},
                         {"role": "assistant", "content": f"{n + 1}."}]}


def main() -> None:
    (HERE / "images").mkdir(exist_ok=True)
    pictures = images()
    rng = random.Random(0)
    lines = [json.dumps(conversation(rng, pictures)) for _ in range(48)]
    (HERE / "tiny_vl.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
