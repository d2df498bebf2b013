"""One decoding step of posttrain's engine against its memory-bandwidth bound.

    python benchmarks/decode_bound.py --device cuda [--models L,1.5B] [--batches 64,128,256] [--dtype bf16]
                                      [--prompt 512] [--new-tokens 64]

A decoding step reads every weight once (the input embedding only at the batch's rows, unless it is tied to the
output head, which reads it whole) and every row's keys and values so far; at batch sizes where that traffic
dominates, no engine decodes faster than those bytes over the device's memory bandwidth. This benchmark builds
random Qwen2 models of real shapes — `L` (Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads, 2 key/value heads, MLP
4864, vocabulary 151936, tied) and `1.5B` (Qwen2.5-1.5B: hidden 1536, 28 layers, 12 / 2 heads, MLP 8960, tied); on
a CPU also `S` and `M` of grpo_step.py for a quick look — and decodes `--batches` distinct random prompts of
`--prompt` tokens each (no prompt shared, so every row reads its own keys and values), exactly `--new-tokens` new
tokens (EOS ignored), sampled at temperature 1, in the model's dtype (no float32 master copy).

One step's time is the synchronized wall time of a call with `--new-tokens` new tokens less that of a call with 8,
over the steps between (the prefill and first steps cancel; on a GPU the steps are CUDA-graph replays). Its bytes:
`step_bytes` (weights + keys and values at the mean context of those steps). The bound is those bytes over the
copy bandwidth measured in the same run (a 1 GiB `copy_`: read + write bytes / time); reported: step time, bytes,
bound, and the share of the bound the step reaches.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import SHAPES as SMALL  # noqa: E402
from grpo_step import _sync  # noqa: E402
from long_context import DTYPES  # noqa: E402

SHAPES = {
    "L": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=4864, vocab_size=151936),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
}


def shapes() -> dict[str, dict]:
    """Every model this benchmark knows: L and 1.5B, and grpo_step.py's S and M (vocabulary 2048)."""
    small = {name: dict(hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
                        num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
                        intermediate_size=s["intermediate_size"], vocab_size=2048)
             for name, s in SMALL.items() if name in ("S", "M")}
    return {**small, **SHAPES}


def parameter_count(shape: dict, tied: bool = True) -> int:
    """A Qwen2 model's parameters: per layer q/k/v projections with biases, o projection, three MLP matrices, two
    norms; the embedding; the final norm; the output head unless tied."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    return shape["num_hidden_layers"] * layer + v * h + h + (0 if tied else v * h)


def step_bytes(shape: dict, batch: int, context: float, element: int, tied: bool = True) -> tuple[float, float]:
    """(weight bytes, key/value bytes) one decoding step reads: every parameter once, except an untied input
    embedding, of which only the batch's rows are read; and each row's keys and values at `context` positions
    (layers x 2 x key/value heads x head dim per position), `element` bytes each."""
    h, v = shape["hidden_size"], shape["vocab_size"]
    params = parameter_count(shape, tied)
    weights = (params if tied else params - v * h + batch * h) * element
    head_dim = h // shape["num_attention_heads"]
    per_position = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim * element
    return float(weights), float(batch * context * per_position)


def copy_bandwidth(device, gib: float = 1.0) -> float:
    """Bytes per second of a large device copy (read + write), best of five."""
    import torch

    n = int(gib * 2**30) // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device.type)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device.type)
        best = min(best, time.perf_counter() - start)
    return 2 * 4 * n / best


def build(shape: dict, device, dtype, max_positions: int):
    """A random Qwen2 model of `shape` (tied embeddings), made on `device` in `dtype`, and a small tokenizer (the
    engine reads only its special ids)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.models.tiny import build_tokenizer

    cfg = Qwen2Config(**shape, max_position_embeddings=max_positions, tie_word_embeddings=True)
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    tokenizer = build_tokenizer([f"{a} plus {a + 1} is {2 * a + 1}" for a in range(200)])
    return model, tokenizer


def step_seconds(engine, batch_size: int, prompt: int, new_tokens: int, vocab: int, device) -> float:
    """Seconds of one decoding step: (time of `new_tokens` - time of 8) / (new_tokens - 8), the later of two tries
    each (the first records CUDA graphs)."""
    import torch

    from posttrain.data.batch import Batch
    from posttrain.rollout.base import SamplingParams

    seconds = {}
    for n in (new_tokens, 8, new_tokens, 8):
        prompts = torch.randint(3, vocab, (batch_size, prompt))
        sampling = SamplingParams(n=1, max_new_tokens=n, ignore_eos=True)
        _sync(device.type)
        start = time.perf_counter()
        engine.generate(Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)}), sampling)
        _sync(device.type)
        seconds[n] = time.perf_counter() - start
    return (seconds[new_tokens] - seconds[8]) / (new_tokens - 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="L,1.5B")
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.new_tokens <= 8:
        sys.exit("--new-tokens must be above 8 (a step is the difference of a call of that many and one of 8)")
    import torch

    from posttrain.rollout.engine import DecodeEngine

    device, dtype = torch.device(args.device), getattr(torch, DTYPES[args.dtype])
    element = torch.finfo(dtype).bits // 8
    known = shapes()
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {args.dtype}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; prompts of "
          f"{args.prompt} tokens, one per row, {args.new_tokens} new tokens\n")
    print("| model | parameters | batch | mean context | step ms | weights GB | keys+values GB | bound ms | "
          "share of bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model_name in args.models.split(","):
        shape = known[model_name]
        model, tokenizer = build(shape, device, dtype, args.prompt + args.new_tokens + 8)
        engine = DecodeEngine(model, tokenizer, device=device, dtype=dtype)
        for batch_size in (int(b) for b in args.batches.split(",")):
            step = step_seconds(engine, batch_size, args.prompt, args.new_tokens, shape["vocab_size"], device)
            context = args.prompt + (8 + args.new_tokens) / 2  # the mean context of the steps measured
            weights, kv = step_bytes(shape, batch_size, context, element)
            bound = (weights + kv) / bandwidth
            print(f"| {model_name} | {parameter_count(shape) / 1e6:.0f}M | {batch_size} | {context:.0f} | "
                  f"{step * 1e3:.2f} | {weights / 1e9:.3f} | {kv / 1e9:.3f} | {bound * 1e3:.2f} | "
                  f"{bound / step:.0%} |", flush=True)
        del engine, model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
