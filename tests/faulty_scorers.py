"""Reward functions that misbehave on purpose, for the scoring-pool tests. Standard library only, so that a scorer
worker imports this quickly; the row's `extra_info["do"]` says what to do."""

import ctypes
import fcntl
import math
import os
import subprocess
import sys
import time

time.sleep(float(os.environ.get("FAULTY_SCORER_IMPORT_S") or 0))  # a scorer module slow to import, when asked


def by_extra(data_source, solution_str, ground_truth, extra_info):
    do = (extra_info or {}).get("do", "len")
    if do == "raise":
        raise ValueError("scorer bug")
    if do == "hang":
        time.sleep(3600)
    if do == "exit":
        os._exit(3)
    if do == "segfault":
        ctypes.string_at(0)
    if do == "subprocess":  # a scorer that runs programs of its own, as a code sandbox does
        out = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True)
        return float(out.stdout)
    if do == "child_then_hang":  # leaves a process behind, then hangs: the timeout must take both down
        child = subprocess.Popen(["sleep", "600"])
        with open(extra_info["pid_file"], "w") as f:
            f.write(str(child.pid))
        time.sleep(3600)
    if do == "value":
        return extra_info["value"]
    return float(len(solution_str))


def batch_lengths(data_sources, solution_strs, ground_truths, extra_infos):
    """A `batch` reward manager function: lists in, one score per response out (one short when asked)."""
    scores = [float(len(s)) for s in solution_strs]
    return scores[:-1] if any((e or {}).get("short") for e in extra_infos) else scores


def counted(data_source, solution_str, ground_truth, extra_info):
    """Numbers its calls across worker processes (a locked counter file) and, by call number, raises on 10%, hangs
    on 5% and returns NaN on 10% of the calls; each decision is appended to the log file."""
    path = os.environ["FAULTY_SCORER_LOG"]
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        k = len(f.read().splitlines())
        do = {3: "raise", 13: "raise", 7: "hang", 5: "nan", 15: "nan"}.get(k % 20, "ok")
        f.write(do + "\n")
    if do == "raise":
        raise RuntimeError(f"call {k} fails")
    if do == "hang":
        time.sleep(3600)
    if do == "nan":
        return math.nan
    return 1.0 if solution_str.strip().endswith(str(ground_truth)) else 0.1 * (k % 3)


def always_nan(data_source, solution_str, ground_truth, extra_info):
    return float("nan")
