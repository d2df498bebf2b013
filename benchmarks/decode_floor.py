"""Where a generate call's time goes, and the floor of decoding with the model's own modules.

    python benchmarks/decode_floor.py [--models S,M] [--dtypes fp32,bf16] [--repeats 3] [--workdir DIR]

The workload of benchmarks/grpo_step.py (16 GSM8K prompts x 8 samples x 64 new tokens, the same random Qwen2
models S and M), in one process, each variant timed alternately, best of `--repeats`:
- `generate`: transformers' `model.generate` on fp32 weights under autocast (posttrain's generation before its
  engine), and `posttrain`: the engine's whole call (weights cast, prefill, decoding loop, sampling);
- the engine's call split by timing every model call: prefill (one call per length bucket), the 63 decoding
  forwards, and the rest (sampling, bookkeeping); then the same forwards with an attention function that does no
  work: what the model's own modules (embedding, norms, projections, rotary, MLP, cache writes, LM head) cost.
  Any loop that drives those modules spends at least prefill + that, so `generate` divided by it bounds the
  speed-up such a loop can reach;
- the decoding attention's bare matrix products at the same shapes (prompts at their mean length, no padding):
  added to the above, the floor of any attention built from torch's batched products;
- the prefill alone, one call over the padded batch against the engine's length buckets (a second table);
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
from posttrain.models.cpu_bf16 import cpu_bf16_summary  # noqa: E402
from posttrain.models.load import autocast, load_causal_lm, load_tokenizer  # noqa: E402
from posttrain.rollout.base import SamplingParams  # noqa: E402
from posttrain.rollout.decode_state import FIRST_CAPACITY  # noqa: E402
from posttrain.rollout.engine import DecodeEngine  # noqa: E402
import posttrain.rollout.prefill as prefill_module  # noqa: E402
from posttrain.rollout.prefill import prefill_buckets  # noqa: E402
from posttrain.rollout.weights import inference_weights  # noqa: E402

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
    """The engine's model call, timed into `calls`: a generate's first calls are the prefill, the others decoding."""
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


def attention_products_s(config, prompt_lengths: torch.Tensor, steps: int, dtype: torch.dtype) -> float:
    """Seconds a generate call's decoding attention spends in its bare matrix products alone (all layers and
    steps): each prompt's queries against its keys at the prompts' mean length (their real arithmetic, no padding),
    each row's against its own generated positions at the capacities the cache takes. What any attention made of
    torch's batched products needs at least."""
    heads, kv, layers = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    dim = config.hidden_size // heads
    prompts, g, rows = len(prompt_lengths), heads // kv, len(prompt_lengths) * N
    length = int(prompt_lengths.float().mean().round())
    q_prompt = torch.randn(prompts, kv, N * g, dim, dtype=dtype)
    k_prompt = torch.randn(prompts, kv, length, dim, dtype=dtype)
    p_prompt = torch.randn(prompts, kv, N * g, length, dtype=dtype)
    q_own = torch.randn(rows * kv, g, dim, dtype=dtype)
    capacity, widths = min(steps, FIRST_CAPACITY), []
    for t in range(1, steps):  # the capacity at each decoding step, grown as the engine's cache grows it
        widths.append(capacity)
        if t == capacity and capacity < steps:
            capacity = min(steps, capacity + capacity // 4)
    total = 0.0
    for width in sorted(set(widths)):
        k_own = torch.randn(rows * kv, width, dim, dtype=dtype)
        p_own = torch.randn(rows * kv, g, width, dtype=dtype)

        def products():
            torch.matmul(q_prompt, k_prompt.transpose(-1, -2))
            torch.matmul(p_prompt, k_prompt)
            torch.bmm(q_own, k_own.transpose(1, 2))
            torch.bmm(p_own, k_own)
        products()
        total += _best(products, 20) * widths.count(width)
    return total * layers


def _workload(workdir: Path, name: str, dtype: torch.dtype):
    """The tokenizer, the benchmark's prompts and mask, the model and the engine in `dtype`."""
    tokenizer = load_tokenizer(str(workdir / name))
    data = RLDataset([str(workdir / "train.jsonl")], tokenizer, max_prompt_length=512)
    prompts, mask = collate_prompts(data.items[:PROMPTS], tokenizer.pad_token_id)
    lm = load_causal_lm(str(workdir / name), device="cpu").eval()
    return tokenizer, prompts, mask, lm, DecodeEngine(lm, tokenizer, device=torch.device("cpu"), dtype=dtype)


def measure(workdir: Path, name: str, dtype_name: str, repeats: int) -> dict:
    dtype = DTYPES[dtype_name]
    tokenizer, prompts, mask, lm, engine = _workload(workdir, name, dtype)
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

    # the engine's call split into its model calls and the rest, best of `repeats`; the first `k` are the prefill's
    k = len(prefill_buckets(mask.sum(-1)))
    original = engine_module._forward
    splits = []
    try:
        for _ in range(repeats):
            calls: list[float] = []
            engine_module._forward = lambda model: _timed(original(model), calls)
            start = time.perf_counter()
            run_engine()
            total = time.perf_counter() - start
            splits.append((total, sum(calls[:k]), sum(calls[k:]), len(calls) - k))
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
            no_attention = min(no_attention, sum(calls_null[k:]))
    finally:
        engine_module._forward, engine_module.ATTENTION_NAME = original, name_before

    # one decoding forward: operations dispatched, dispatch cost, matmul floor
    with torch.no_grad():
        cast = type(lm)(lm.config).to(dtype).eval()
        cast.load_state_dict(lm.state_dict())
    counter = _OpCounter()
    seen: list[int] = []
    engine_module._forward = lambda model: _count_first_step(original(model), counter, seen, 1)
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
                linear_ms=linear_floor_ms(cast, rows, dtype),
                products=attention_products_s(lm.config, mask.sum(-1), NEW_TOKENS, dtype))


def prefill_comparison(workdir: Path, name: str, dtype_name: str, repeats: int = 7) -> dict:
    """The engine's prefill alone: one call over the batch padded to its longest prompt, against the length buckets
    it uses (`prefill_buckets`); alternating, median of `repeats`."""
    dtype = DTYPES[dtype_name]
    tokenizer, prompts, mask, lm, engine = _workload(workdir, name, dtype)
    default = prefill_module.MAX_PREFILL_BUCKETS
    times: dict[int, list[float]] = {1: [], default: []}
    try:
        with inference_weights(lm, dtype) as model, torch.no_grad(), autocast(torch.device("cpu"), dtype):
            for _ in range(repeats + 1):  # the first round warms up
                for most in times:
                    prefill_module.MAX_PREFILL_BUCKETS = most
                    start = time.perf_counter()
                    engine._prefill(model, prompts, mask, N, NEW_TOKENS, False)
                    times[most].append(time.perf_counter() - start)
    finally:
        prefill_module.MAX_PREFILL_BUCKETS = default
    lengths = mask.sum(-1)
    median = {most: sorted(t[1:])[len(t[1:]) // 2] for most, t in times.items()}
    return dict(model=name, dtype=dtype_name, one=median[1], buckets=median[default],
                calls=len(prefill_buckets(lengths)), positions=int(lengths.sum()),
                padded=len(lengths) * int(lengths.max()),
                bucketed=sum(len(b) * int(lengths[b].max()) for b in prefill_buckets(lengths)))


def _count_first_step(forward, counter: _OpCounter, calls: list, prefill_calls: int):
    """Counts the operations of the first decoding step (the model call after the prefill's)."""
    def call(*args, **kwargs):
        calls.append(1)
        if len(calls) != prefill_calls + 1:
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
          f"{NEW_TOKENS} new tokens; best of {args.repeats}; {cpu_bf16_summary()}")
    print("| model, dtype | generate s | posttrain s | generate / posttrain | prefill s | decoding forwards s "
          "(per step ms) | rest s | forwards without attention s | generate / (prefill + forwards without "
          "attention) | attention products s | generate / (prefill + forwards without attention + attention "
          "products) | "
          "ops per forward | us per small op | ops x us per step ms | linear matmuls per step ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in models:
        for dtype_name in args.dtypes.split(","):
            r = measure(workdir, name, dtype_name, args.repeats)
            rest = r["split_total"] - r["prefill"] - r["forwards"]
            per_step = r["forwards"] / r["steps"] * 1e3
            print(f"| {name} {dtype_name} | {r['generate']:.3f} | {r['posttrain']:.3f} | "
                  f"{r['generate'] / r['posttrain']:.2f}x | {r['prefill']:.3f} | {r['forwards']:.3f} "
                  f"({per_step:.2f}) | {rest:.3f} | {r['no_attention']:.3f} | "
                  f"{r['generate'] / (r['prefill'] + r['no_attention']):.2f}x | {r['products']:.3f} | "
                  f"{r['generate'] / (r['prefill'] + r['no_attention'] + r['products']):.2f}x | "
                  f"{r['ops']} | {r['op_us']:.1f} | {r['ops'] * r['op_us'] / 1e3:.2f} | {r['linear_ms']:.2f} |",
                  flush=True)
    print("\nPrefill alone: one call over the padded batch against the length buckets "
          "(median of 7, alternating)")
    print("| model, dtype | prompt tokens | positions, one call | positions, buckets (calls) | one call ms | "
          "buckets ms | buckets / one call |")
    print("|---|---|---|---|---|---|---|")
    for name in models:
        for dtype_name in args.dtypes.split(","):
            r = prefill_comparison(workdir, name, dtype_name)
            print(f"| {name} {dtype_name} | {r['positions']} | {r['padded']} | {r['bucketed']} ({r['calls']}) | "
                  f"{r['one'] * 1e3:.1f} | {r['buckets'] * 1e3:.1f} | {r['buckets'] / r['one']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
