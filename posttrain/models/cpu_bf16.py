"""Does this CPU run bf16 arithmetic natively, and what a bf16 run costs where it does not.

torch's fast CPU bf16 matmul needs AVX512-BF16 or AMX. Without them (an AVX2-only CPU such as AMD Zen 3) every bf16
matmul goes through a slow conversion path: 0.8 GFLOP/s against fp32's 51 on one thread, a GRPO step of 67 s where
fp32 takes 2 s. So `auto` resolves to fp32 there, and an explicit bf16 gets one warning, with the slowdown measured
on a small matmul (the decision itself reads only the CPU's capability, never a timing).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

log = logging.getLogger(__name__)
_PROBES = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")


def cpu_bf16_native() -> bool:
    """AVX512-BF16 or AMX tiles, as torch reports them: the instructions its bf16 matmul kernels use."""
    probes = [getattr(torch.cpu, name, None) for name in _PROBES]
    return any(bool(probe()) for probe in probes if probe is not None)


def cpu_bf16_summary() -> str:
    """One line for a benchmark's header: torch's CPU capability and whether bf16 is native."""
    kind = "native (AVX512-BF16 or AMX)" if cpu_bf16_native() else "emulated (no AVX512-BF16 or AMX: slow)"
    return f"CPU capability {torch.backends.cpu.get_cpu_capability()}, bf16 {kind}"


def bf16_slowdown(size: int = 256) -> tuple[float, float]:
    """GFLOP/s of a (size x size) matmul in fp32 and in bf16 on this CPU, best of three each."""
    rates = []
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        rates.append(2 * size**3 / max(best, 1e-9) / 1e9)
    return rates[0], rates[1]


@functools.cache
def warn_emulated_bf16() -> None:
    """Once per process, when bf16 is asked for on a CPU that emulates it."""
    fp32, bf16 = bf16_slowdown()
    log.warning("bf16 on this CPU is emulated (%s): a bf16 matmul ran at %.1f GFLOP/s against fp32's %.1f here "
                "(%.1fx slower), and training runs about that much slower; use fp32 (a dtype of `fp32` or `auto`, "
                "e.g. actor_rollout_ref.model.dtype=fp32 and rollout.dtype=fp32, or --dtype fp32)",
                cpu_bf16_summary(), bf16, fp32, fp32 / max(bf16, 1e-9))
