"""Response log-probs + entropy: posttrain's chunked path against the plain full-logits log-softmax, side by side.

    python benchmarks/logprobs.py [--batch 8] [--prompt 128] [--response 384] [--vocab 32768] [--repeats 3]

Each variant runs in a fresh process on the same random Qwen2 model and batch, so its peak resident memory is its
own. Prints forward+backward time, peak memory, the ratios against the plain path, and the largest log-prob difference.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VARIANTS = ("plain-fp32", "chunked-fp32", "plain-bf16", "chunked-bf16")


def build(args):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    T = args.prompt + args.response
    ids = torch.randint(0, args.vocab, (args.batch, T))
    mask = torch.ones_like(ids)
    return model, ids, mask


def plain(model, ids, mask, L):
    """What a loop without chunking does: full logits, float32 log-softmax over every position and the vocabulary."""
    import torch

    logits = model(input_ids=ids, attention_mask=mask).logits[:, -L - 1:-1].float()
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, ids[:, -L:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def run_one(args) -> dict:
    import torch

    from posttrain.models.load import autocast
    from posttrain.models.logprobs import response_logprobs

    model, ids, mask = build(args)
    dtype = torch.bfloat16 if args.variant.endswith("bf16") else torch.float32
    L = args.response
    times = []
    for _ in range(args.repeats + 1):  # the first run warms up
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with autocast(torch.device("cpu"), dtype):
            if args.variant.startswith("plain"):
                logp, ent = plain(model, ids, mask, L)
            else:
                logp, ent = response_logprobs(model, ids, mask, L, chunk_size=1024)
        (logp.float().sum() + 0.01 * ent.float().sum()).backward()
        times.append(time.perf_counter() - t0)
    return {"seconds": min(times[1:]), "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "logp": logp.detach().float()[0, :64].tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_one(args)))
        return

    results = {}
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", variant] + [
            f"--{k}={getattr(args, k)}" for k in ("batch", "prompt", "response", "vocab", "repeats")]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
        print(f"{variant}: {results[variant]['seconds']:.2f} s, peak {results[variant]['peak_mb']:.0f} MB", flush=True)

    print(f"\nbatch {args.batch} x ({args.prompt} prompt + {args.response} response) tokens, vocab {args.vocab}; "
          "forward + backward of log-probs and entropy\n")
    print("| variant | time | peak memory | time vs plain (same dtype) | memory vs plain (same dtype) | max abs log-prob diff vs plain |")
    print("|---|---|---|---|---|---|")
    for variant in VARIANTS:
        r = results[variant]
        base = results["plain-" + variant.split("-")[1]]
        diff = max(abs(a - b) for a, b in zip(r["logp"], base["logp"]))
        print(f"| {variant} | {r['seconds']:.2f} s | {r['peak_mb']:.0f} MB | {r['seconds'] / base['seconds']:.2f}x "
              f"| {r['peak_mb'] / base['peak_mb']:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
