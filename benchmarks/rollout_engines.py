"""The rollout engines side by side: posttrain's engine, vLLM's (`rollout.name=vllm`) and transformers' `generate`.

    python benchmarks/rollout_engines.py [--models S,M] [--dtypes fp32,bf16] [--engines posttrain,vllm,generate]
                                         [--calls 3] [--repeats 2] [--new-tokens 64] [--device cpu|cuda]
                                         [--vllm-eager] [--workdir DIR]

Workload: the random Qwen2 models S and M of grpo_step.py (and L on `--device cuda`), 16 GSM8K questions (chat
template) x 8 samples x exactly 64 new tokens (EOS ignored), temperature 1, log-probs of the sampled tokens
returned, each engine driven through posttrain's `RolloutEngine.generate` as the trainer drives it (the same
prompts, the same batch). vLLM runs as `rollout.name=vllm` runs it: its worker in the process, its default
compilation (`--vllm-eager`: `enforce_eager=True`), prefix caching on, weights pushed from the model before the
first call (load_format=dummy); on a CPU its KV cache is `VLLM_CPU_KVCACHE_SPACE` GiB (2 unless set).

Each (engine, model, dtype) runs in a fresh process, alternating the engines (`--repeats` rounds). Reported: start-up
(seconds from the model in memory to the engine ready: vLLM's engine, its compilation and the first weight push;
posttrain's engine and `generate` build nothing), tokens/s (sampled tokens / wall time of a generate call, median of
`--calls` calls after one warm-up call; the range over the repeats), and the process's peak resident memory — beside
the 2048^2 matmul ceiling measured in this same run, and each rate's share of the compute bound of decoding (2 x
parameters FLOPs a generated token at that ceiling; the prompts' prefill is not counted). Needs vLLM for its column (docs/rollout_engines.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import N, PROMPTS, build, cpu_description, matmul_ceiling  # noqa: E402

ENGINES = ("posttrain", "vllm", "generate")


def worker(args) -> None:
    """One engine on one model and dtype: prints one JSON line of measurements."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from posttrain.data.batch import Batch
    from posttrain.data.dataset import RLDataset, collate_prompts
    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.policy import PolicyModel
    from posttrain.rollout.base import SamplingParams

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    path = str(Path(args.workdir) / args.model)
    tokenizer = load_tokenizer(path)
    data = RLDataset([str(Path(args.workdir) / "train.jsonl")], tokenizer, max_prompt_length=512)
    prompts, mask = collate_prompts(data.items[:PROMPTS], tokenizer.pad_token_id)
    policy = PolicyModel(load_causal_lm(path, device=device).eval())
    start = time.perf_counter()
    if args.engine == "posttrain":
        from posttrain.rollout.engine import DecodeEngine

        engine = DecodeEngine(policy, tokenizer, device=device, dtype=dtype)
    elif args.engine == "generate":
        from posttrain.rollout.transformers_generate import TransformersGenerate

        engine = TransformersGenerate(policy, tokenizer, device=device, dtype=dtype)
    else:
        from posttrain.rollout.vllm.engine import VLLMEngine
        from posttrain.rollout.vllm.settings import EngineSettings

        settings = EngineSettings(model_path=path, dtype=dtype, seed=0, enforce_eager=args.vllm_eager,
                                  max_model_len=prompts.shape[1] + args.new_tokens, load_format="dummy",
                                  free_cache_engine=False)
        engine = VLLMEngine(policy, tokenizer, device=device, dtype=dtype, settings=settings)
        engine.sync_weights()
    startup = time.perf_counter() - start
    batch = Batch({"prompts": prompts, "prompt_mask": mask}, {"uid": [str(i) for i in range(PROMPTS)]})
    sampling = SamplingParams(n=N, temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=True)
    rates = []
    torch.manual_seed(0)
    for call in range(args.calls + 1):  # the first call warms up
        t = time.perf_counter()
        out = engine.generate(batch, sampling)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        tokens = int(out["response_mask"].sum())
        assert tokens == PROMPTS * N * args.new_tokens, tokens
        if call:
            rates.append(tokens / seconds)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print("RESULT" + json.dumps({"startup_s": startup, "tokens_per_s": statistics.median(rates), "peak_gb": peak,
                                 "params": sum(p.numel() for p in policy.parameters())}))


def run_one(args, engine: str, model: str, dtype: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--engine", engine, "--model", model, "--dtype", dtype,
           "--device", args.device, "--calls", str(args.calls), "--new-tokens", str(args.new_tokens),
           "--workdir", str(args.workdir)] + (["--vllm-eager"] if args.vllm_eager else [])
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT")), None)
    if result.returncode != 0 or line is None:
        sys.exit(f"{engine} {model} {dtype} failed:\n{result.stderr[-3000:]}")
    return json.loads(line[len("RESULT"):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="S,M")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--vllm-eager", action="store_true")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--engine")
    p.add_argument("--model")
    p.add_argument("--dtype")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rollout_engines_"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    models, dtypes, engines = args.models.split(","), args.dtypes.split(","), args.engines.split(",")
    build(args.workdir, models)
    ceiling = matmul_ceiling(args.device, dtypes)
    print(f"# {cpu_description(args.device)}")
    print("# 2048^2 matmul ceiling: " + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in ceiling.items()))
    print(f"# {PROMPTS} prompts x {N} samples x {args.new_tokens} new tokens, temperature 1; median of {args.calls} "
          f"calls after a warm-up, range over {args.repeats} rounds")
    results: dict = {}
    for round_ in range(args.repeats):
        for model in models:
            for dtype in dtypes:
                order = engines if round_ % 2 == 0 else engines[::-1]
                for engine in order:
                    result = run_one(args, engine, model, dtype)
                    print(f"# round {round_ + 1}: {model} {dtype} {engine} {json.dumps(result)}", flush=True)
                    results.setdefault((model, dtype, engine), []).append(result)
    print("| model, dtype | engine | tokens/s | % of compute bound | start-up s | peak RSS GB |")
    print("|---|---|---|---|---|---|")
    for (model, dtype, engine), runs in results.items():
        rate = [r["tokens_per_s"] for r in runs]
        start = [r["startup_s"] for r in runs]
        peak = max(r["peak_gb"] for r in runs)
        bound = ceiling[dtype] * 1e9 / (2 * runs[0]["params"])  # tokens/s at the ceiling, 2 x parameters a token
        print(f"| {model} {dtype} | {engine} | {min(rate):.0f}-{max(rate):.0f} | {100 * min(rate) / bound:.1f}-"
              f"{100 * max(rate) / bound:.1f}% | {min(start):.1f}-{max(start):.1f} | {peak:.2f} |")


if __name__ == "__main__":
    main()
