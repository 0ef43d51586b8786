"""glibc malloc settings for a block of code, nested as a stack: speed and memory only, never bytes.

glibc's ``mallopt`` has no getter, so a block cannot read back what it replaces. Every block here
therefore states its settings in full, pushes them, and on exit re-applies the entry below it.
The bottom entry is SETTLED: the mmap threshold glibc's own dynamic rule settles at (32 MiB),
twice that as the trim threshold, and the default top pad. Any ``mallopt`` of the threshold ends
glibc's dynamic rule, so "back to the default" is not on offer; SETTLED is what a long-lived
process reaches by itself.

Two users: ``bounded_heap`` (a global step's ``prepare``, executors/tasks.prepare_step) and
stages/mining/engine/core.freed_memory_kept (every ``mine()``, often inside the former). A no-op
without glibc (macOS, musl) or when the user tunes malloc through ``MALLOC_*`` variables
(theirs win).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
HEAP_MMAP_BYTES = 4 << 20      # bounded_heap: glibc maps arrays of this size and more on their own
HEAP_MMAP_MAX = 32 << 20       # glibc's own ceiling for its moving threshold
GLIBC_DEFAULT = 128 << 10      # glibc's documented default threshold, trim and top pad

SETTLED = {M_MMAP_THRESHOLD: HEAP_MMAP_MAX, M_TRIM_THRESHOLD: 2 * HEAP_MMAP_MAX,
           M_TOP_PAD: GLIBC_DEFAULT}
_STACK: list[dict] = [SETTLED]     # the settings in force, innermost last


@functools.lru_cache(maxsize=1)
def glibc():
    """glibc's handle, or None: not Linux, another libc, or the user's MALLOC_* variables."""
    if not sys.platform.startswith("linux") or any(k.startswith("MALLOC_") for k in os.environ):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _apply(libc, settings: dict) -> None:
    for option, value in settings.items():
        libc.mallopt(option, value)


@contextlib.contextmanager
def heap_settings(settings: dict, trim: bool = False):
    """Within: ``settings`` (options not named there take SETTLED's values). After: the enclosing
    block's settings again, and with ``trim`` the freed memory given back (malloc_trim)."""
    libc = glibc()
    if libc is None:
        yield
        return
    _STACK.append({**SETTLED, **settings})
    _apply(libc, _STACK[-1])
    try:
        yield
    finally:
        _STACK.pop()
        _apply(libc, _STACK[-1])
        if trim:
            libc.malloc_trim(0)


def bounded_heap():
    """Within: glibc's mmap threshold fixed at HEAP_MMAP_BYTES, with glibc's default trim (the
    executors run a global step's ``prepare`` so): an array that large is mapped on its own and
    returned to the system when freed. glibc's default raises the threshold (up to 32 MiB) each
    time such an array is freed, after which a loop's large temporaries come from the heap,
    interleaved with arrays that live on: the holes grew with N (hpm's global step, 32-d
    vectors: anonymous peak 389 MB at 100k rows, 533 MB at 1M; 440 MB at 1M with the threshold
    fixed; tests/benchmarks/bench_hpm_memory.py). After: SETTLED, so stage code run later in the
    process (the in-process executor) reuses heap memory as before: a mapped array's pages fault
    in afresh each time, which made the bf16 pass's block casts 3x slower."""
    return heap_settings({M_MMAP_THRESHOLD: HEAP_MMAP_BYTES, M_TRIM_THRESHOLD: GLIBC_DEFAULT})
