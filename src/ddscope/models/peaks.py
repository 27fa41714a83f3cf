"""kernels.c's loops at this machine's peaks, for the host's floor (ddscope.bench.limit.hardware): the FMA
units' and the tile unit's FLOPs from chains held in registers, and the memory's read rate from a read alone.
A library's matmul or matrix-vector product only bounds these from below, and a floor must stay below every
kernel of ddscope's."""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ddscope.models import native

# FLOPs a step: 12 FMAs of 16 lanes; 4 tile products; 12 vdpbf16ps of 16 lanes, each 2 products summed
UNITS = {"fp32": ("fma_peak_f32", 12 * 16 * 2), "bf16": ("amx_peak_bf16", 4 * 16 * 16 * 32 * 2),
         "bf16-dp": ("dp_peak_bf16", 12 * 16 * 4)}


def units(kind: str) -> tuple[Callable[[int, int], None], int] | None:
    """The register-only loop at the peak of `kind`'s units (fp32: FMA; bf16: AMX, else vdpbf16ps) as
    `run(steps, threads)`, and a thread's FLOPs a step; None where kernels.c has no such loop here."""
    if kind == "bf16" and native.bf16_products() == "avx512-bf16":
        kind = "bf16-dp"
    name, flops = UNITS[kind]
    if not native.has(name) or (kind == "bf16" and native.bf16_products() != "amx"):
        return None
    lib = native.library()
    return lambda steps, threads: getattr(lib, name)(steps, (ctypes.c_float * threads)(), threads), flops


def read() -> Callable[[torch.Tensor, int], list[float]] | None:
    """The read of a contiguous fp32 tensor (its size a multiple of 128 * threads), one stream a thread with 8
    sums side by side, as `run(tensor, threads)` -> each thread's sum of its share; None without AVX-512."""
    if not native.has("read_peak_f32"):
        return None
    lib = native.library()

    def run(t: torch.Tensor, threads: int) -> list[float]:
        sums = (ctypes.c_float * threads)()
        lib.read_peak_f32(t.data_ptr(), t.numel(), sums, threads)
        return list(sums)
    return run
