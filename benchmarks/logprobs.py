"""Response log-probs + entropy: posttrain's chunked path against the plain full-logits log-softmax, side by side;
with `--mix longtail`, packed (padding-free) micro-batches against padded ones on a long-tail length mix.

    python benchmarks/logprobs.py [--batch 8] [--prompt 128] [--response 384] [--vocab 32768] [--repeats 3]
    OMP_NUM_THREADS=1 python benchmarks/logprobs.py --mix longtail --prompt 32 --response 480 --short-response 48
                                  [--long 2] [--short 30] [--flex]

Each variant runs in a fresh process on the same random Qwen2 model and batch, so its peak resident memory is its
own. Prints forward+backward time, peak memory, the ratios against the plain path, and the largest log-prob difference.

The long-tail mix: `--long` rows of prompt + `--response` tokens and `--short` rows of prompt + `--short-response`
tokens (prompts left-padded, responses right-padded), all in one micro-batch. `padded` is the forward on the padded
rectangle (rows x longest row); the packed variants run the rows' real tokens as one row, each with another
attention: `packed-rows` (posttrain's: sdpa causal per row), `packed-mask` (transformers' own packed-sequence support:
positions restarting per row, one block-diagonal boolean mask over all N tokens), `packed-flex` (FlexAttention with a
document mask, `--flex` only: on a CPU it compiles for minutes first).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VARIANTS = ("plain-fp32", "chunked-fp32", "plain-bf16", "chunked-bf16")
PACKING = ("padded", "packed-rows", "packed-mask")


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
    if args.mix == "longtail":
        rows = args.long + args.short
        ids = torch.randint(3, args.vocab, (rows, T))
        mask[:] = 0
        mask = mask[:1].expand(rows, -1).clone()
        for i in range(rows):
            prompt = args.prompt - (i % 3) * (args.prompt // 4)  # some prompts left-padded
            response = args.response if i < args.long else args.short_response
            mask[i, args.prompt - prompt:args.prompt + response] = 1
        ids = ids * mask
    return model, ids, mask


def packed_forward(model, ids, mask, L, attention: str):
    """Log-probs and entropies of the rows packed without padding, through `attention` (see the module doc)."""
    import contextlib

    from posttrain.models.logprobs import _chunked, _head
    from posttrain.models.packed import mask_off, pack, predictors
    from posttrain.models.shared_prompt import ATTENTION_NAME

    rows = pack(ids, mask)
    kwargs = dict(input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False)
    if attention == "rows":
        model.config._attn_implementation = ATTENTION_NAME
        kwargs["packed"] = rows.packing
    else:  # transformers builds the block-diagonal mask from the restarting positions
        model.config._attn_implementation = {"mask": "sdpa", "flex": "flex_attention"}[attention]
    with mask_off() if attention == "rows" else contextlib.nullcontext():
        hidden = model.model(**kwargs).last_hidden_state
    valid, at = predictors(rows, L)
    project, params, _ = _head(model)
    logp, ent = _chunked(hidden[0].index_select(0, at), ids[:, -L:][valid], project, params, temperature=1.0,
                         chunk_size=1024, with_entropy=True)
    return logp.new_zeros(valid.shape).masked_scatter(valid, logp), ent.new_zeros(valid.shape).masked_scatter(valid, ent)


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
    times, cpu = [], []
    for _ in range(args.repeats + 1):  # the first run warms up
        model.zero_grad(set_to_none=True)
        t0, c0 = time.perf_counter(), time.process_time()
        with autocast(torch.device("cpu"), dtype):
            if args.variant.startswith("plain"):
                logp, ent = plain(model, ids, mask, L)
            elif args.variant.startswith("packed-"):
                logp, ent = packed_forward(model, ids, mask, L, args.variant.split("-")[1])
            else:
                logp, ent = response_logprobs(model, ids, mask, L, chunk_size=1024)
        (logp.float().sum() + 0.01 * ent.float().sum()).backward()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    real = mask[:, -L:].bool()
    return {"seconds": min(times[1:]), "cpu_seconds": min(cpu[1:]), "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "logp": logp.detach().float()[real][:4096].tolist(), "tokens": int(mask.sum()), "positions": ids.numel()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mix", choices=("uniform", "longtail"), default="uniform")
    ap.add_argument("--long", type=int, default=2)
    ap.add_argument("--short", type=int, default=30)
    ap.add_argument("--short-response", type=int, default=64)
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--variant", choices=VARIANTS + PACKING + ("packed-flex",), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_one(args)))
        return
    if args.mix == "longtail":
        longtail(args)
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


def longtail(args) -> None:
    """Packed against padded micro-batches on the long-tail mix (fp32: every variant computes the same values). Times
    are CPU seconds of the process (run it with OMP_NUM_THREADS=1): on a shared machine they do not count waiting."""
    variants = PACKING + (("packed-flex",) if args.flex else ())
    results = {}
    for variant in variants:
        cmd = [sys.executable, __file__, "--variant", variant, "--mix", "longtail"] + [
            f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("prompt", "response", "vocab", "repeats", "long",
                                                                     "short", "short_response")]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
        print(f"{variant}: {results[variant]['cpu_seconds']:.2f} s, peak {results[variant]['peak_mb']:.0f} MB",
              flush=True)
    base = results["padded"]
    print(f"\n{args.long} rows of {args.prompt} + {args.response} tokens and {args.short} of {args.prompt} + "
          f"{args.short_response} (prompts partly left-padded): {base['tokens']} real tokens, {base['positions']} "
          f"padded positions; vocab {args.vocab}; forward + backward of log-probs and entropy, fp32\n")
    print("| variant | time | real tokens/s | peak memory | time vs padded | memory vs padded | max abs log-prob diff |")
    print("|---|---|---|---|---|---|---|")
    for variant in variants:
        r = results[variant]
        diff = max(abs(a - b) for a, b in zip(r["logp"], base["logp"]))
        t, t0 = r["cpu_seconds"], base["cpu_seconds"]
        print(f"| {variant} | {t:.2f} s | {r['tokens'] / t:.0f} | {r['peak_mb']:.0f} MB | {t / t0:.2f}x | "
              f"{r['peak_mb'] / base['peak_mb']:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
