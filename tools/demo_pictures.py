"""Generated pictures for the demo model's vision tower: shapes x colours x counts on a plain background.

`picture(seed)` is deterministic: one to four well-separated shapes (circle, square or triangle), all of one kind
and one of four colours, random sizes and positions, on a plain pale background, at a random size of 128..192 pixels
a side (the demo's preprocessor_config.json resizes any image into [128*128, 192*192] pixels: 16..36 image tokens
after the 2 x 2 merge, so each shape spans several 16-px patches). Its answer is the text the demo is trained to
say, e.g. "two red circles.".

Split by seed: training pictures use seeds [0, HELDOUT_SEED), held-out pictures seeds >= HELDOUT_SEED.

    python tools/demo_pictures.py --out /tmp/pics --n 8     # writes PNGs named after their answers
"""
from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220), "yellow": (235, 200, 0)}
COUNTS = ("one", "two", "three", "four")
MIN_SIDE, MAX_SIDE = 128, 192  # generated sides; the preprocessor's min/max pixels are MIN_SIDE**2 and MAX_SIDE**2
GAP_FRACTION, GAP_PIXELS = 0.3, 4  # shapes stay apart: centre distance > (r1 + r2) * 1.3 + 4 px
HELDOUT_SEED = 1_000_000  # seeds from here on are never trained on
QUESTIONS = ("What is in this picture?", "Describe the image.", "What do you see?", "What is in the image?",
             "What does this picture show?")


@dataclass(frozen=True)
class Picture:
    """A generated picture and what it shows."""

    image: Image.Image
    shape: str
    colour: str
    count: int

    @property
    def answer(self) -> str:
        """The answer text: "<count> <colour> <shape(s)>.", e.g. "two red circles."."""
        noun = self.shape if self.count == 1 else PLURALS[self.shape]
        return f"{COUNTS[self.count - 1]} {self.colour} {noun}."


def answer_fields(text: str) -> tuple[str, str, str] | None:
    """(count, colour, shape) words of an answer such as "two red circles." (plural folded to the shape name);
    None when the text is not of that form."""
    words = text.strip().rstrip(".").split()
    if len(words) != 3:
        return None
    singular = {v: k for k, v in PLURALS.items()}
    return words[0], words[1], singular.get(words[2], words[2])


def _outline(shape: str, cx: float, cy: float, r: float, turn: float) -> list[tuple[float, float]]:
    """Polygon points of a square or triangle of circumradius r centred at (cx, cy), rotated by `turn`."""
    if shape == "square":
        pts = [(math.pi / 4 + k * math.pi / 2, r) for k in range(4)]
    else:  # triangle
        pts = [(-math.pi / 2 + k * 2 * math.pi / 3, r) for k in range(3)]
    return [(cx + rr * math.cos(a + turn), cy + rr * math.sin(a + turn)) for a, rr in pts]


def picture(seed: int) -> Picture:
    """The picture of `seed` (same seed, same pixels): count, shape and colour uniform, sizes and positions random,
    no two shapes closer than GAP_FRACTION of their radii plus GAP_PIXELS (a bounded number of placement tries,
    shrinking the shapes when crowded)."""
    rng = random.Random(seed)
    shape, colour, count = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.randint(1, len(COUNTS))
    w, h = rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE)
    bg = tuple(rng.randint(225, 255) for _ in range(3))
    img = Image.new("RGB", (w, h), bg)
    draw = ImageDraw.Draw(img)
    side = min(w, h)
    scale = 1.0
    placed: list[tuple[float, float, float]] = []
    for _ in range(50):  # rounds of placement, each with smaller shapes
        placed = []
        for _ in range(count):
            for _ in range(200):
                r = rng.uniform(0.09, 0.2) * side * scale
                cx, cy = rng.uniform(r + 1, w - r - 1), rng.uniform(r + 1, h - r - 1)
                if all(math.hypot(cx - x, cy - y) > (r + rr) * (1 + GAP_FRACTION) + GAP_PIXELS for x, y, rr in placed):
                    placed.append((cx, cy, r))
                    break
        if len(placed) == count:
            break
        scale *= 0.9
    fill = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLOURS[colour])
    for cx, cy, r in placed:
        if shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        else:
            turn = rng.uniform(-0.3, 0.3) if shape != "square" else rng.uniform(0, math.pi / 2)
            draw.polygon(_outline(shape, cx, cy, r, turn), fill=fill)
    return Picture(img, shape, colour, len(placed))


def split(name: str, n: int, start: int = 0) -> range:
    """Seeds of the `train` or `heldout` split: n of them from `start` within the split."""
    base = {"train": 0, "heldout": HELDOUT_SEED}[name]
    if name == "train" and start + n > HELDOUT_SEED:
        raise ValueError(f"training seeds must stay below {HELDOUT_SEED}")
    return range(base + start, base + start + n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--split", choices=("train", "heldout"), default="heldout")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for seed in split(args.split, args.n):
        p = picture(seed)
        p.image.save(out / f"{seed}-{p.answer.rstrip('.').replace(' ', '-')}.png")
        print(seed, p.answer)


if __name__ == "__main__":
    main()
