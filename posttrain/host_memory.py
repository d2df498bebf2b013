"""On a CPU, keep freed memory for the next step instead of handing it back to the operating system.

Why: glibc's malloc serves blocks over its mmap threshold (32 MiB at most, often far less) with fresh pages from
the kernel and unmaps them when they are freed, so each training step faults in its activations again, page by
page, and the kernel zeroes each page first. A GRPO step of the 25M-parameter benchmark model took about 800,000
page faults; kept, about 20,000, and its training phase ran 8-10% faster (docs/performance.md). The price: between
steps the process holds what its last step freed (its resident size stays near the step's peak instead of falling
back), up to 2 GiB above the heap's top.

Only glibc is tuned, only once, and not where the process already chose: an allocator preloaded in its place
(jemalloc, tcmalloc), glibc's own `MALLOC_*` variables or malloc tunables, or `POSTTRAIN_KEEP_FREED_MEMORY=0`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: free memory above 2 GiB at the heap's top is still returned
_done = False


def keep_freed_memory() -> bool:
    """Tune glibc (no blocks served by mmap, freed memory kept) unless the process chose otherwise; True when this
    call or an earlier one tuned it."""
    global _done
    if _done:
        return True
    if os.environ.get("POSTTRAIN_KEEP_FREED_MEMORY", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return False
    if any(key.startswith("MALLOC_") for key in os.environ) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    _done = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if _done:
        log.debug("glibc malloc: blocks from the heap, freed memory kept up to %d bytes", TRIM_THRESHOLD)
    return _done
