"""Long responses: the actor's training pass on a long-tail length mix, packed against padded micro-batches; the
longest response a memory limit trains (memory model, checked against measurement); decoding cost per token at
long contexts.

    OMP_NUM_THREADS=1 python benchmarks/long_context.py [--scale 0.25] [--rows 32] [--budget 16384] [--seed 0]
    OMP_NUM_THREADS=1 python benchmarks/long_context.py --longest [--limit-gb 20] [--measure 1024,2048,4096]
    OMP_NUM_THREADS=1 python benchmarks/long_context.py --decode [--contexts 2048,4096,8192] [--decode-model S]
        [--short-prompts 15 --short-length 64]
    python benchmarks/long_context.py --device cuda --dtype bf16 --variants packed,packed-sdpa,padded
    python benchmarks/long_context.py --device cuda --decode --contexts 8192,16384,32768

Workload: model M of benchmarks/grpo_step.py (random Qwen2: hidden 512, 8 layers, 8 heads / 4 KV heads, MLP 1408,
24.7M parameters with the 2048-entry vocabulary), fp32, no gradient checkpointing unless `--checkpointing`.
`--rows` responses whose lengths are lognormal: median 1024 x scale, sigma 1.2, clipped to [16, 16384 x scale],
and the longest row set to the clip (every batch has one tail row); prompts uniform in [64, 128] x scale tokens,
left-padded. The pass is the actor update's: response log-probs and entropy (posttrain.models.logprobs, chunked over
the vocabulary), backward of `logp + 0.01 * entropy`, over micro-batches bounded by a token budget
(`use_dynamic_bsz`, `--budget` x scale tokens, `ppo_max_token_len_per_gpu`):
- `packed` (`use_remove_padding=True`): `balance.token_packs` (real tokens <= budget), one padding-free row each;
- `padded`, the baseline: a budget of real tokens over a padded forward (`use_remove_padding=False`), split as
  posttrain split it before budgets counted padded positions: as many micro-batches as greedy in-order packing
  needs, balanced by real tokens (`balance.balanced_parts`: longest row first onto the lightest), each run padded
  to its longest prompt and response; balancing spreads the long rows over the micro-batches, each then padding
  the short rows beside it to its width;
- `padded-first-fit`: packed's micro-batches (`token_packs`), each run padded the same way;
- `padded-budgeted`: posttrain's padded path today (`use_remove_padding=False` with the budget):
  `balance.padded_packs` (rows x padded width <= budget, rows taken longest first), padded the same way;
- `padded-fixed`: no token budget, `--micro-rows` rows per micro-batch in batch order (verl's
  `ppo_micro_batch_size_per_gpu`), padded the same way;
- `packed-sdpa`: packed, with the per-row sdpa kernel where `packed` would take torch's varlen kernel (CUDA in
  bf16 / fp16; the same as `packed` elsewhere): which of the two exact kernels is faster on a GPU.
`--variants` picks a subset (the baseline `padded` is always run).
Each variant runs in a fresh process on the same rows (peak resident memory its own) and reports real tokens per
CPU second (run with OMP_NUM_THREADS=1: CPU time does not count waiting on a shared machine), peak resident memory
and the pass's own share of it (peak minus the resident memory before the pass), beside the 2048^2 matmul ceiling
measured in the same run. With `--device cuda` the model runs there in `--dtype` (weights cast, as a benchmark of
the kernels rather than of autocast): wall seconds (synchronized) stand for CPU seconds and the peak is
`torch.cuda.max_memory_allocated` (the pass's own: minus the memory allocated before it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("packed", "padded", "padded-first-fit", "padded-budgeted", "padded-fixed", "packed-sdpa")
MEDIAN, TAIL, SIGMA, PROMPT = 1024, 16384, 1.2, 128
VOCAB = 2048
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def rss_mb() -> float:
    """Resident memory now (Linux /proc)."""
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def lengths(rows: int, scale: float, seed: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, response lengths) of the long-tail mix (module doc)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tail = int(TAIL * scale)
    resp = np.clip(np.exp(rng.normal(math.log(MEDIAN * scale), SIGMA, rows)), 16, tail).astype(int)
    resp[int(np.argmax(resp))] = tail
    prompt = rng.integers(int(PROMPT * scale) // 2, int(PROMPT * scale) + 1, rows)
    return prompt.tolist(), resp.tolist()


def model_m(max_positions: int, checkpointing: bool = False, device: str = "cpu", dtype: str = "fp32"):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_step import SHAPES
    from posttrain.models.shared_prompt import ATTENTION_NAME

    s = SHAPES["M"]
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                      num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                      num_key_value_heads=s["num_kv_heads"], max_position_embeddings=max_positions,
                      tie_word_embeddings=True, attn_implementation=ATTENTION_NAME)
    model = Qwen2ForCausalLM(cfg).to(device, getattr(torch, DTYPES[dtype])).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def micro_batch(prompt_lens, resp_lens, rows):
    """(ids, mask, L) of `rows` padded to their longest prompt (left) and longest response (right); row i's tokens
    are the same in any micro-batch (drawn from seed i)."""
    import torch

    P, L = max(prompt_lens[i] for i in rows), max(resp_lens[i] for i in rows)
    ids = torch.zeros((len(rows), P + L), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for k, i in enumerate(rows):
        g = torch.Generator().manual_seed(i)
        ids[k, P - prompt_lens[i]:P + resp_lens[i]] = torch.randint(3, VOCAB, (prompt_lens[i] + resp_lens[i],),
                                                                    generator=g)
        mask[k, P - prompt_lens[i]:P + resp_lens[i]] = 1
    return ids, mask, L


def in_order_count(lengths: list[int], budget: int) -> int:
    """Micro-batches greedy in-order packing needs so that none holds more than `budget` real tokens (a longer row
    alone)."""
    count, used = 0, 0
    for n in lengths:
        if count == 0 or (used + n > budget and used > 0):
            count, used = count + 1, 0
        used += n
    return count


def parts_of(variant: str, prompt_lens, resp_lens, budget: int, micro_rows: int) -> list[list[int]]:
    from posttrain.parallel import balance

    lengths = [p + r for p, r in zip(prompt_lens, resp_lens)]
    if variant in ("packed", "packed-sdpa", "padded-first-fit"):
        return balance.token_packs(lengths, budget)
    if variant == "padded":
        return balance.balanced_parts(lengths, in_order_count(lengths, budget), equal_count=False)
    if variant == "padded-budgeted":
        return balance.padded_packs(prompt_lens, resp_lens, budget)
    n = len(resp_lens)
    return [list(range(s, min(s + micro_rows, n))) for s in range(0, n, micro_rows)]


def train_pass(model, prompt_lens, resp_lens, parts, packed: bool) -> None:
    """The actor update's forward + backward over the micro-batches (gradients accumulate)."""
    from posttrain.models.logprobs import response_logprobs

    device = next(model.parameters()).device
    for rows in parts:
        ids, mask, L = micro_batch(prompt_lens, resp_lens, rows)
        ids, mask = ids.to(device), mask.to(device)
        logp, ent = response_logprobs(model, ids, mask, L, packed=packed)
        (logp.sum() + 0.01 * ent.sum()).backward()


class Meter:
    """Seconds and peak memory of a pass: CPU time and resident memory on a CPU; synchronized wall time and
    allocated memory on a GPU."""

    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def start(self) -> None:
        self.sync()
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        self.before = self.torch.cuda.memory_allocated() / 2**20 if self.cuda else rss_mb()
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def stop(self) -> dict:
        self.sync()
        wall = time.perf_counter() - self.t0
        peak = self.torch.cuda.max_memory_allocated() / 2**20 if self.cuda else peak_mb()
        return {"cpu_seconds": wall if self.cuda else time.process_time() - self.c0, "seconds": wall,
                "peak_mb": peak, "pass_mb": peak - self.before}


def run_variant(args) -> dict:
    import posttrain.models.packed as packed_module

    prompt_lens, resp_lens = lengths(args.rows, args.scale, args.seed)
    budget = int(args.budget * args.scale)
    parts = parts_of(args.variant, prompt_lens, resp_lens, budget, args.micro_rows)
    if args.variant == "packed-sdpa":
        packed_module.uses_varlen = lambda query, dropout: False
    model = model_m(max(p + r for p, r in zip(prompt_lens, resp_lens)) + 1, args.checkpointing, args.device,
                    args.dtype)
    meter = Meter(args.device)
    if meter.cuda:  # the kernels' first calls (and their autotuning) are not the pass's cost
        train_pass(model, prompt_lens, resp_lens, parts[:1], packed=args.variant.startswith("packed"))
        model.zero_grad(set_to_none=True)
    meter.start()
    train_pass(model, prompt_lens, resp_lens, parts, packed=args.variant.startswith("packed"))
    positions = sum(len(r) * (max(prompt_lens[i] for i in r) + max(resp_lens[i] for i in r)) for r in parts)
    return {**meter.stop(), "tokens": sum(prompt_lens) + sum(resp_lens), "response_tokens": sum(resp_lens),
            "positions": positions if not args.variant.startswith("packed") else None, "micro_batches": len(parts)}


def child(args, **extra) -> dict:
    ckpt = extra.pop("checkpointing", args.checkpointing)
    cmd = [sys.executable, __file__] + [f"--{k.replace('_', '-')}={v}" for k, v in extra.items()]
    for k in ("scale", "rows", "budget", "seed", "micro_rows", "device", "dtype"):
        cmd.append(f"--{k.replace('_', '-')}={getattr(args, k)}")
    if ckpt:
        cmd.append("--checkpointing")
    # glibc keeps freed large blocks in its heap (its mmap threshold grows as they are freed), so the resident
    # peak would count memory no tensor holds; a fixed threshold maps and unmaps each large tensor.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare(args) -> None:
    from grpo_step import matmul_ceiling

    prompt_lens, resp_lens = lengths(args.rows, args.scale, args.seed)
    chosen = [v for v in VARIANTS if v == "padded" or v in args.variants.split(",")]
    gpu, results = args.device.startswith("cuda"), {}
    for v in chosen:
        results[v] = child(args, variant=v)
        print(f"{v}: {results[v]['cpu_seconds']:.1f} {'s' if gpu else 'CPU s'}, peak {results[v]['peak_mb']:.0f} MB",
              flush=True)
    ceiling = matmul_ceiling(args.device, [args.dtype if args.dtype != "fp16" else "bf16"])
    s = sorted(resp_lens)
    print(f"\n{args.rows} responses, lognormal median {MEDIAN * args.scale:.0f} sigma {SIGMA}, clipped to "
          f"{int(TAIL * args.scale)} (scale {args.scale}): median {s[len(s) // 2]}, mean {sum(s) / len(s):.0f}, "
          f"max {s[-1]}; prompts {min(prompt_lens)}-{max(prompt_lens)}; {results['padded']['tokens']} real tokens; "
          f"budget {int(args.budget * args.scale)} tokens; model M {args.dtype} on {args.device}, gradient "
          f"checkpointing {'on' if args.checkpointing else 'off'}; 2048^2 matmul ceiling "
          f"{' '.join(f'{k} {v:.0f}' for k, v in ceiling.items())} GFLOP/s\n")
    print(f"| variant | micro-batches | positions computed | {'time' if gpu else 'CPU time'} | real tokens/s | "
          "peak memory | pass's own "
          "memory | tokens/s vs padded | peak vs padded | pass memory vs padded |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = results["padded"]
    for v in chosen:
        r = results[v]
        tps, tps0 = r["tokens"] / r["cpu_seconds"], base["tokens"] / base["cpu_seconds"]
        print(f"| {v} | {r['micro_batches']} | {r['positions'] or r['tokens']} | {r['cpu_seconds']:.1f} s | "
              f"{tps:.0f} | {r['peak_mb']:.0f} MB | {r['pass_mb']:.0f} MB | {tps / tps0:.2f}x | "
              f"{r['peak_mb'] / base['peak_mb']:.2f}x | {r['pass_mb'] / base['pass_mb']:.2f}x |")


# ---------------------------------------------------------------- memory model (docs/scaling.md, section 3)

def model_bytes(T: int, *, checkpointing: bool, optimizer: bool = True, chunk: int = 1024) -> dict[str, float]:
    """Predicted peak bytes of one training step on a single T-token row of M in fp32 (one process, no sharding):
    static (weights, gradients, and Adam's moments when `optimizer`), activations, and the log-prob head's chunk."""
    from grpo_step import SHAPES

    s = SHAPES["M"]
    H, Lyr, I = s["hidden_size"], s["num_layers"], s["intermediate_size"]
    Hkv = s["num_kv_heads"] * H // s["num_heads"]
    P = 24.7e6
    A = 4 * (8 * H + 2 * Hkv + 4 * I)  # fp32 bytes per token per layer saved for backward
    act = T * (Lyr * 4 * H + A) if checkpointing else T * Lyr * A
    head = 20 * min(T, chunk) * VOCAB
    return {"static": (16 if optimizer else 8) * P, "activations": act, "head": head,
            "total": (16 if optimizer else 8) * P + act + head}


def run_single(args) -> dict:
    """Peak of one training pass (no optimizer) on a single `args.length`-token response."""
    model = model_m(args.length + 65, args.checkpointing)
    before = rss_mb()
    train_pass(model, [64], [args.length], [[0]], packed=True)
    return {"pass_mb": peak_mb() - before, "peak_mb": peak_mb()}


def longest(args) -> None:
    limit = args.limit_gb * 2**30
    print(f"Predicted (memory model), one response of M in fp32, AdamW (16 bytes/parameter), one process; limit "
          f"{args.limit_gb} GB:")
    for ckpt in (False, True):
        T = 1
        while model_bytes(T * 2, checkpointing=ckpt)["total"] <= limit:
            T *= 2
        lo, hi = T, T * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if model_bytes(mid, checkpointing=ckpt)["total"] <= limit else (lo, mid)
        b = model_bytes(lo, checkpointing=ckpt)
        print(f"  gradient checkpointing {'on ' if ckpt else 'off'}: {lo} tokens (activations "
              f"{b['activations'] / 2**30:.1f} GiB, {b['activations'] / lo / 1024:.0f} KiB/token)")
    print("\nMeasured: the pass's own peak (peak RSS minus RSS before the pass; gradients 4P included, no Adam), "
          "against the model's activations + head + gradients:\n")
    print("| response tokens | checkpointing | predicted | measured | measured / predicted |")
    print("|---|---|---|---|---|")
    for T in [int(x) for x in args.measure.split(",")]:
        for ckpt in (False, True):
            r = child(args, single=1, length=T, checkpointing=ckpt)
            b = model_bytes(T + 64, checkpointing=ckpt)
            pred = (b["activations"] + b["head"] + 4 * 24.7e6) / 2**20
            print(f"| {T} | {'on' if ckpt else 'off'} | {pred:.0f} MB | {r['pass_mb']:.0f} MB | "
                  f"{r['pass_mb'] / pred:.2f} |", flush=True)


# ---------------------------------------------------------------- decoding at long contexts

def decode(args) -> None:
    """The engine's cost per generated token with a `C`-token context: one prompt of C tokens, `--decode-rows`
    samples, 40 new tokens; every model call of the engine is timed (CPU time), the first ones being the prefill;
    the median of the last 32 (decoding steps) over the rows is the cost of one token at that context.
    With `--short-prompts K`, K prompts of `--short-length` tokens decode beside the long one (one batch, left-padded
    to C), each step timed twice, the prefix read padded (every slot C columns) and in buckets of similar prompt
    width (prefix_buckets.py)."""
    import statistics
    import tempfile

    import torch

    import posttrain.rollout.engine as engine_module
    import posttrain.rollout.prefix_buckets as prefix_buckets
    from grpo_step import SHAPES
    from posttrain.data.batch import Batch
    from posttrain.data.preprocess import find_shared_data
    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.tiny import build_tiny_model
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.engine import DecodeEngine

    contexts = [int(c) for c in args.contexts.split(",")]
    work = Path(tempfile.mkdtemp())
    texts = [json.loads(line)["question"] for line in
             (find_shared_data() / "gsm8k" / "train.jsonl").read_text().splitlines()[:2000]]
    build_tiny_model(work / "m", texts, vocab_size=VOCAB, max_position_embeddings=max(contexts) + 64,
                     **SHAPES[args.decode_model])
    tok = load_tokenizer(str(work / "m"))
    device, dtype = torch.device(args.device), getattr(torch, DTYPES[args.dtype])
    lm = load_causal_lm(str(work / "m"), device=args.device).eval()
    engine = DecodeEngine(lm, tok, device=device, dtype=dtype)
    original, calls = engine_module._forward, []

    def timed(model):
        forward = original(model)

        def call(*a, **k):
            c0 = time.process_time()
            out = forward(*a, **k)
            calls.append(time.process_time() - c0)
            return out
        return call

    engine_module._forward = timed
    s = SamplingParams(n=args.decode_rows, max_new_tokens=40, ignore_eos=True)
    K, short = args.short_prompts, args.short_length
    rows = (1 + K) * args.decode_rows
    use_below = prefix_buckets.USE_BELOW

    def batch(C: int) -> Batch:
        prompts = torch.randint(3, VOCAB, (1 + K, C))
        mask = torch.ones_like(prompts)
        mask[1:, :C - short] = 0
        return Batch({"prompts": prompts * mask, "prompt_mask": mask})

    def step_seconds(C: int, buckets: bool) -> tuple[float, float]:
        prefix_buckets.USE_BELOW = use_below if buckets else -1.0
        if device.type == "cuda":
            return gpu_step_seconds(C)
        calls.clear()
        engine.generate(batch(C), s)
        return sum(calls[:-39]), statistics.median(calls[-32:])

    def gpu_step_seconds(C: int) -> tuple[float, float]:
        """On a GPU (where CUDA graphs replay the steps without calling the forward): the synchronized wall time
        of 40 new tokens less that of 8, over the 32 steps between; a first call records the graphs."""
        seconds = {}
        for n in (40, 8, 40):
            short_run = SamplingParams(n=args.decode_rows, max_new_tokens=n, ignore_eos=True)
            prompts = batch(C)
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(prompts, short_run)
            torch.cuda.synchronize()
            seconds[n] = time.perf_counter() - start
        step = (seconds[40] - seconds[8]) / 32
        return seconds[8] - 8 * step, step

    engine.generate(batch(64), s)  # warm-up (and the engine's one-time self-check)
    if not K:
        print(f"model {args.decode_model} {args.dtype} on {args.device}, {args.decode_rows} samples of one prompt, "
              f"40 new tokens\n")
        print("| context | prefill | decoding step (all rows) | ms per token | per token vs first context |")
        print("|---|---|---|---|---|")
        first = None
        for C in contexts:
            prefill, step = step_seconds(C, True)
            per = step / rows * 1e3
            first = first or per
            print(f"| {C} | {prefill:.2f} s | {step * 1e3:.1f} ms | {per:.2f} | {per / first:.2f}x |", flush=True)
        return
    print(f"model {args.decode_model} {args.dtype} on {args.device}, one prompt of C tokens and {K} of {short}, "
          f"{args.decode_rows} samples "
          f"each ({rows} rows), 40 new tokens\n")
    print("| context | decoding step, padded prefix | in buckets | ms per token, padded | in buckets | "
          "buckets / padded |")
    print("|---|---|---|---|---|---|")
    for C in contexts:
        _, padded = step_seconds(C, False)
        _, bucketed = step_seconds(C, True)
        print(f"| {C} | {padded * 1e3:.1f} ms | {bucketed * 1e3:.1f} ms | {padded / rows * 1e3:.2f} | "
              f"{bucketed / rows * 1e3:.2f} | {bucketed / padded:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--micro-rows", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--longest", action="store_true")
    ap.add_argument("--limit-gb", type=float, default=20.0)
    ap.add_argument("--measure", default="1024,2048,4096")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--decode-model", default="S")
    ap.add_argument("--decode-rows", type=int, default=4)
    ap.add_argument("--short-prompts", type=int, default=0)
    ap.add_argument("--short-length", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "packed-sdpa"))
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--single", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
    elif args.single:
        print(json.dumps(run_single(args)))
    elif args.longest:
        longest(args)
    elif args.decode:
        decode(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
