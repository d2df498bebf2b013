"""One GRPO step, side by side: posttrain vs TRL's GRPOTrainer (and transformers' plain `generate`).

    python benchmarks/grpo_step.py [--models S,M] [--dtypes fp32,bf16] [--steps 3] [--warmup 1] [--repeats 2]
                                   [--frameworks posttrain,trl,generate] [--device cpu|cuda] [--new-tokens 64]
                                   [--workdir DIR]

Workload (the same for both frameworks): random Qwen2 models built offline — S (hidden 256, 4 layers, 3.5M
parameters), M (hidden 512, 8 layers, 24.7M), and on `--device cuda` also L (a Qwen2.5-0.5B-shaped config, 0.5B)
— with a byte-level BPE tokenizer of 2048 entries trained on GSM8K; 16 GSM8K questions per step (chat template)
x 8 samples x exactly 64 new tokens (`--new-tokens`; EOS ignored / `min_new_tokens`), temperature 1, scored by the
GSM8K scorer; Dr. GRPO (no std scaling, `seq-mean-token-sum-norm` / `dr_grpo`), no reference model, one
optimizer step per rollout, no gradient checkpointing, weights in float32 with bf16 autocast for `bf16`. TRL runs
with `use_cpu=True` on CPU, `report_to="none"`, `num_iterations=1`, `beta=0`, `scale_rewards="none"`.
`generate` is transformers' `model.generate` on the same prompts (fp32 weights under autocast: what posttrain
used before its own engine), generation only. `posttrain-eager` (for `--device cuda`) is posttrain with
`rollout.enforce_eager=True`: its decoding steps launched one by one instead of replayed as CUDA graphs.
`posttrain-compile` / `posttrain-nocompile` are posttrain with `actor.use_torch_compile=True` / `False` (each
decoder layer's training forward and backward compiled or not; `posttrain` keeps the default, which compiles M in
fp32 on a CPU); the ratios line says compile's training-phase gain, the compile time its first (warm-up) step
carries over the eager run's, and after how many steps the gain pays for it.

Each (framework, model, dtype) runs in a fresh process, alternating A B A B (`--repeats`), and reports the median
over its measured steps and repeats: s/step, generation and training seconds (training = the step minus generation
and scoring), completion tokens/s, peak resident memory of the process, training GFLOP/s (6 x parameters x tokens
/ training time, tokens = prompt + completion tokens of the step, every sample's prompt counted as TRL computes
it), computed GFLOP/s (the same with the tokens each framework computes: posttrain's shared-prompt path computes a
prompt once for its N samples) and decode tokens/s, these beside the 2048^2 matmul ceiling measured in this same
run, at its start and end (fractions are of the higher of the two; for decoding: 2 x parameters x tokens / time, as
a share of it).
The step's compute bound is 8 x parameters x T FLOPs (6NT training, 2NT generation; T the tokens the step needs:
each prompt once for its N samples, and every response) at the ceiling; the table gives the share of it each framework's step and
training phase reach, against two ceilings measured in the same run: the 2048^2 matmul, and in brackets the
model's own largest training GEMMs (its MLP and output-head products, forward and both gradients, over 8192 rows;
the header says how far that is below 2048^2).
The header names the CPU, the vector class its kernels run at (AMX, AVX-512, AVX2) and whether bf16 is native, and
any emulation in force: `ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2` runs a
newer CPU's kernels as an AVX2-only CPU's (not its clock, caches or memory).
Needs TRL for the `trl` column (`pip install trl`; it keeps the installed torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "S": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704),
    "M": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408),
    "L": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),
}
PROMPTS, N, NEW_TOKENS = 16, 8, 64


# ---------------------------------------------------------------- setup (parent process)

def build(workdir: Path, models: list[str]) -> None:
    """Tokenizer + random models + the GSM8K prompts in posttrain's data layout (once per workdir)."""
    from posttrain.data.dataset import layout_row
    from posttrain.data.preprocess import find_shared_data
    from posttrain.models.tiny import build_tiny_model

    shared = find_shared_data()
    if shared is None:
        sys.exit("needs the GSM8K files of shared/data (see README)")
    rows = [json.loads(line) for line in (shared / "gsm8k" / "train.jsonl").read_text().splitlines()]
    data = workdir / "train.jsonl"
    if not data.exists():
        questions = rows[: PROMPTS * 20]
        data.write_text("".join(json.dumps(layout_row("openai/gsm8k", q["question"],
                                                      q["answer"].split("####")[-1].strip(), {"index": i})) + "\n"
                                for i, q in enumerate(questions)))
    texts = [r["question"] + "\n" + r["answer"] for r in rows]
    for name in models:
        if not (workdir / name / "config.json").exists():
            build_tiny_model(workdir / name, texts, vocab_size=2048, max_position_embeddings=1024, **SHAPES[name])


def matmul_ceiling(device: str, dtypes: tuple[str, ...] | list[str] = ("fp32", "bf16")) -> dict[str, float]:
    """GFLOP/s of a 2048 x 2048 matmul in each of `dtypes`, best of a few (a dtype not measured costs nothing: an
    emulated bf16 matmul of this size takes ~20 s)."""
    import torch

    out = {}
    for name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        a = torch.randn(2048, 2048, dtype=dtype, device=device)
        b = torch.randn(2048, 2048, dtype=dtype, device=device)
        best = float("inf")
        for _ in range(5):
            _sync(device)
            start = time.perf_counter()
            for _ in range(4):
                a @ b
            _sync(device)
            best = min(best, (time.perf_counter() - start) / 4)
        out[name] = 2 * 2048**3 / best / 1e9
    return out


def model_shape_ceiling(device: str, dtypes, shape: dict, vocab: int, tokens: int = 8192) -> dict[str, float]:
    """GFLOP/s of the model's own largest training GEMMs — the MLP's up and down projections and the output head,
    each as its forward, input-gradient and weight-gradient product over `tokens` rows — in each of `dtypes`: the
    ceiling a model of these widths can reach (a small model's products run below the 2048^2 rate)."""
    import torch

    h, i = shape["hidden_size"], shape["intermediate_size"]
    out = {}
    for name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        flops, seconds = 0.0, 0.0
        for fan_in, fan_out in ((h, i), (i, h), (h, vocab)):
            x = torch.randn(tokens, fan_in, dtype=dtype, device=device)
            w = torch.randn(fan_out, fan_in, dtype=dtype, device=device)
            g = torch.randn(tokens, fan_out, dtype=dtype, device=device)
            for product in (lambda: x @ w.t(), lambda: g @ w, lambda: g.t() @ x):
                best = float("inf")
                for _ in range(3):
                    _sync(device)
                    start = time.perf_counter()
                    product()
                    _sync(device)
                    best = min(best, time.perf_counter() - start)
                flops, seconds = flops + 2 * tokens * fan_in * fan_out, seconds + best
        out[name] = flops / seconds / 1e9
    return out


EMULATION_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
ISA_ORDER = ("default", "sse4_2", "avx", "avx2", "avx512", "amx")  # for reading the emulation caps


def cpu_flags(cpuinfo: str) -> tuple[str, set[str]]:
    """The CPU's model name and instruction-set flags, from /proc/cpuinfo's text (its first processor)."""
    model, flags = "unknown CPU", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, flags


def cpu_class(flags: set[str], emulation: dict[str, str]) -> tuple[str, bool]:
    """The widest vector class the run's matmuls and kernels may use (AMX, AVX-512, AVX2, below AVX2), and whether
    bf16 arithmetic is native to it (AMX or AVX512-BF16). The emulation variables cap both at the class they name
    (the hardware keeps its flags: /proc/cpuinfo cannot show an emulation)."""
    if "amx_tile" in flags:
        hardware = "amx"
    elif "avx512f" in flags:
        hardware = "avx512"
    elif "avx2" in flags:
        hardware = "avx2"
    else:
        hardware = "default"
    rank = ISA_ORDER.index(hardware)
    for value in emulation.values():
        name = value.strip().lower().replace("-", "_")
        name = "avx512" if name.startswith("avx512") or name.startswith("avx10") else name
        name = "amx" if name.startswith("amx") else name
        if name in ISA_ORDER:
            rank = min(rank, ISA_ORDER.index(name))
    isa = ISA_ORDER[rank]
    native_bf16 = isa == "amx" or (isa == "avx512" and "avx512_bf16" in flags)
    return {"amx": "AMX", "avx512": "AVX-512", "avx2": "AVX2", "avx": "AVX", "sse4_2": "SSE4.2"}.get(
        isa, "below AVX2"), native_bf16


def cpu_description(device: str) -> str:
    """Beside the ceilings: the CPU model, the vector class its kernels run at (a CPU without AVX512-BF16 or AMX
    emulates bf16, tens of times slower than fp32), and the emulation variables in force, if any."""
    if device == "cuda":
        import torch

        return f"GPU {torch.cuda.get_device_name()}"
    import torch

    try:
        model, flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        model, flags = "unknown CPU", set()
    emulation = {k: os.environ[k] for k in EMULATION_VARS if os.environ.get(k)}
    isa, native = cpu_class(flags, emulation)
    hardware = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    text = (f"{model}, CPU class {isa} (torch CPU capability {torch.backends.cpu.get_cpu_capability()}; "
            f"hardware flags {' '.join(hardware) or 'none of avx2/avx512f/amx'}), bf16 "
            + ("native" if native else "emulated (no AVX512-BF16 or AMX in use: slow)"))
    if emulation:
        text += ", EMULATION in force: " + " ".join(f"{k}={v}" for k, v in emulation.items())
    return text


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# ---------------------------------------------------------------- workers (one fresh process each)

def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def posttrain_trainer(workdir: Path, model: str, dtype: str, steps: int, device: str, *extra: str):
    """posttrain's RLTrainer for the workload (also used by benchmarks/shared_prompt.py)."""
    from posttrain.config import load_config
    from posttrain.trainer.rl import RLTrainer

    overrides = [
        f"data.train_files={workdir / 'train.jsonl'}", f"data.train_batch_size={PROMPTS}",
        "data.max_prompt_length=512", f"data.max_response_length={NEW_TOKENS}", "data.shuffle=False",
        f"actor_rollout_ref.model.path={workdir / model}", f"actor_rollout_ref.model.dtype={dtype}",
        f"actor_rollout_ref.rollout.dtype={dtype}", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"actor_rollout_ref.rollout.n={N}", f"actor_rollout_ref.rollout.response_length={NEW_TOKENS}",
        "actor_rollout_ref.rollout.ignore_eos=True", "actor_rollout_ref.rollout.temperature=1.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}", "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False", "algorithm.use_kl_in_reward=False",
        f"trainer.total_training_steps={steps}", "trainer.logger=[]", f"trainer.device={device}",
        f"trainer.default_local_dir={workdir / 'run_posttrain'}", "trainer.save_freq=-1", "trainer.test_freq=-1",
        *extra,
    ]
    return RLTrainer(load_config(None, overrides))


def run_posttrain(workdir: Path, model: str, dtype: str, steps: int, device: str, *extra: str) -> list[dict]:
    trainer = posttrain_trainer(workdir, model, dtype, steps, device, *extra)
    out = []
    for _ in range(steps):
        trainer.global_step += 1
        m = trainer.train_step()
        gen, reward, step = m["timing_s/gen"], m.get("timing_s/reward", 0.0), m["timing_s/step"]
        out.append(dict(step=step, gen=gen, train=step - gen - reward, tokens=m["response_length/mean"] * PROMPTS * N,
                        all_tokens=(m["response_length/mean"] + m["prompt_length/mean"]) * PROMPTS * N,
                        # the shared-prompt path computes each prompt once for its N samples
                        computed_tokens=m["prompt_length/mean"] * PROMPTS + m["response_length/mean"] * PROMPTS * N,
                        graphs=getattr(trainer.parts.engine, "graphs_recorded", 0)))
    return out


def run_posttrain_eager(workdir: Path, model: str, dtype: str, steps: int, device: str) -> list[dict]:
    """posttrain with `rollout.enforce_eager=True`: on a GPU, decoding without CUDA graphs."""
    return run_posttrain(workdir, model, dtype, steps, device, "actor_rollout_ref.rollout.enforce_eager=True")


def run_trl(workdir: Path, model: str, dtype: str, steps: int, device: str) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.reward.gsm8k import compute_score

    rows = [json.loads(line) for line in (workdir / "train.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"]} for r in rows])

    def reward(completions, answer, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [float(compute_score(text, a)) for text, a in zip(texts, answer)]

    args = GRPOConfig(
        output_dir=str(workdir / "run_trl"), per_device_train_batch_size=PROMPTS * N, gradient_accumulation_steps=1,
        num_generations=N, max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS},
        temperature=1.0, top_p=1.0, learning_rate=1e-6, beta=0.0, loss_type="dr_grpo", scale_rewards="none",
        num_iterations=1, use_cpu=device == "cpu", bf16=dtype == "bf16", gradient_checkpointing=False,
        report_to="none", logging_steps=1, max_steps=steps, save_strategy="no", seed=0, shuffle_dataset=False,
        dataloader_num_workers=0, disable_tqdm=True)
    tokenizer = AutoTokenizer.from_pretrained(workdir / model)
    lm = AutoModelForCausalLM.from_pretrained(workdir / model, dtype=torch.float32)
    trainer = GRPOTrainer(model=lm, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    record: list[dict] = []
    gen_time = [0.0]
    generate = trainer._generate_single_turn

    def timed_generate(*a, **k):
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            gen_time[0] += time.perf_counter() - start

    trainer._generate_single_turn = timed_generate
    state = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            gen_time[0] = 0.0
            state["start"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kw):
            step = time.perf_counter() - state["start"]
            record.append(dict(step=step, gen=gen_time[0], train=step - gen_time[0]))

    trainer.add_callback(Timer())
    trainer.train()
    for i, r in enumerate(record):
        r["tokens"] = PROMPTS * N * NEW_TOKENS
        r["all_tokens"] = _prompt_tokens(tokenizer, rows, i) * N + r["tokens"]
    return record


def _prompt_tokens(tokenizer, rows, step: int) -> int:
    """Prompt tokens of step `step`'s prompts (no padding), as posttrain counts them."""
    total = 0
    for r in rows[step * PROMPTS:(step + 1) * PROMPTS]:
        ids = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        total += len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return total


def run_generate(workdir: Path, model: str, dtype: str, steps: int, device: str) -> list[dict]:
    """transformers' generate on fp32 weights under autocast: posttrain's generation before its own engine."""
    import torch

    from posttrain.data.dataset import RLDataset, collate_prompts
    from posttrain.models.load import autocast, load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(str(workdir / model))
    data = RLDataset([str(workdir / "train.jsonl")], tokenizer, max_prompt_length=512)
    lm = load_causal_lm(str(workdir / model), device=device).eval()
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    out = []
    for step in range(steps):
        prompts, mask = collate_prompts(data.items[step * PROMPTS:(step + 1) * PROMPTS], tokenizer.pad_token_id)
        prompts, mask = prompts.repeat_interleave(N, 0).to(device), mask.repeat_interleave(N, 0).to(device)
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad(), autocast(torch.device(device), torch_dtype):
            lm.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=tokenizer.pad_token_id)
        _sync(device)
        gen = time.perf_counter() - start
        out.append(dict(step=gen, gen=gen, train=0.0, tokens=PROMPTS * N * NEW_TOKENS,
                        all_tokens=int(mask.sum()) + PROMPTS * N * NEW_TOKENS))
    return out


def run_posttrain_compile(workdir: Path, model: str, dtype: str, steps: int, device: str) -> list[dict]:
    """posttrain with `actor.use_torch_compile=True`: each decoder layer's training forward and backward compiled
    (its first step carries the compile time)."""
    return run_posttrain(workdir, model, dtype, steps, device, "actor_rollout_ref.actor.use_torch_compile=True")


def run_posttrain_nocompile(workdir: Path, model: str, dtype: str, steps: int, device: str) -> list[dict]:
    """posttrain with `actor.use_torch_compile=False` (the default compiles M in fp32 on a CPU)."""
    return run_posttrain(workdir, model, dtype, steps, device, "actor_rollout_ref.actor.use_torch_compile=False")


RUNNERS = {"posttrain": run_posttrain, "posttrain-eager": run_posttrain_eager,
           "posttrain-compile": run_posttrain_compile, "posttrain-nocompile": run_posttrain_nocompile,
           "trl": run_trl, "generate": run_generate}


def worker(args) -> None:
    import torch

    torch.manual_seed(0)
    steps = args.warmup + args.steps
    record = RUNNERS[args.worker](Path(args.workdir), args.model, args.dtype, steps, args.device)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(Path(args.workdir) / args.model)
    params = _param_count(Path(args.workdir) / args.model)
    gpu = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
    print("RESULT " + json.dumps(dict(steps=record[args.warmup:], first=record[0], params=params, rss=peak_rss_gb(),
                                      gpu=gpu,
                                      vocab=config.vocab_size)))


def _param_count(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                n = 1
                for size in f.get_slice(key).get_shape():
                    n *= size
                total += n
    return total


# ---------------------------------------------------------------- report

def summarise(results: list[dict], params: int, ceiling: float, shape_ceiling: float | None = None) -> dict:
    """Medians over steps and repeats, rates, and fractions of the compute bound: 8 N T FLOPs for the whole step
    (6 N T training, 2 N T generation; N parameters, T the step's prompt + response tokens) at the ceiling."""
    steps = [s for r in results for s in r["steps"]]
    med = {k: statistics.median(s[k] for s in steps) for k in ("step", "gen", "train", "tokens", "all_tokens")}
    med["computed_tokens"] = statistics.median(s.get("computed_tokens", s["all_tokens"]) for s in steps)
    out = dict(med, rss=max(r["rss"] for r in results), gpu=max(r.get("gpu", 0.0) for r in results))
    out["tok_s"] = med["tokens"] / med["step"]
    out["decode_tok_s"] = med["tokens"] / med["gen"]
    out["decode_ceiling"] = 2 * params * med["tokens"] / med["gen"] / 1e9 / ceiling
    out["train_gflops"] = 6 * params * med["all_tokens"] / med["train"] / 1e9 if med["train"] > 0 else 0.0
    out["train_ceiling"] = out["train_gflops"] / ceiling
    out["computed_gflops"] = 6 * params * med["computed_tokens"] / med["train"] / 1e9 if med["train"] > 0 else 0.0
    out["computed_ceiling"] = out["computed_gflops"] / ceiling
    # the bound counts the work the step needs: each prompt once for its N samples, and every response
    out["step_bound"] = 8 * params * med["computed_tokens"] / med["step"] / 1e9 / ceiling
    if shape_ceiling:
        out["step_bound_shape"] = 8 * params * med["computed_tokens"] / med["step"] / 1e9 / shape_ceiling
        out["train_bound_shape"] = out["computed_gflops"] / shape_ceiling
    return out


def main() -> None:
    global NEW_TOKENS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="S,M")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--frameworks", default="posttrain,trl,generate")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens generated per sample")
    p.add_argument("--workdir")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args()
    NEW_TOKENS = args.new_tokens  # the workload's constant, set for this process (and passed to each worker)
    if args.worker:
        return worker(args)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="grpo_step_"))
    workdir.mkdir(parents=True, exist_ok=True)
    models, dtypes = args.models.split(","), args.dtypes.split(",")
    frameworks = args.frameworks.split(",")
    if "trl" in frameworks and importlib.util.find_spec("trl") is None:
        print("# TRL is not installed (pip install trl): its column is left out", flush=True)
        frameworks.remove("trl")
    build(workdir, models)
    ceiling = matmul_ceiling(args.device, dtypes)
    rates = ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in ceiling.items())
    print(f"# matmul ceiling (2048^2, {args.device}): {rates}; workdir {workdir}", flush=True)
    print(f"# device: {cpu_description(args.device)}", flush=True)
    vocab = json.loads((workdir / models[0] / "config.json").read_text())["vocab_size"]
    shape_ceiling = {m: model_shape_ceiling(args.device, dtypes, SHAPES[m], vocab) for m in models}
    for m in models:
        print(f"# model-shape ceiling ({m}'s MLP and head products over 8192 rows): "
              + ", ".join(f"{d} {g:.0f} GFLOP/s ({100 * g / ceiling[d]:.0f}% of 2048^2)"
                          for d, g in shape_ceiling[m].items()), flush=True)
    results: dict = {}
    for model in models:
        for dtype in dtypes:
            for rep in range(args.repeats):
                order = frameworks if rep % 2 == 0 else frameworks[::-1]
                for fw in order:
                    cmd = [sys.executable, __file__, "--worker", fw, "--model", model, "--dtype", dtype,
                           "--workdir", str(workdir), "--steps", str(args.steps), "--warmup", str(args.warmup),
                           "--device", args.device, "--new-tokens", str(args.new_tokens)]
                    start = time.perf_counter()
                    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ,
                                                                                    "TOKENIZERS_PARALLELISM": "false"})
                    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                    if proc.returncode != 0 or not lines:
                        print(f"# {fw} {model} {dtype} failed:\n{proc.stderr[-3000:]}", flush=True)
                        continue
                    res = json.loads(lines[-1][len("RESULT "):])
                    results.setdefault((model, dtype, fw), []).append(res)
                    step = statistics.median(s["step"] for s in res["steps"])
                    graphs = res["steps"][-1].get("graphs")
                    print(f"# {fw:9s} {model} {dtype} run {rep + 1}: {step:.2f}"
                          f" s/step ({time.perf_counter() - start:.0f} s with start-up)"
                          + (f", {graphs} CUDA graphs recorded per generate call" if graphs else ""), flush=True)
    end_ceiling = matmul_ceiling(args.device, dtypes)
    best_ceiling = {d: max(ceiling[d], end_ceiling[d]) for d in dtypes}  # fractions of the higher of the two
    for m in models:  # the model-shape ceilings too
        end_shape = model_shape_ceiling(args.device, dtypes, SHAPES[m], vocab)
        shape_ceiling[m] = {d: max(shape_ceiling[m][d], end_shape[d]) for d in dtypes}
    print(f"# model-shape ceilings, the higher of start and end: {shape_ceiling}")
    print(f"# matmul ceiling at the end: {', '.join(f'{d} {g:.0f}' for d, g in end_ceiling.items())} GFLOP/s "
          f"({cpu_description(args.device)})\n")
    print("| model, dtype | framework | s/step | gen s | train s | completion tok/s | decode tok/s (% ceiling) | "
          "train GFLOP/s (% ceiling) | computed GFLOP/s (% ceiling) | step % of bound (model-shape) | "
          "train % of bound (model-shape) | peak RSS GB |"
          + (" peak GPU GB |" if args.device == "cuda" else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.device == "cuda" else ""))
    ratios = []
    for model in models:
        for dtype in dtypes:
            rows = {}
            for fw in frameworks:
                if (model, dtype, fw) not in results:
                    continue
                res = results[(model, dtype, fw)]
                s = summarise(res, res[0]["params"], best_ceiling[dtype], shape_ceiling[model][dtype])
                rows[fw] = s
                train = f"{s['train']:.2f}" if fw != "generate" else "-"
                gflops = f"{s['train_gflops']:.0f} ({100 * s['train_ceiling']:.0f}%)" if fw != "generate" else "-"
                computed = (f"{s['computed_gflops']:.0f} ({100 * s['computed_ceiling']:.0f}%)" if fw != "generate"
                            else "-")
                print(f"| {model} {dtype} ({res[0]['params'] / 1e6:.1f}M) | {fw} | {s['step']:.2f} | {s['gen']:.2f} | "
                      f"{train} | {s['tok_s']:.0f} | {s['decode_tok_s']:.0f} ({100 * s['decode_ceiling']:.1f}%) | "
                      f"{gflops} | {computed} | "
                      + (f"{100 * s['step_bound']:.0f}% ({100 * s['step_bound_shape']:.0f}%) | "
                         f"{100 * s['computed_ceiling']:.0f}% ({100 * s['train_bound_shape']:.0f}%)"
                         if fw != "generate" else "- | -") + f" | {s['rss']:.2f} |"
                      + (f" {s['gpu']:.2f} |" if args.device == "cuda" else ""))
            if "posttrain" in rows:
                pt = rows["posttrain"]
                line = [f"{model} {dtype}:"]
                if "trl" in rows:
                    t = rows["trl"]
                    line.append(f"step TRL/posttrain {t['step'] / pt['step']:.2f}x, "
                                f"generation {t['gen'] / pt['gen']:.2f}x, "
                                f"training GFLOP/s posttrain/TRL {pt['train_gflops'] / t['train_gflops']:.2f}x, "
                                f"peak RSS posttrain/TRL {pt['rss'] / t['rss']:.2f}"
                                + (f", peak GPU posttrain/TRL {pt['gpu'] / t['gpu']:.2f}" if args.device == "cuda"
                                   else ""))
                if "generate" in rows:
                    speedup = rows["generate"]["gen"] / pt["gen"]
                    line.append(f"decode tokens/s posttrain / transformers generate {speedup:.2f}x")
                if "posttrain-compile" in rows:
                    c, eager = rows["posttrain-compile"], ("posttrain-nocompile" if "posttrain-nocompile" in rows
                                                           else "posttrain")
                    e = rows[eager]
                    def first(fw):
                        return statistics.median(r["first"]["step"] for r in results[(model, dtype, fw)])

                    extra, gain = first("posttrain-compile") - first(eager), e["train"] - c["train"]
                    line.append(f"use_torch_compile: training phase eager/compiled {e['train'] / c['train']:.2f}x "
                                f"({100 * c['computed_ceiling']:.0f}% of the bound against "
                                f"{100 * e['computed_ceiling']:.0f}%), "
                                f"first step +{extra:.0f} s (compilation), "
                                + (f"earned back after {extra / gain:.0f} steps" if gain > 0 else "never earned back"))
                if "posttrain-eager" in rows:
                    line.append(f"generation eager / CUDA graphs {rows['posttrain-eager']['gen'] / pt['gen']:.2f}x")
                ratios.append(line[0] + " " + "; ".join(line[1:]))
    print()
    for line in ratios:
        print("- " + line)


if __name__ == "__main__":
    main()
