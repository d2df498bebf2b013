"""Where a generate call's time goes, and the floor of decoding with the model's own modules.

    python benchmarks/decode_floor.py [--models S,M] [--dtypes fp32,bf16] [--repeats 3] [--workdir DIR]

The workload of benchmarks/grpo_step.py (16 GSM8K prompts x 8 samples x 64 new tokens, the same random Qwen2
models S and M), in one process, each variant timed alternately, best of `--repeats`:
- `generate`: transformers' `model.generate` on fp32 weights under autocast (posttrain's generation before its
  engine), and `posttrain`: the engine's whole call (weights cast, prefill, decoding loop, sampling);
- the engine's call split by timing every model call: prefill, the 63 decoding forwards, and the rest (sampling,
  bookkeeping); then the same forwards with an attention function that does no work: what the model's own modules
  (embedding, norms, projections, rotary, MLP, cache writes, LM head) cost. Any loop that drives those modules
  spends at least prefill + that, so `generate` divided by it bounds the speed-up such a loop can reach;
- inside one decoding forward: how many aten operations it dispatches, what one small operation costs here
  (dispatch floor), and how long its linear layers take as bare matmuls of the same shapes (arithmetic floor).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import N, NEW_TOKENS, PROMPTS, build  # noqa: E402

import posttrain.rollout.engine as engine_module  # noqa: E402
from posttrain.data.dataset import RLDataset, collate_prompts  # noqa: E402
from posttrain.models.load import autocast, load_causal_lm, load_tokenizer  # noqa: E402
from posttrain.rollout.base import SamplingParams  # noqa: E402
from posttrain.rollout.engine import DecodeEngine  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NULL_ATTENTION = "posttrain_benchmark_no_attention"


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention of the right output shape that does no work (the floor of everything else in a forward)."""
    rows, heads, length, dim = query.shape
    return query.new_zeros(rows, length, heads, dim), None


AttentionInterface.register(NULL_ATTENTION, _no_attention)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _timed(forward, calls: list):
    """The engine's model call, timed into `calls`: the first of a generate is the prefill, the others decoding."""
    def call(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        calls.append(time.perf_counter() - start)
        return out
    return call


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def dispatch_cost_us(rows: int, hidden: int, dtype: torch.dtype) -> float:
    """Microseconds per small elementwise op (rows x hidden): the cost of one eager operation here."""
    a = torch.randn(rows, hidden, dtype=dtype)
    b = torch.randn(rows, hidden, dtype=dtype)

    def loop():
        for _ in range(2000):
            torch.add(a, b)
    loop()
    return _best(loop, 3) / 2000 * 1e6


def linear_floor_ms(model, rows: int, dtype: torch.dtype) -> float:
    """Bare matmuls of every linear layer at `rows` rows (one decoding step), in milliseconds."""
    shapes = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [torch.randn(o, i, dtype=dtype) for i, o in shapes]
    inputs = [torch.randn(rows, i, dtype=dtype) for i, _ in shapes]

    def step():
        for x, w in zip(inputs, weights):
            torch.nn.functional.linear(x, w)
    step()
    return _best(step, 20) * 1e3


def measure(workdir: Path, name: str, dtype_name: str, repeats: int) -> dict:
    dtype = DTYPES[dtype_name]
    tokenizer = load_tokenizer(str(workdir / name))
    data = RLDataset([str(workdir / "train.jsonl")], tokenizer, max_prompt_length=512)
    prompts, mask = collate_prompts(data.items[:PROMPTS], tokenizer.pad_token_id)
    lm = load_causal_lm(str(workdir / name), device="cpu").eval()
    engine = DecodeEngine(lm, tokenizer, device=torch.device("cpu"), dtype=dtype)
    sampling = SamplingParams(n=N, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0)
    batch_prompts, batch_mask = prompts.repeat_interleave(N, 0), mask.repeat_interleave(N, 0)

    from posttrain.data.batch import Batch

    def run_engine():
        engine.generate(Batch({"prompts": prompts, "prompt_mask": mask}), sampling)

    def run_generate():
        with torch.no_grad(), autocast(torch.device("cpu"), dtype):
            lm.generate(input_ids=batch_prompts, attention_mask=batch_mask, max_new_tokens=NEW_TOKENS,
                        min_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                        pad_token_id=tokenizer.pad_token_id)

    run_engine()  # warm-up (and the engine's one-time check)
    run_generate()
    times = {"posttrain": [], "generate": []}
    for _ in range(repeats):
        for key, fn in (("posttrain", run_engine), ("generate", run_generate)):
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)

    # the engine's call split into its model calls and the rest, best of `repeats`
    original = engine_module._forward
    splits = []
    try:
        for _ in range(repeats):
            calls: list[float] = []
            engine_module._forward = lambda model: _timed(original(model), calls)
            start = time.perf_counter()
            run_engine()
            total = time.perf_counter() - start
            splits.append((total, calls[0], sum(calls[1:]), len(calls) - 1))
    finally:
        engine_module._forward = original
    total, prefill, forwards, steps = min(splits)

    # the same forwards with an attention that does no work: what the model's other modules cost
    name_before = engine_module.ATTENTION_NAME
    calls_null: list[float] = []
    no_attention = float("inf")
    engine_module._forward = lambda model: _timed(original(model), calls_null)
    engine_module.ATTENTION_NAME = NULL_ATTENTION
    try:
        for _ in range(repeats):
            calls_null.clear()
            run_engine()
            no_attention = min(no_attention, sum(calls_null[1:]))
    finally:
        engine_module._forward, engine_module.ATTENTION_NAME = original, name_before

    # one decoding forward: operations dispatched, dispatch cost, matmul floor
    with torch.no_grad():
        cast = type(lm)(lm.config).to(dtype).eval()
        cast.load_state_dict(lm.state_dict())
    counter = _OpCounter()
    seen: list[int] = []
    engine_module._forward = lambda model: _count_second(original(model), counter, seen)
    try:
        with torch.no_grad():
            engine._decode(cast, prompts[:1], mask[:1], SamplingParams(n=N, max_new_tokens=2, ignore_eos=True))
    finally:
        engine_module._forward = original
    rows = PROMPTS * N
    return dict(model=name, dtype=dtype_name, generate=min(times["generate"]), posttrain=min(times["posttrain"]),
                split_total=total, prefill=prefill, forwards=forwards, steps=steps, ops=counter.ops,
                no_attention=no_attention,
                op_us=dispatch_cost_us(rows, lm.config.hidden_size, dtype),
                linear_ms=linear_floor_ms(cast, rows, dtype))


def _count_second(forward, counter: _OpCounter, calls: list):
    """Counts the operations of the second model call (a decoding step; the first is the prefill)."""
    def call(*args, **kwargs):
        calls.append(1)
        if len(calls) != 2:
            return forward(*args, **kwargs)
        with counter:
            return forward(*args, **kwargs)
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="S,M")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="decode_floor_"))
    workdir.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    build(workdir, models)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {PROMPTS} prompts x {N} samples x "
          f"{NEW_TOKENS} new tokens; best of {args.repeats}")
    print("| model, dtype | generate s | posttrain s | generate / posttrain | prefill s | decoding forwards s "
          "(per step ms) | rest s | forwards without attention s | generate / (prefill + forwards without "
          "attention) | ops per forward | us per small op | ops x us per step ms | linear matmuls per step ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in models:
        for dtype_name in args.dtypes.split(","):
            r = measure(workdir, name, dtype_name, args.repeats)
            rest = r["split_total"] - r["prefill"] - r["forwards"]
            per_step = r["forwards"] / r["steps"] * 1e3
            print(f"| {name} {dtype_name} | {r['generate']:.3f} | {r['posttrain']:.3f} | "
                  f"{r['generate'] / r['posttrain']:.2f}x | {r['prefill']:.3f} | {r['forwards']:.3f} "
                  f"({per_step:.2f}) | {rest:.3f} | {r['no_attention']:.3f} | "
                  f"{r['generate'] / (r['prefill'] + r['no_attention']):.2f}x | "
                  f"{r['ops']} | {r['op_us']:.1f} | {r['ops'] * r['op_us'] / 1e3:.2f} | {r['linear_ms']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
