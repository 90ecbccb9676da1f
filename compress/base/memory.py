"""Host memory: handing freed heap back to the OS, so a long process's peak is what it holds, not what it once held."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the running process's own C library (glibc only)


def release_freed_memory() -> None:
    """Hand the heap pages a finished layer freed back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Without it glibc keeps them: each layer's dense weights and fp32 copies leave its arenas fragmented, and host
    memory grew by ~1.4x every layer's bf16 size, so a lazily read 3.8B model still peaked at 1.06x its weight file
    (``benchmarks/results/peak-rss-4b.md``) instead of at what the compressed layers keep."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def current_rss_mb() -> float:
    """This process's resident memory now (Linux ``/proc/self/statm``; elsewhere its peak so far, an upper bound)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
