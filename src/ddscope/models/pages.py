"""Memory on 2 MiB pages for what a step streams whole (panelled weights): in 4 KiB pages a stream misses the
TLB every 64 lines, and 33 rows' fp32 projections take 8% longer (docs/performance.md)."""
from __future__ import annotations

import ctypes
import math
import os
from functools import cache

import torch

HUGE_PAGE, MADV_HUGEPAGE = 2 << 20, 14  # Linux's


def huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor on memory Linux is asked to back with 2 MiB pages (madvise MADV_HUGEPAGE, which THP's
    usual "madvise" mode needs); elsewhere, or under 2 MiB, plain memory."""
    size = math.prod(shape) * dtype.itemsize
    if size < HUGE_PAGE or _libc() is None:
        return torch.empty(shape, dtype=dtype)
    base = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
    offset = -base.data_ptr() % HUGE_PAGE  # before the first touch: the pages fault in as huge ones
    _libc().madvise(ctypes.c_void_p(base.data_ptr() + offset), ctypes.c_size_t(size - size % HUGE_PAGE),
                    MADV_HUGEPAGE)
    return base[offset:offset + size].view(dtype).view(shape)


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True) if os.uname().sysname == "Linux" else None
    except OSError:
        return None
