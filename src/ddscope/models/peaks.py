"""kernels.c's loops at this machine's peaks, for the host's floor (ddscope.bench.limit.hardware): the FMA
units' and the tile unit's FLOPs from chains held in registers, and the memory's read rate from a read alone.
A library's matmul or matrix-vector product only bounds these from below, and a floor must stay below every
kernel of ddscope's."""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ddscope.models import native

# The loop at the peak of the units each product runs on, and a thread's FLOPs a step of it (None: the build's
# own count). Widened bf16 products are fp32 FMAs: their peak is the FMA units'.
LOOPS = {"fp32": ("fma_peak_f32", None), "amx": ("amx_peak_bf16", 4 * 16 * 16 * 32 * 2),
         "avx512-bf16": ("dp_peak_bf16", 12 * 16 * 4), "widened": ("fma_peak_f32", None)}


def units(kind: str) -> tuple[Callable[[int, int], None], int] | None:
    """The register-only loop at the peak of `kind`'s units (fp32, or bf16 on the units this build's bf16
    products run on) as `run(steps, threads)`, and a thread's FLOPs a step; None where kernels.c has none here."""
    name, flops = LOOPS["fp32" if kind == "fp32" else native.bf16_products()]
    lib = native.library()
    if lib is None or not hasattr(lib, name):
        return None
    run = getattr(lib, name)
    return lambda steps, threads: run(steps, (ctypes.c_float * threads)(), threads), flops or lib.fma_peak_flops()


def read() -> Callable[[torch.Tensor, int], list[float]] | None:
    """The read of a contiguous fp32 tensor (its size a multiple of 128 * threads), one stream a thread with 8
    sums side by side, as `run(tensor, threads)` -> each thread's sum of its share; None where kernels.c is not
    loaded."""
    if native.library() is None:
        return None
    lib = native.library()

    def run(t: torch.Tensor, threads: int) -> list[float]:
        sums = (ctypes.c_float * threads)()
        lib.read_peak_f32(t.data_ptr(), t.numel(), sums, threads)
        return list(sums)
    return run
