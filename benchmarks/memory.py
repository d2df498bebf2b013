"""Memory per rank of one RL update (`RLTrainer.learn`) under each process layout, beside the memory model.

    python benchmarks/memory.py [--prompts 8] [--responses 4] [--prompt-len 64] [--response-len 192]
                                [--mmap-threshold BYTES] [--workdir DIR]

A random Qwen2 model "M" (hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408, the largest vocabulary
the offline tokenizer builds from the synthetic corpus) is trained with GRPO without KL (actor only), fp32, on one
fixed batch of random tokens (prompts x n responses, prompts left-padded, responses of random length). Each variant
runs in fresh processes (2-rank variants under `torchrun --standalone --nproc_per_node=2`; the cores are split
evenly over the ranks with OMP_NUM_THREADS) and calls `learn` twice on the same batch.

Per rank it reports: peak resident memory (ru_maxrss), the baseline (resident memory after the imports, a tiny
warm-up of torch's kernels and reading the batch, before any model exists) and the peak above it; the bytes held
after the second `learn` in parameters (local shards), gradients (just before the optimizer step, after which they
are freed) and optimizer state, beside the memory model of
docs/scaling.md (weights 4P/N, gradients 4P/N, Adam 8P/N; LoRA: 4 bytes per frozen and 16 per trainable parameter);
and the model's estimate of the peak: those bytes plus activations (fp32, per token and layer 4(8H + 2Hkv + 4I)
bytes; with checkpointing 4H per layer plus one layer's full activations).

glibc keeps freed blocks below its (growing) mmap threshold in the heap, so resident memory also counts freed
temporaries; `--mmap-threshold 65536` (MALLOC_MMAP_THRESHOLD_ for the workers) returns large blocks on free, and the
peak then tracks the live tensors more closely.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408)
CKPT = "actor_rollout_ref.model.enable_gradient_checkpointing=True"
VARIANTS = {  # name: (processes, overrides)
    "full-1proc": (1, []),
    "lora-1proc": (1, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]),
    "fsdp-1rank": (1, []),  # one process, forced to shard (FSDP2 over a 1-process group)
    "fsdp-2ranks": (2, []),
    "fsdp-2ranks-offload": (2, ["actor_rollout_ref.actor.fsdp_config.param_offload=True"]),
    "full-1proc-ckpt": (1, [CKPT]),
}
MB = 2**20


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def make_inputs(args, out: Path) -> None:
    """The model folder, a data file of `prompts` rows (the trainer requires one) and the fixed batch."""
    import torch

    from posttrain.data.batch import Batch
    from posttrain.data.dataset import layout_row
    from posttrain.data.synthetic import tokenizer_corpus
    from posttrain.models.load import load_tokenizer
    from posttrain.models.tiny import build_tiny_model

    build_tiny_model(out / "model", tokenizer_corpus(0, 500), vocab_size=32768, seed=0,
                     max_position_embeddings=max(512, args.prompt_len + args.response_len), **SHAPE)
    rows = [layout_row("synthetic/arithmetic", f"{a}+{a + 3}=", str(2 * a + 3), {"index": a})
            for a in range(args.prompts)]
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    n_tok = len(load_tokenizer(str(out / "model")))
    g = torch.Generator().manual_seed(0)
    B, P, R = args.prompts * args.responses, args.prompt_len, args.response_len
    pos_p, pos_r = torch.arange(P), torch.arange(R)
    prompt_len = torch.randint(P * 3 // 4, P + 1, (args.prompts,), generator=g).repeat_interleave(args.responses)
    prompts = torch.randint(3, n_tok, (args.prompts, P), generator=g).repeat_interleave(args.responses, 0)
    prompt_mask = (pos_p[None] >= P - prompt_len[:, None]).long()
    resp_len = torch.randint(R // 2, R + 1, (B,), generator=g)
    response_mask = (pos_r[None] < resp_len[:, None]).long()
    responses = torch.randint(3, n_tok, (B, R), generator=g) * response_mask  # pad id 0
    scores = (torch.rand(B, generator=g) > 0.5).float()
    token_scores = torch.zeros(B, R)
    token_scores[torch.arange(B), resp_len - 1] = scores
    batch = Batch({"prompts": prompts * prompt_mask, "prompt_mask": prompt_mask, "responses": responses,
                   "response_mask": response_mask, "input_ids": torch.cat([prompts * prompt_mask, responses], 1),
                   "attention_mask": torch.cat([prompt_mask, response_mask], 1), "token_level_scores": token_scores},
                  {"uid": [f"p{i // args.responses}" for i in range(B)], "data_source": ["synthetic/arithmetic"] * B,
                   "ground_truth": ["0"] * B, "extra_info": [{}] * B, "reward:acc": scores.tolist(),
                   "reward:score": scores.tolist()})
    torch.save(batch, out / "batch.pt")


def nbytes(tensors) -> int:
    """Bytes of these tensors on this rank (a sharded parameter counts its local shard)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in local)


def held_bytes(actor, grad_bytes: int) -> dict:
    """Bytes this rank holds in parameters, gradients (counted just before the optimizer step, after which they are
    freed) and optimizer state, and the parameter counts."""
    params = list(actor.model.parameters())
    state = [v for s in actor.optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    return {"params": nbytes(params), "grads": grad_bytes, "optim": nbytes(state),
            "n_params": sum(p.numel() for p in params),
            "n_trainable": sum(p.numel() for p in params if p.requires_grad)}


def predicted(r: dict, cfg, batch) -> dict:
    """The memory model for this variant and rank (fp32 weights; see docs/scaling.md)."""
    N, P, trainable = r["world"], r["n_params"], r["n_trainable"]
    H, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hkv = cfg.num_key_value_heads * H // cfg.num_attention_heads
    tokens = len(batch) // N * batch["input_ids"].shape[1]  # rows of this rank x padded width
    full_layer = tokens * 4 * (8 * H + 2 * hkv + 4 * I)
    act = tokens * L * 4 * H + full_layer if r["ckpt"] else L * full_layer
    static = {"params": 4 * P / N, "grads": 4 * trainable / N, "optim": 8 * trainable / N}
    return {**static, "activations": act, "peak": sum(static.values()) + act}


def run_variant(args) -> None:
    import torch

    from posttrain.config import load_config
    from posttrain.data.batch import Batch
    from posttrain.parallel import init_parallel, shutdown
    from posttrain.trainer.rl import RLTrainer
    from posttrain.trainer.setup import parallel_for

    lin = torch.nn.Linear(64, 64)  # load torch's lazily initialised kernels before the baseline
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(8, 64)).sum().backward()
    opt.step()
    work = Path(args.workdir)
    batch = torch.load(work / "batch.pt", weights_only=False)
    nproc, extra = VARIANTS[args.variant]
    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={work / 'model'}", f"data.train_files={work / 'train.jsonl'}",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.response_len}",
        "data.truncation=left",  # the data file is only required to exist; the batch is the fixed one
        "algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={args.responses}",
        "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False", "actor_rollout_ref.actor.optim.lr=1e-4",
        "trainer.device=cpu", f"trainer.n_gpus_per_node={nproc}",
        f"trainer.default_local_dir={work / ('run-' + args.variant)}", *extra])
    baseline = rss_mb()
    par = (init_parallel(device_name="cpu", need_sharding=True) if args.variant == "fsdp-1rank"
           else parallel_for(cfg))
    trainer = RLTrainer(cfg, par)
    trainer.global_step = 1
    grads = {}
    trainer.parts.actor.optimizer.register_step_pre_hook(
        lambda opt, *_: grads.update(bytes=nbytes(p.grad for p in trainer.parts.actor.model.parameters())))
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        metrics = trainer.learn(Batch(dict(batch.tensors), dict(batch.meta)))
        seconds.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    r = {"variant": args.variant, "rank": par.rank, "world": par.world, "peak_mb": peak, "baseline_mb": baseline,
         "seconds": seconds[1], "ckpt": CKPT in extra, "grad_norm": metrics["actor/grad_norm"],
         "vocab": trainer.parts.actor.model.config.vocab_size, **held_bytes(trainer.parts.actor, grads["bytes"])}
    r["predicted"] = predicted(r, trainer.parts.actor.model.config, batch)
    (work / f"result-{args.variant}-{par.rank}.json").write_text(json.dumps(r))  # ranks' stdout interleaves
    trainer.parts.reward.close()
    shutdown()


def launch(args, variant: str) -> list[dict]:
    nproc = VARIANTS[variant][0]
    runner = ([sys.executable] if nproc == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"])
    cmd = runner + [__file__, "--variant", variant, "--workdir", args.workdir] + [
        f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("prompts", "responses", "prompt_len", "response_len")]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"{variant} failed:\n{done.stderr[-4000:]}")
    return [json.loads((Path(args.workdir) / f"result-{variant}-{rank}.json").read_text()) for rank in range(nproc)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--responses", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=192)
    ap.add_argument("--mmap-threshold", type=int, default=0, help="MALLOC_MMAP_THRESHOLD_ for the workers (0: glibc's)")
    ap.add_argument("--workdir", default=None, help="where the model, data and batch are written (default: a temp dir)")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        run_variant(args)
        return

    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory()
        args.workdir = tmp.name
    make_inputs(args, Path(args.workdir))
    results = []
    for variant in VARIANTS:
        rows = launch(args, variant)
        results += rows
        peaks = ", ".join(f"{r['peak_mb']:.0f}" for r in rows)
        print(f"{variant}: peak {peaks} MB per rank, {rows[0]['seconds']:.1f} s per learn", flush=True)

    first = results[0]
    print(f"\nmodel M: {first['n_params'] / 1e6:.2f} M parameters (vocabulary {first['vocab']}); batch "
          f"{args.prompts} prompts x {args.responses} responses, {args.prompt_len} prompt + up to "
          f"{args.response_len} response tokens; fp32; GRPO without KL, one mini-batch; memory in MB (2^20 bytes); "
          "weights, grads and Adam state counted after the second learn, the memory model's value in brackets; "
          f"malloc mmap threshold: {args.mmap_threshold or 'glibc default'}\n")
    print("| variant | rank | trainable | weights | grads | Adam state | peak RSS | baseline | peak above baseline "
          "| model: activations | model: peak | s / learn |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        p = r["predicted"]
        print(f"| {r['variant']} | {r['rank']}/{r['world']} | {r['n_trainable'] / r['n_params']:.2%} "
              + "".join(f"| {r[k] / MB:.1f} ({p[k] / MB:.1f}) " for k in ("params", "grads", "optim"))
              + f"| {r['peak_mb']:.0f} | {r['baseline_mb']:.0f} | {r['peak_mb'] - r['baseline_mb']:.0f} "
              f"| {p['activations'] / MB:.0f} | {p['peak'] / MB:.0f} | {r['seconds']:.1f} |")
    norms = {r["variant"]: r["grad_norm"] for r in results if r["rank"] == 0}
    print("\nactor/grad_norm of the second learn (the same update in every full fine-tuning layout): "
          + ", ".join(f"{k} {v:.6f}" for k, v in norms.items()))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
