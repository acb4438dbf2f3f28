"""glibc's heap, handed back to the system by hand where resident memory is what counts.

Why: glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after which
tensors of a few MiB come from the heap and their freed pages stay resident. A training step then
holds about twice its live bytes (measured 2026-11-26, a 0.16 B GPT under `dp2 zero3 bf16` on 2 CPU
engines: 1.1 GiB above the held state with glibc's default, 0.6 GiB with a fixed 1 MiB threshold,
at 1.3x the step time: `benchmarks/host_heap.py`). Without glibc (another libc) both calls do nothing.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["trim_host_heap", "tighten_heap", "loosen_heap", "LARGE_BLOCK"]

M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
LARGE_BLOCK = 2 ** 20  # tight: blocks from 1 MiB up are mapped on their own and unmapped when freed
RELAXED_BLOCK = 32 * 2 ** 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_tight = 0  # tighten_heap calls not yet undone


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 (glibc has both)
        return libc
    except (OSError, AttributeError):
        return None


def trim_host_heap() -> None:
    """Hand freed heap pages back to the system now. Shard-first init frees one full tensor after
    another while small long-lived allocations land between them; glibc then keeps the freed
    pages resident and a rank's peak would grow with the model instead of with one tensor."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def tighten_heap() -> bool:
    """From now on in this process, blocks of `LARGE_BLOCK` or more are mapped on their own and
    returned when freed (glibc's dynamic threshold is switched off), and what the heap holds free
    now is handed back. Costs page faults on every large allocation: worth it only where a memory
    budget binds. Each call that returns True is undone by one `loosen_heap`. False without glibc."""
    global _tight
    libc = _libc()
    if libc is None or not libc.mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK):
        return False
    _tight += 1
    libc.malloc_trim(0)
    return True


def loosen_heap() -> None:
    """Undo one `tighten_heap`; after the last, large blocks come from the heap again from
    `RELAXED_BLOCK` up (glibc's dynamic threshold cannot be switched back on; 32 MiB is where it
    settles on 64-bit, and measured as fast as it)."""
    global _tight
    _tight = max(0, _tight - 1)
    libc = _libc()
    if not _tight and libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, RELAXED_BLOCK)
