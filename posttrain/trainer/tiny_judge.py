"""An offline tiny generative judge for the arithmetic task of `posttrain demo` (data/synthetic.py).

A tiny causal LM (models/tiny.py, 64 wide, 2 layers) is fine-tuned for 1200 small steps on one thread to answer a
short template of its own (`TEMPLATE`, saved beside it as judge_template.txt) with `correct` or `incorrect`: whether
the response's final answer is the reference answer, as the task's own rule scorer decides. Exact comparison of the
two numbers is learnt late: after 500-800 steps such a model still calls answers a little off the reference correct
(about 80% agreement with the rule, and GRPO then learns to give near answers); after 1200 it agreed with the rule on
every one of 300 held-out responses. So tests and examples can train with the judge as the only reward and watch the
rule's accuracy rise.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from ..data.dataset import layout_row
from ..data.synthetic import DATA_SOURCE, add_without_carry, prompt_text, tokenizer_corpus
from ..models.tiny import build_tiny_model
from ..reward.judge import fill
from ..reward.registry import default_compute_score
from .sft import SFTArgs, run_sft


def judge_response(rng: random.Random, a: int, b: int) -> str:
    """A response like the task's policies write: mostly `#### N` with N right, carry-free or off by a little,
    sometimes without the `####` marker or with no number."""
    right, kind = a + b, rng.random()
    if kind < 0.4:
        answer = right
    elif kind < 0.55:
        answer = add_without_carry(a, b)
    elif kind < 0.9:
        answer = max(0, right + rng.choice([-10, -2, -1, 1, 2, 10]))
    elif kind < 0.95:
        return str(right if rng.random() < 0.5 else add_without_carry(a, b))
    else:
        return rng.choice(["####", "", "#### +", f"{a}+{b}"])
    return f"#### {answer}"


# The tiny judge's own prompt (saved beside it as judge_template.txt, for reward_model.judge.prompt_template_path):
# short, so that a few hundred steps teach a tiny model the comparison.
TEMPLATE = "ref {ground_truth} got {response}"
TEMPLATE_FILE = "judge_template.txt"


def judge_rows(seed: int, n: int, operands: range, template: str = TEMPLATE) -> list[dict]:
    """SFT rows: the filled template as the user turn, the rule's verdict as the response."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.choice(operands), rng.choice(operands)
        response, truth = judge_response(rng, a, b), str(a + b)
        verdict = "correct" if default_compute_score(DATA_SOURCE, response, truth) > 0 else "incorrect"
        prompt = fill(template, question=prompt_text(a, b), response=response, ground_truth=truth)
        rows.append({**layout_row(DATA_SOURCE, prompt, truth, {"index": i}), "response": verdict})
    return rows


def build_tiny_judge(out_dir: str | Path, *, operands: range = range(0, 10), steps: int = 1200, batch_size: int = 64,
                     lr: float = 3e-3, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                     device: str = "cpu") -> Path:
    """Build and fine-tune the tiny judge into `out_dir` (a Hugging Face model directory) and return it. The
    default (one-digit operands, as the tests' small task) takes seconds on a CPU."""
    out = Path(out_dir)
    work = out.with_name(out.name + ".build")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows = judge_rows(seed, steps * batch_size // 4, operands)
    texts = tokenizer_corpus(seed, 500) + [r["prompt"][0]["content"] + " " + r["response"] for r in rows[:300]]
    base = build_tiny_model(work / "init", texts, hidden_size=hidden_size, num_layers=num_layers,
                            intermediate_size=2 * hidden_size, seed=seed)
    train = work / "judge_sft.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the matmuls of a tiny model are too small to split: more threads only contend
    try:
        run_sft(SFTArgs(model_path=str(base), train_files=[str(train)], output_dir=str(out), epochs=4.0, lr=lr,
                        batch_size=batch_size, max_length=256, eval_every=10**9, seed=seed, quiet=True, device=device,
                        dtype="fp32"))
    finally:
        torch.set_num_threads(threads)
    (out / TEMPLATE_FILE).write_text(TEMPLATE, encoding="utf-8")
    shutil.rmtree(work, ignore_errors=True)
    return out
