"""How fast kernels.c's fp32 products run by where their weights come from: L2, L3 or memory.

A verify is a product of a few dozen rows over every weight of the model, and its floor (`ddscope bench
limit`) takes the FMA peak with the weight stream hidden. This prints, for each row count, the products'
rate with its weights resident in each level, beside the host's peak and bandwidth as
`floor.py` measures them, and the latency of one dependent miss to memory (a random chase over 512 MiB on
2 MiB pages; the Python of each step, timed on a chase that stays in L1, is taken off).

    python benchmarks/stream_rate.py [--rows 1,9,33,64] [--repeats 7] [--out docs/results]

Writes OUT/stream_rate.md. Each rate is the median of `repeats` sweeps; a sweep calls `native.linear` once
per weight copy; the cost of a call itself (Python and OpenMP's start, timed on a 128 x 64 product of as many
rows) is taken off.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ddscope.bench.limit.hardware import measure_host
from ddscope.bench.sweep import cpu_model
from ddscope.models import native
from ddscope.models.pages import huge

# (N, K, copies): 2 MiB of weights (1 a thread's L2), 16 MiB, 512 MiB; 2048 x 1024 is a layer's q/k/v in floor.py
LEVELS = {"L2": (512, 1024, 1), "L3": (2048, 1024, 2), "memory": (2048, 1024, 64)}
CHASE_BYTES, CHASE_STEPS = 512 << 20, 200_000


def sweep_s(x: torch.Tensor, panels: list[torch.Tensor], repeats: int) -> float:
    """The median time of one product, over `repeats` sweeps across every copy (a copy once warm)."""
    for p in panels:
        native.linear(x, p)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for p in panels:
            native.linear(x, p)
        times.append((time.perf_counter() - start) / len(panels))
    return statistics.median(times)


def chase_ns(lines: int, steps: int) -> float:
    """Seconds a step of a random cyclic chase over `lines` 64-byte lines (one int64 a line) takes, in ns."""
    order = np.random.default_rng(0).permutation(lines)
    table = huge((lines * 8,), torch.int64).numpy()
    table[order * 8] = np.roll(order, -1) * 8
    view, at = memoryview(table), int(order[0]) * 8
    start = time.perf_counter()
    for _ in range(steps):
        at = view[at]
    return (time.perf_counter() - start) / steps * 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,9,33,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    if not native.paneled(torch.ones(512, 1024)):
        raise SystemExit("kernels.c's fp32 panels do not serve here (they need AVX-512 and a C compiler)")
    hw = measure_host(threads)
    peak = hw.tflops["fp32"] * 1e3
    miss = chase_ns(CHASE_BYTES // 64, CHASE_STEPS) - chase_ns(64, CHASE_STEPS)
    torch.manual_seed(0)
    tiny = [native.panels(torch.randn(128, 64))]
    call_s = {rows: sweep_s(torch.randn(rows, 64), tiny * 64, args.repeats) for rows in map(int, args.rows.split(","))}
    host = (f"`python benchmarks/stream_rate.py`. Host: {hw.bandwidth_gbps:g} GB/s, fp32 peak {peak:.0f} GFLOP/s "
            f"(`measure_host`); a dependent miss to memory: {miss:.0f} ns; a call itself: "
            f"{1e6 * max(call_s.values()):.0f} us or less, taken off.")
    lines = [f"# fp32 products by where their weights are ({cpu_model()}, {threads} threads)", "", host, "",
             "| rows | weights in | MiB | ms a product | GFLOP/s | x peak | weight GB/s |",
             "|---|---|---|---|---|---|---|"]
    for level, (n, k, copies) in LEVELS.items():
        panels = [native.panels(torch.randn(n, k) * 0.02) for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            seconds = sweep_s(torch.randn(rows, k), panels, args.repeats) - call_s[rows]
            rate = 2 * rows * n * k / seconds / 1e9
            lines.append(f"| {rows} | {level} | {n * k * 4 * copies >> 20} | {seconds * 1e3:.3f} | {rate:.0f} | "
                         f"{rate / peak:.2f} | {n * k * 4 / seconds / 1e9:.1f} |")
            print(lines[-1], flush=True)
        del panels
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stream_rate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:3]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
