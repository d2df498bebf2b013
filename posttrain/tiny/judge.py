"""An offline tiny generative judge for the arithmetic task of `posttrain demo` (data/synthetic.py).

A tiny causal LM (models/tiny.py, 64 wide, 2 layers) is fine-tuned on one thread to answer a short template of its
own (`TEMPLATE`, saved beside it as judge_template.txt) with `correct` or `incorrect`: whether the response's final
answer is the reference answer, as the task's own rule scorer decides. It trains until it agrees with the rule on
fresh judge rows, not for a fixed number of steps: exact comparison of the two numbers is learnt after a plateau at
70-80% agreement (answers a little off the reference called correct, and GRPO then learns to give near answers), and
how long that plateau lasts depends on the float rounding of the CPU's kernels: at lr 3e-3, 1200 steps ended at 85%
agreement with one CPU's AVX-512 kernels and 99.5% with its AVX2 ones. At lr 1e-3 it reached the default 99% on the
check rows after 400-600 steps (seeds 0-3; AVX-512, AVX2 and SSE kernels) and then agreed on 98-100% of other rows,
in about 15 s. The one-digit task has only about 300 distinct judge prompts, so the check rows are prompts it
trained on: the check is that it has learnt the rule, which is what the tests need to train with the judge as the
only reward and watch the rule's accuracy rise.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from ..data.dataset import SFTDataset, layout_row
from ..data.synthetic import DATA_SOURCE, add_without_carry, prompt_text, tokenizer_corpus
from ..models.load import load_tokenizer
from ..models.tiny import build_tiny_model
from ..reward.judge import fill
from ..reward.registry import default_compute_score
from ..trainer.sft import SFTArgs, remove_model, run_sft


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


class JudgeNotTrained(RuntimeError):
    """The tiny judge reached its step cap without agreeing with the rule often enough."""


def verdict_agreement(model, data: SFTDataset, pad_id: int) -> float:
    """Share of `data`'s rows whose verdict's first token (`correct` / `in`) is the model's most likely next token
    after the prompt: the verdict greedy decoding starts with."""
    hits = 0
    for start in range(0, len(data), 256):
        rows = range(start, min(start + 256, len(data)))
        ids, attn, _ = data.collate(rows, pad_id)
        logits = model(input_ids=ids.to(model.device), attention_mask=attn.to(model.device)).logits
        for i, row in enumerate(rows):
            tokens, mask = data.examples[row]
            first = mask.index(1)  # the verdict's first token
            hits += int(logits[i, first - 1].argmax()) == tokens[first]
    return hits / len(data)


def build_tiny_judge(out_dir: str | Path, *, operands: range = range(0, 10), agreement: float = 0.99,
                     check_every: int = 100, max_steps: int = 2000, batch_size: int = 64, lr: float = 1e-3,
                     seed: int = 0, hidden_size: int = 64, num_layers: int = 2, device: str = "cpu") -> Path:
    """Build and fine-tune the tiny judge into `out_dir` (a Hugging Face model directory) and return it: trained until,
    checked every `check_every` steps, it agrees with the rule on at least `agreement` of 300 judge rows apart from
    its training rows; JudgeNotTrained (and no `out_dir`) if `max_steps` pass first. The default (one-digit
    operands, as the tests' small task) takes seconds on a CPU."""
    out = Path(out_dir)
    work = out.with_name(out.name + ".build")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows = judge_rows(seed, max_steps * batch_size // 8, operands)
    texts = tokenizer_corpus(seed, 500) + [r["prompt"][0]["content"] + " " + r["response"] for r in rows[:300]]
    base = build_tiny_model(work / "init", texts, hidden_size=hidden_size, num_layers=num_layers,
                            intermediate_size=2 * hidden_size, seed=seed)
    train, checked = work / "judge_sft.jsonl", work / "judge_check.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    checked.write_text("".join(json.dumps(r) + "\n" for r in judge_rows(seed + 1, 300, operands)))
    tokenizer = load_tokenizer(str(base))
    check, reached = SFTDataset([str(checked)], tokenizer, max_length=256), []

    def agrees(model) -> bool:
        reached.append(verdict_agreement(model, check, tokenizer.pad_token_id))
        return reached[-1] >= agreement

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the matmuls of a tiny model are too small to split: more threads only contend
    try:
        run_sft(SFTArgs(model_path=str(base), train_files=[str(train)], output_dir=str(out), epochs=8.0, lr=lr,
                        batch_size=batch_size, max_length=256, eval_every=check_every, seed=seed, quiet=True,
                        device=device, dtype="fp32", stop_when=agrees))
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(work, ignore_errors=True)
    if reached[-1] < agreement:
        remove_model(out)  # no half-trained judge for a later run to pick up
        raise JudgeNotTrained(f"the tiny judge agrees with the rule on {reached[-1]:.1%} of its check rows after "
                              f"max_steps={max_steps} steps (wanted {agreement:.0%}); agreement every {check_every} "
                              f"steps: {[round(a, 3) for a in reached]}. Raise max_steps or lower lr.")
    (out / TEMPLATE_FILE).write_text(TEMPLATE, encoding="utf-8")
    return out
