"""Reward throughput (responses scored per second) with the scorer pool at 0 (in the training process), 1 and 2
workers, side by side.

    python benchmarks/rewards.py [--suites gsm8k math code] [--workers 0 1 2] [--samples 400] [--repeats 3]
                                 [--sandbox-url URL]

Responses are real solution texts from ../shared/data (GSM8K worked solutions ending in `#### N`, MATH-500 solutions
ending in a `\\boxed{}` answer) and the bundled code problems run in the sandbox (`code`), every other one given a
wrong final answer so that both outcomes are scored. Each row runs the reward manager exactly as training does
(decode, score, check the values), with a stand-in tokenizer whose decoding costs nothing. `start-up s` is the first
call of a fresh manager on 8 responses (worker processes start, modules import); `samples/s` is the median over
`--repeats` calls on `--samples` responses after that. `--reward-model [DIR]` adds the scalar reward model's pass on
the same rows, `--judge [DIR]` the generative judge's (prompt, decode, parse). Another scorer joins with `@suite("name")` on a function returning (data_source, response,
ground_truth, extra_info) rows (and a registered scorer for that data_source, or `--custom file.py:function`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
SUITES: dict[str, Callable[[int], list[tuple]]] = {}


def suite(name: str):
    """Register a function `rows(n) -> [(data_source, response, ground_truth, extra_info)]` under `name`."""
    def decorator(fn):
        SUITES[name] = fn
        return fn
    return decorator


def _jsonl(path: Path, n: int) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


@suite("gsm8k")
def gsm8k_rows(n: int) -> list[tuple]:
    out = []
    for i, row in enumerate(_jsonl(DATA / "gsm8k" / "test.jsonl", n)):
        solution, answer = row["answer"].rsplit("####", 1)
        answer = answer.strip().replace(",", "")
        given = answer if i % 2 == 0 else str(int(float(answer)) + 1)
        out.append(("openai/gsm8k", f"{solution}#### {given}", answer, {"index": i, "question": row["question"]}))
    return out


@suite("math")
def math_rows(n: int) -> list[tuple]:
    sys.path.insert(0, str(ROOT))
    from posttrain.reward.math import extract_boxed

    out = []
    for i, row in enumerate(_jsonl(DATA / "math500" / "test.jsonl", n)):
        solution = row["solution"]
        if i % 2:  # a wrong final answer: the boxed content replaced
            boxed = extract_boxed(solution) or ""
            solution = solution.replace(f"{{{boxed}}}", "{" + boxed + "+1}") if boxed else solution
        out.append(("HuggingFaceH4/MATH-500", solution, row["answer"], {"index": i, "question": row["problem"]}))
    return out


@suite("code")
def code_rows(n: int) -> list[tuple]:
    """The bundled code problems (`posttrain prepare code`): the reference solution, or every other time a program
    that prints nothing; each scored in the bubblewrap sandbox (one run per stdin test, one for function-call
    tests, two for assert/checker tests), or on the server named by `--sandbox-url`."""
    import tempfile

    import pyarrow.parquet as pq

    sys.path.insert(0, str(ROOT))
    from posttrain.data.preprocess import prepare

    with tempfile.TemporaryDirectory() as tmp:
        prepare("code", None, tmp)
        problems = pq.read_table(Path(tmp) / "train.parquet").to_pylist()
    out = []
    for i in range(n):
        r = problems[i % len(problems)]
        code = r["extra_info"]["solution"] if i % 2 == 0 else "pass\n"
        out.append((r["data_source"], f"```python\n{code}```", r["reward_model"]["ground_truth"], r["extra_info"]))
    return out


class TextTokenizer:
    """Token id i decodes to the i-th text: decoding costs nothing, so the numbers are the scoring's."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def batch_decode(self, seqs, skip_special_tokens=True):
        return [self.texts[s[0]] for s in seqs]


def as_batch(rows: list[tuple]):
    import torch

    from posttrain.data.batch import Batch

    n = len(rows)
    return Batch({"responses": torch.arange(n).unsqueeze(1), "response_mask": torch.ones(n, 1, dtype=torch.long)},
                 {"data_source": [r[0] for r in rows], "ground_truth": [r[2] for r in rows],
                  "extra_info": [r[3] for r in rows]})


def measure(rows: list[tuple], workers: int, repeats: int, custom) -> tuple[float, float, float]:
    """(start-up seconds, median samples/s, share of responses that scored > 0)."""
    from posttrain.reward.manager import RewardManager

    rm = RewardManager(TextTokenizer([r[1] for r in rows]), compute_score=custom, num_workers=workers,
                       manager="naive", timeout_s=60.0)
    try:
        start = time.perf_counter()
        rm(as_batch(rows[:8]))
        startup = time.perf_counter() - start
        rates, right = [], 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            _, extras = rm(as_batch(rows))
            rates.append(len(rows) / (time.perf_counter() - start))
            right = sum(extras["acc"]) / len(rows)
            if sum(extras["errors"]) + sum(extras["timeouts"]):
                raise SystemExit(f"{sum(extras['errors'])} errors, {sum(extras['timeouts'])} timeouts while scoring")
        return startup, statistics.median(rates), right
    finally:
        rm.close()


def measure_reward_model(rows: list[tuple], path: str | None, repeats: int) -> tuple[float, float]:
    """(load seconds, median samples/s) of the scalar reward model's pass (`reward_model.enable=True`, fp32, micro
    batches of 16) on the suite's question + response exchanges, re-encoded in its chat template. Without `path`: a
    random Qwen2 sequence classifier of the M shape of benchmarks/grpo_step.py (hidden 512, 8 layers, 24.7M)."""
    import tempfile

    import torch

    from posttrain.config import load_config
    from posttrain.data.batch import Batch
    from posttrain.models.tiny import build_tiny_reward_model
    from posttrain.parallel import Parallel
    from posttrain.roles.reward_model import RewardModel

    if path is None:
        path = tempfile.mkdtemp(prefix="rm_")
        build_tiny_reward_model(path, [r[1] for r in rows], vocab_size=2048, hidden_size=512, num_layers=8,
                                num_heads=8, num_kv_heads=4, intermediate_size=1408, max_position_embeddings=1024)
    start = time.perf_counter()
    cfg = load_config(None, ["reward_model.enable=True", f"reward_model.model.path={path}",
                             "reward_model.micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.dtype=fp32",
                             "actor_rollout_ref.model.dtype=fp32", f"actor_rollout_ref.model.path={path}"])
    rm = RewardModel.from_config(cfg, Parallel())
    load = time.perf_counter() - start
    tok = rm.input_tokenizer
    ids = [tok(r[1], add_special_tokens=False)["input_ids"] for r in rows]
    width = max(len(x) for x in ids)
    responses = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        responses[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1
    chats = [[{"role": "user", "content": str(r[3].get("question") or r[3].get("prompt") or "")}] for r in rows]
    batch = Batch({"responses": responses, "response_mask": mask}, {"raw_prompt": chats})
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        rm.score(batch)
        rates.append(len(rows) / (time.perf_counter() - start))
    return load, statistics.median(rates)


def measure_judge(rows: list[tuple], path: str | None, repeats: int, tokens: int) -> tuple[float, float, float]:
    """(load seconds, median samples/s, share of verdicts parsed) of the generative judge
    (`reward_model.judge.enable=True`, fp32, greedy, prompts decoded 64 at a time) on the suite's rows: the prompts
    filled (DIR/judge_template.txt when there is one, else the built-in template), decoded by posttrain's rollout
    engine for at most `tokens` tokens, parsed by the default parser. Without `path`: the tiny judge of the arithmetic
    task (posttrain.tiny.judge), built first."""
    import tempfile

    from posttrain.config import load_config
    from posttrain.parallel import Parallel
    from posttrain.reward.judge import DEFAULT_TEMPLATE, fill, parse_verdict
    from posttrain.roles.judge_model import Judge
    from posttrain.tiny.judge import build_tiny_judge

    if path is None:
        path = str(build_tiny_judge(Path(tempfile.mkdtemp(prefix="judge_")) / "judge"))
    template_file = Path(path) / "judge_template.txt"
    template = template_file.read_text() if template_file.is_file() else DEFAULT_TEMPLATE
    start = time.perf_counter()
    cfg = load_config(None, ["reward_model.enable=True", f"reward_model.model.path={path}",
                             "reward_model.judge.enable=True", f"reward_model.judge.response_length={tokens}",
                             "reward_model.micro_batch_size_per_gpu=64", "actor_rollout_ref.rollout.dtype=fp32"])
    judge = Judge.from_config(cfg, Parallel())
    load = time.perf_counter() - start
    prompts = [fill(template, question=str(r[3].get("question") or r[3].get("prompt") or ""), response=r[1],
                    ground_truth=r[2]) for r in rows]
    rates, parsed = [], 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        verdicts = judge.verdicts(prompts)
        parsed = sum(parse_verdict(v) is not None for v in verdicts) / len(verdicts)
        rates.append(len(rows) / (time.perf_counter() - start))
    return load, statistics.median(rates), parsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", nargs="+", default=["gsm8k", "math"], help=f"of {sorted(SUITES)}")
    p.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--custom", help="file.py:function scoring every row instead of the registered scorers")
    p.add_argument("--sandbox-url", help="the code suite runs programs on this SandboxFusion-compatible server")
    p.add_argument("--reward-model", nargs="?", const="", default=None, metavar="DIR",
                   help="also time a scalar reward model's pass on each suite's rows (DIR, or without one a random "
                        "classifier of 24.7M parameters); it runs in the training process, so `workers` is '-'")
    p.add_argument("--judge", nargs="?", const="", default=None, metavar="DIR",
                   help="also time a generative judge on each suite's rows (DIR, or without one the tiny judge of "
                        "the arithmetic task, built first); `right` is then the share of verdicts parsed")
    p.add_argument("--judge-tokens", type=int, default=16, help="most tokens the judge writes per verdict")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from posttrain.reward.code import CodeSettings, configure

    configure(CodeSettings(url=args.sandbox_url, run_timeout=10.0))  # before any worker starts: they read it

    from posttrain.reward.registry import FileFunction

    torch.set_num_threads(1)
    custom = None
    if args.custom:
        path, _, name = args.custom.rpartition(":")
        custom = FileFunction(path, name)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suites {unknown}; known: {sorted(SUITES)}")
    print(f"{'suite':<8} {'workers':>7} {'start-up s':>10} {'samples/s':>10} {'right':>6}")
    for name in args.suites:
        rows = SUITES[name](args.samples)
        for workers in args.workers:
            startup, rate, right = measure(rows, workers, args.repeats, custom)
            print(f"{name:<8} {workers:>7} {startup:>10.2f} {rate:>10.0f} {right:>6.2f}", flush=True)
        if args.reward_model is not None:
            load, rate = measure_reward_model(rows, args.reward_model or None, args.repeats)
            print(f"{name + ' rm':<8} {'-':>7} {load:>10.2f} {rate:>10.0f} {'-':>6}", flush=True)
        if args.judge is not None:
            load, rate, parsed = measure_judge(rows, args.judge or None, args.repeats, args.judge_tokens)
            print(f"{name + ' judge':<8} {'-':>7} {load:>10.2f} {rate:>10.1f} {parsed:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
