"""Keep a process's freed tensor memory for its next request (glibc malloc tuning, issue 21).

Why: every ``ask`` decodes a context's K/V (hundreds of MB at 4K tokens for
a small model, more with transformers' ``repeat_kv`` copies) into fresh
tensors. glibc serves each allocation over its dynamic mmap threshold with a
new ``mmap`` and gives it back with ``munmap`` on free, so *every* request,
warm or not, first-touches its memory again: measured on the 2-core box,
~150,000 minor page faults and ~0.5 s of system time per 4K-token ask, a
third of its time to first token. Raising the mmap threshold to glibc's
maximum (32 MiB on 64-bit) serves those tensors from the heap, and raising
the trim threshold keeps freed heap memory mapped, so a process's second
request reuses pages the first one faulted in (0 faults, 0.01 s system time
in the same measurement). The price is resident memory: a process keeps up
to ``trim_threshold`` bytes of freed memory instead of returning it.

This changes process-wide allocator behaviour, so the library never does it
on import: the ``kvc`` command calls :func:`tune_allocator` at start-up, and so
do the benchmarks that compare a warm process with a fresh ``kvc`` process
(both sides tuned alike).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

import numpy as np

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit; larger values are refused
DEFAULT_TRIM_THRESHOLD = 1 << 30


def tune_allocator(trim_threshold: int = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Set glibc's mmap and trim thresholds for this process, and one malloc arena for all threads;
    False (nothing changed) off glibc.

    One arena: glibc gives each new thread its own arena, and memory freed there is reused by that
    thread only, so pages :func:`prefault` touched in a background thread would never serve the
    main thread's tensors. The price is lock sharing between threads that malloc at once; the
    codec and torch allocate per tensor, not per element, so it does not show."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, int(trim_threshold)))
            and bool(mallopt(M_ARENA_MAX, 1)))


#: Largest :func:`prefault`: the trim threshold, above which glibc would hand the pages back anyway.
PREFAULT_MAX = DEFAULT_TRIM_THRESHOLD
_PREFAULT_PIECE = 16 << 20  # under the mmap threshold: from the heap, so freed pages stay mapped


def _available() -> int:
    """Bytes of physical memory free now (no limit where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return PREFAULT_MAX * 4


def prefault(nbytes: int) -> int:
    """Fault ``nbytes`` (at most :data:`PREFAULT_MAX`, and at most a quarter of the free physical
    memory: a guess at the request's size must never be what exhausts the machine) of heap pages in
    and free them again; returns the bytes touched.

    Why: a fresh process's first request first-touches every page of its decoded K/V and the
    attention's copies (~140 KB per token for the embedded model: ~0.3 s of page faults at 4K
    tokens, the cold/warm gap of ``kvc ask``). Run in a background thread while the model loads
    (:func:`kvcodec.runtime.warmup.prewarm`), after :func:`tune_allocator` (one arena, a high trim
    threshold), the request then reuses pages that are already mapped. Only useful after
    :func:`tune_allocator`: without it the pages go back to the OS on free."""
    n = max(0, min(int(nbytes), PREFAULT_MAX, _available() // 4)) // _PREFAULT_PIECE
    pieces = [np.ones(_PREFAULT_PIECE, np.uint8) for _ in range(n)]  # ones, not empty/zeros: a write faults the page
    del pieces
    return n * _PREFAULT_PIECE
