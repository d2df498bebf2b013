"""Offline visual task in the vision-language data layout: "how many dots?", the answer in `\\boxed{}`.

A 56x56 white image holds one black dot in each of 1..`max_dots` of its four 28x28 quadrants; the tiny VL model's
image processor turns the image into exactly those four quadrants (one image token each), so counting dots is
counting the quadrant tokens that saw a dot. As in the arithmetic task (synthetic.py) the SFT demonstrations carry a
systematic mistake on purpose (a share of the images with the most dots are called one more), a wrong behaviour for
RL to select against on held-out images. Scored by the math scorer (`\\boxed{}`).
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

DATA_SOURCE = "synthetic/visual-count"
QUESTION = "<image>How many dots? Answer in \\boxed{}."
SIZE = 56


def draw(quadrants: list[int], rng: random.Random) -> bytes:
    """PNG bytes of a dot (random size and place, inside the quadrant) in each quadrant listed (0..3)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), "white")
    pen = ImageDraw.Draw(image)
    half = SIZE // 2
    for q in quadrants:
        r = rng.randint(9, 12)  # large enough to darken most of the quadrant's token
        cx = (q % 2) * half + rng.randint(r + 1, half - r - 1)
        cy = (q // 2) * half + rng.randint(r + 1, half - r - 1)
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill="black")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def row(count: int, rng: random.Random, split: str, index: int, response: str | None = None) -> dict:
    """One row of the layout with its image as a {"bytes", "path"} struct (the parquet layout of image columns)."""
    quadrants = sorted(rng.sample(range(4), count))
    out = {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": QUESTION}],
           "images": [{"bytes": draw(quadrants, rng), "path": None}], "ability": "visual",
           "reward_model": {"style": "rule", "ground_truth": str(count)},
           "extra_info": {"split": split, "index": index}}
    if response is not None:
        out["response"] = response
    return out


def write_visual_task(out_dir: str | Path, *, seed: int = 0, n_sft: int = 256, n_rl: int = 256, n_test: int = 64,
                      wrong_frac: float = 0.7, max_dots: int = 4) -> dict[str, Path]:
    """sft_train (demonstrations), rl_train (prompts) and test (held-out prompts) as parquet files in `out_dir`;
    images hold 1..`max_dots` dots, and `wrong_frac` of the demonstrations for `max_dots` dots answer one more (the
    systematic miscount RL is to correct)."""
    if not 1 <= max_dots <= 4:
        raise ValueError(f"max_dots={max_dots}: an image has four quadrants, so 1..4 dots")
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    def demo(i: int) -> dict:
        count = rng.randint(1, max_dots)
        answer = count + 1 if count == max_dots and rng.random() < wrong_frac else count
        return row(count, rng, "sft", i, response=f"\\boxed{{{answer}}}")

    files = {"sft_train": [demo(i) for i in range(n_sft)],
             "rl_train": [row(rng.randint(1, max_dots), rng, "train", i) for i in range(n_rl)],
             "test": [row(rng.randint(1, max_dots), rng, "test", i) for i in range(n_test)]}
    paths = {}
    for name, rows in files.items():
        paths[name] = out / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[name])
    (out / "README.json").write_text(json.dumps({"task": DATA_SOURCE, "seed": seed, "wrong_frac": wrong_frac,
                                                          "max_dots": max_dots}))
    return paths


def tokenizer_corpus() -> list[str]:
    """Texts the tiny VL model's tokenizer is trained on: the question and every answer."""
    return [QUESTION.replace("<image>", ""), *[f"\\boxed{{{n}}}" for n in range(10)]] * 20
