"""Offline arithmetic task in the GSM8K layout (`#### N` answers, scored by the GSM8K scorer).

The SFT demonstrations are deliberately mixed: a share of them add without carrying. SFT then leaves a competing
wrong behaviour that greedy decoding prefers, and RL has something to select against — the improvement it brings
is measurable on held-out problems with clean answers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .dataset import layout_row

DATA_SOURCE = "synthetic/arithmetic"


def add_without_carry(a: int, b: int) -> int:
    """Digit-wise (a_i + b_i) mod 10: the answer of someone who forgets every carry."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def rl_row(a: int, b: int, split: str, index: int) -> dict:
    return layout_row(DATA_SOURCE, prompt_text(a, b), str(a + b), {"split": split, "index": index})


def sft_row(a: int, b: int, rng: random.Random, carry_drop_frac: float, index: int) -> dict:
    answer = add_without_carry(a, b) if rng.random() < carry_drop_frac else a + b
    return {**rl_row(a, b, "sft", index), "response": f"#### {answer}"}


def split_pairs(seed: int, held_out: int = 300, dev: int = 200, operands: range = range(10, 100)):
    """All operand pairs shuffled and cut into disjoint (train, dev, test) lists."""
    pairs = [(a, b) for a in operands for b in operands]
    random.Random(seed).shuffle(pairs)
    return pairs[held_out + dev:], pairs[held_out:held_out + dev], pairs[:held_out]


def write_task(out_dir: str | Path, *, seed: int = 0, carry_drop_frac: float = 0.7, held_out: int = 300,
               dev: int = 200, operands: range = range(10, 100), copies: int = 1) -> dict[str, Path]:
    """sft_train / sft_dev (demonstrations, mixed), rl_train (prompts), test (held-out prompts) as jsonl.

    `copies` > 1 repeats every SFT problem with independently drawn demonstrations, so that even a task small
    enough to memorise keeps both behaviours per prompt.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, dev_pairs, test = split_pairs(seed, held_out=held_out, dev=dev, operands=operands)
    rng = random.Random(seed + 1)
    files = {
        "sft_train": [sft_row(a, b, rng, carry_drop_frac, i) for i, (a, b) in enumerate(train) for _ in range(copies)],
        "sft_dev": [sft_row(a, b, rng, carry_drop_frac, i) for i, (a, b) in enumerate(dev_pairs)],
        "rl_train": [rl_row(a, b, "train", i) for i, (a, b) in enumerate(train)],
        "test": [rl_row(a, b, "test", i) for i, (a, b) in enumerate(test)],
    }
    paths = {}
    for name, rows in files.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def tokenizer_corpus(seed: int = 0, n: int = 2000) -> list[str]:
    rng = random.Random(seed)
    return [f"{prompt_text(a, b)} #### {a + b}" for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n))]
