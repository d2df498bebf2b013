"""Sandboxed code-reward throughput: responses scored per second, with 1 and 2 scorer processes.

    python benchmarks/sandbox.py [--samples 64] [--workers 1,2] [--url http://host:port]

Workload: the bundled code problems (`posttrain prepare code`), each response the reference solution in a ```python
block (so every test runs: a passing response is the most work), cycled to `--samples` responses and scored by the
registry's code scorer in a pool of worker processes, each response one bubblewrap run per stdin test or one run for
function/assert tests. `measure()` is importable (benchmarks/rewards.py uses it).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.reward.code import CodeSettings, configure  # noqa: E402
from posttrain.reward.registry import default_compute_score  # noqa: E402


def _jobs(samples: int) -> list[tuple]:
    import pyarrow.parquet as pq

    from posttrain.data.preprocess import prepare

    with tempfile.TemporaryDirectory() as tmp:
        prepare("code", None, tmp)
        rows = pq.read_table(Path(tmp) / "train.parquet").to_pylist()
    jobs = [(r["data_source"], f"```python\n{r['extra_info']['solution']}```", r["reward_model"]["ground_truth"],
             r["extra_info"]) for r in rows]
    return [jobs[i % len(jobs)] for i in range(samples)]


def _score(job) -> float:
    return default_compute_score(*job)["score"]


def measure(num_workers: int, samples: int = 64, url: str | None = None) -> dict:
    """{"workers", "samples", "seconds", "samples_per_s", "mean_score"} for one pool size (after one warm-up)."""
    configure(CodeSettings(url=url, run_timeout=10.0))
    jobs = _jobs(samples)
    with ProcessPoolExecutor(num_workers, mp_context=mp.get_context("fork")) as pool:
        list(pool.map(_score, jobs[:num_workers]))  # warm-up: workers started, sandbox probed
        start = time.perf_counter()
        scores = list(pool.map(_score, jobs))
        seconds = time.perf_counter() - start
    return {"workers": num_workers, "samples": samples, "seconds": round(seconds, 3),
            "samples_per_s": round(samples / seconds, 2), "mean_score": sum(scores) / len(scores)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--url", default=None, help="score on a SandboxFusion-compatible server instead")
    args = ap.parse_args()
    print(f"# {os.cpu_count()} CPUs; {'server ' + args.url if args.url else 'local bubblewrap sandbox'}")
    print("| scorer processes | samples | seconds | samples/s | mean score |\n|---|---|---|---|---|")
    for n in (int(w) for w in args.workers.split(",")):
        r = measure(n, args.samples, args.url)
        print(f"| {r['workers']} | {r['samples']} | {r['seconds']} | {r['samples_per_s']} | {r['mean_score']:.2f} |")


if __name__ == "__main__":
    main()
