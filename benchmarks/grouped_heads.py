"""The shared-prompt response attention in its two forms, side by side: grouped key/value heads passed to sdpa with
the mask (`enable_gqa`), and keys and values repeated per query head.

    python benchmarks/grouped_heads.py [--device cpu|cuda] [--repeats 12]

Shapes of one training micro-batch of benchmarks/grpo_step.py's workload: 128 response rows of 64 tokens reading a
150-position prompt, head size 64, bf16 (the attention's dtype under autocast) and fp32, with the heads of M (8 query
/ 4 key-value) and of L (Qwen2.5-0.5B: 14 / 2). Per form: forward + backward milliseconds (median), and on a GPU the
peak memory above the inputs and whether sdpa's memory-efficient kernel takes the call.
`models/shared_prompt.grouped_heads_in_sdpa` picks the form per device from what this prints.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from posttrain.models.load import attention_backends

ROWS, LENGTH, PROMPT, HEAD_DIM = 128, 64, 150, 64
HEADS = {"M": (8, 4), "L": (14, 2)}


def case(heads: int, kv_heads: int, dtype: torch.dtype, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(ROWS, heads, LENGTH, HEAD_DIM, device=device, dtype=dtype, generator=g, requires_grad=True)
    k, v = (torch.randn(ROWS, kv_heads, PROMPT + LENGTH, HEAD_DIM, device=device, dtype=dtype, generator=g,
                        requires_grad=True) for _ in range(2))
    prompt = torch.rand(ROWS, PROMPT, device=device, generator=g) > 0.3  # left padding of various lengths
    causal = torch.ones(LENGTH, LENGTH, dtype=torch.bool, device=device).tril()
    mask = torch.cat([prompt[:, None, None].expand(ROWS, 1, LENGTH, PROMPT),
                      causal[None, None].expand(ROWS, 1, LENGTH, LENGTH)], dim=-1)
    return q, k, v, mask


def forms(q, k, v, mask):
    groups = q.shape[1] // k.shape[1]
    return {
        "grouped heads": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "repeated keys": lambda: F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups),
                                                                attn_mask=mask),
    }


def measure(fn, tensors, device: str, repeats: int) -> tuple[float, float]:
    """(median ms of forward + backward, peak MiB above what was allocated before, GPU only)."""
    times, peak = [], 0.0
    for _ in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        fn().float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        times.append(time.perf_counter() - start)
        for t in tensors:
            t.grad = None
    return 1e3 * statistics.median(times[2:]), peak


def memory_efficient_takes(fn) -> bool:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            fn()
        return True
    except RuntimeError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--repeats", type=int, default=12)
    args = p.parse_args()
    cuda = args.device == "cuda"
    print("| heads, dtype | form | fwd + bwd ms |" + (" peak MiB | memory-efficient kernel |" if cuda else ""))
    print("|---|---|---|" + ("---|---|" if cuda else ""))
    for name, (heads, kv_heads) in HEADS.items():
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v, mask = case(heads, kv_heads, dtype, args.device)
            for form, fn in forms(q, k, v, mask).items():
                with attention_backends(torch.device(args.device)):  # the sdpa backends posttrain runs with
                    ms, peak = measure(fn, (q, k, v), args.device, args.repeats)
                extra = f" {peak:.0f} | {'yes' if memory_efficient_takes(fn) else 'no'} |" if cuda else ""
                print(f"| {name} ({heads}/{kv_heads}), {str(dtype)[6:]} | {form} | {ms:.2f} |{extra}", flush=True)


if __name__ == "__main__":
    main()
