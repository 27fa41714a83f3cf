"""Memory for a step: 2 MiB pages for what it streams whole (panelled weights: in 4 KiB pages a stream misses the
TLB every 64 lines, and 33 rows' fp32 projections take 8% longer), and freed activations kept for the next step
rather than handed back to Linux (docs/journal.md)."""
from __future__ import annotations

import ctypes
import math
import mmap
import os
from functools import cache

import torch

HUGE_PAGE, MADV_HUGEPAGE = 2 << 20, 14  # Linux's
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8  # glibc's mallopt parameters
KEEP_FREED = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 64 << 20))


def huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor on memory Linux is asked to back with 2 MiB pages (madvise MADV_HUGEPAGE, which THP's
    usual "madvise" mode needs); elsewhere, or under 2 MiB, plain memory. The memory is a mapping of its own,
    never touched: heap memory that `keep_freed` kept is already in 4 KiB pages, and stays so."""
    size = math.prod(shape) * dtype.itemsize
    if size < HUGE_PAGE or _libc() is None:
        return torch.empty(shape, dtype=dtype)
    private = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # THP takes private ones
    base = torch.frombuffer(private, dtype=torch.uint8)  # unmapped with the tensor
    offset = -base.data_ptr() % HUGE_PAGE  # before the first touch: the pages fault in as huge ones
    _libc().madvise(ctypes.c_void_p(base.data_ptr() + offset), ctypes.c_size_t(size - size % HUGE_PAGE),
                    MADV_HUGEPAGE)
    return base[offset:offset + size].view(dtype).view(shape)


@cache
def keep_freed() -> bool:
    """Keep freed memory in this process for the next step's tensors (glibc; False elsewhere). By default glibc
    serves a large tensor from a fresh mapping, and gives freed memory back to Linux, so every step faults its
    activations in again, 4 KiB at a time, each page zeroed (about 2 us a page here): up to 0.3 million faults
    in a 2k-token prefill of floor.py's model, up to 0.7 million in a 4k one. Here every thread allocates from
    the one heap, every tensor comes from it (none from a mapping of its own), and it is never trimmed: a
    process holds its peak heap instead (docs/server.md)."""
    libc = _libc()
    return libc is not None and hasattr(libc, "mallopt") and all([libc.mallopt(p, v) == 1 for p, v in KEEP_FREED])


def trim() -> bool:
    """Hand the heap's free memory back to Linux now (glibc's malloc_trim; False elsewhere): for a process that
    is done with an engine and goes on."""
    libc = _libc()
    return libc is not None and hasattr(libc, "malloc_trim") and bool(libc.malloc_trim(0))


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True) if os.uname().sysname == "Linux" else None
    except OSError:
        return None
