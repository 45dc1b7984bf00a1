"""Freed host memory kept for reuse by this process, as a GPU engine's caching allocator keeps device memory.

glibc's malloc serves a large block (above a threshold that it raises up to 32 MiB as it sees blocks freed) with its
own mmap, and gives freed memory at the heap's top back to the system: every step of the CPU engine then maps and
page-faults its large activations afresh. On this machine's tiny model that cost a 512-token prefill ~2x its compute,
and made it vary 84-113 ms from step to step where 256 tokens vary by 1 ms (data: `engine.host_allocator_cache`'s row
in docs/fidelity.md). SGLang never pays it on a GPU: PyTorch's CUDA caching allocator keeps freed blocks. Raising the
thresholds (mallopt) keeps the process's peak heap mapped instead. The main thread's heap takes blocks up to
KEEP_BYTES; an engine stepping on another thread (LocalRanks, torchrun's rank-0 loop) allocates from a per-thread
heap of at most 64 MiB, so its blocks above that are still mapped per step (none of the tiny model's are).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3   # malloc.h
KEEP_BYTES = 1 << 30        # blocks up to 1 GiB come from the heap; up to 1 GiB freed at its top stays mapped
TOP_PAD_BYTES = 64 << 20    # the heap grows 64 MiB beyond a request at a time

_done: bool | None = None


def keep_freed_host_memory() -> bool:
    """Set this process's malloc to keep freed memory (once per process); False where the C library is not glibc
    (said once: steps then pay the system allocator's own costs)."""
    global _done
    if _done is None:
        refused = _mallopt()
        _done = not refused
        if refused:
            log.info("engine.host_allocator_cache: the C library refused %s; large host blocks are mapped per step "
                     "(slower, noisier CPU steps)", ", ".join(refused))
    return _done


def _mallopt() -> list[str]:
    """Each setting tried on its own; the names of those refused (every one where there is no glibc mallopt)."""
    settings = {"M_MMAP_THRESHOLD": (M_MMAP_THRESHOLD, KEEP_BYTES), "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, KEEP_BYTES),
                "M_TOP_PAD": (M_TOP_PAD, TOP_PAD_BYTES)}
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return list(settings)
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return [name for name, (param, value) in settings.items() if mallopt(param, value) != 1]
