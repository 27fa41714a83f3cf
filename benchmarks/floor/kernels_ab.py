"""A/B of kernels.c's projections against a git revision's, on floor.py's model shapes (24 layers of a
hidden-1024 Qwen3: q/k/v and gate/up adjoined, o, down), weights streamed from memory as in a step; with
`--contexts`, of a decode row's attention instead (4 query heads over 2 K/V heads of 256, 24 layers' K/V), or
with `--tree N` too, of a tree's N rows under an ancestor mask (`attend`, as bf16 trees verify; `--kernel tree`,
the fp32 trees' products), or with `--kernel causal`, of a prefill of the whole context.

    python benchmarks/floor/kernels_ab.py --base b36f347 [--rows 1,9,33,64] [--dtype float32] [--repeats 9]
    python benchmarks/floor/kernels_ab.py --base b36f347 --contexts 1024,4096 [--tree 33] [--kernel tree] [--reorders]

A is the revision's kernels.c, B the working tree's; each arm packs its own weights (same values, on 2 MiB
pages for both) and the arms take turns. Every B output is checked bitwise against A's: a change here may
move time, never a result. Prints the median time of all 96 products (or 24 attentions) and their rate.
"""
from __future__ import annotations

import sys
import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from ab_harness import alternate

from ddscope.bench.limit.hardware import cpu_model
import ddscope.models.builds as builds
import ddscope.models.kv_pool as kv_pool
import ddscope.models.native as native

SHAPES = ((2048, 1024), (1024, 1024), (4096, 1024), (1024, 2048))  # qkv, o, gate_up, down of one layer
LAYERS = 24
HEADERS = builds.HEADERS  # the working tree's
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 256  # floor.py's attention


def library(source: Path):
    """kernels.c at `source` (its headers beside it), built for this process's ISA and loaded as ddscope loads
    its own."""
    beside = (source.parent / h.name for h in HEADERS)
    builds.SOURCE, builds.HEADERS = source, tuple(h for h in beside if h.exists())
    builds.load.cache_clear()
    return builds.load(builds.isa())


def arm(lib, weights: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    native.library = lambda: lib
    return [[native.panels(w) for w in layer] for layer in weights]


def sweep(lib, panels: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> tuple[float, torch.Tensor]:
    native.library = lambda: lib
    start = time.perf_counter()
    for layer in panels:
        for (_, k), p in zip(SHAPES, layer):
            y = native.linear(xs[k], p)
    return time.perf_counter() - start, y


KERNELS = {"attend": lambda q, k, v, mask: native.attend(q, k, v, mask),
           "tree": lambda q, k, v, mask: native.tree_attend(q, k, v, mask),
           "causal": lambda q, k, v, mask: native.causal_attend(q, k, v)}


def attention(lib, kernel: str, q: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]],
              mask: torch.Tensor | None) -> tuple[float, torch.Tensor]:
    native.library = lambda: lib
    start = time.perf_counter()
    for k, v in caches:
        y = KERNELS[kernel](q, k, v, mask)
    return time.perf_counter() - start, y


def tree_mask(nodes: int, keys: int) -> torch.Tensor:
    """Every context key, then a random tree's ancestors (each node's parent earlier in the order) and itself."""
    mask = torch.zeros(nodes, keys, dtype=torch.bool)
    mask[:, :keys - nodes] = True
    for i in range(nodes):
        if i:
            mask[i] = mask[int(torch.randint(0, i, ()))]
        mask[i, keys - nodes + i] = True
    return mask


def products(libs: dict, dtype: torch.dtype, rows: list[int], repeats: int) -> None:
    torch.manual_seed(0)
    weights = [[(torch.randn(n, k) * 0.02).to(dtype) for n, k in SHAPES] for _ in range(LAYERS)]
    panels = {name: arm(lib, weights) for name, lib in libs.items()}
    del weights
    print("| rows | A ms | B ms | B/A | B GFLOP/s |\n|---|---|---|---|---|")
    flop_per_row = 2 * LAYERS * sum(n * k for n, k in SHAPES)
    for m in rows:
        xs = {k: torch.randn(m, k).to(dtype) for _, k in SHAPES}
        a, b = alternate(lambda name: sweep(libs[name], panels[name], xs), repeats, f"{m} rows")
        print(f"| {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} | {flop_per_row * m / b / 1e9:.0f} |")


def attentions(libs: dict, dtype: torch.dtype, contexts: list[int], repeats: int, reorders: bool,
               nodes: int, kernel: str) -> None:
    """Each context's 24 layers of K/V on 2 MiB pages, as the KV pool holds them; `causal`: a prefill of the
    whole context (its rate in GFLOP/s), else `nodes` rows over it (the K/V read in GB/s)."""
    torch.manual_seed(0)
    print(f"| context | A ms | B ms | B/A | B {'GFLOP' if kernel == 'causal' else 'GB'}/s |\n|---|---|---|---|---|")
    for context in contexts:
        rows = context if kernel == "causal" else nodes
        q = torch.randn(HEADS, rows, HEAD_DIM).to(dtype)
        caches = [tuple(kv_pool.zeroed((KV_HEADS, context, HEAD_DIM), "cpu", dtype).copy_(
            torch.randn(KV_HEADS, context, HEAD_DIM)) for _ in "kv") for _ in range(LAYERS)]
        mask = tree_mask(nodes, context) if nodes > 1 and kernel != "causal" else None
        a, b = alternate(lambda name: attention(libs[name], kernel, q, caches, mask), repeats, f"{context} keys",
                         reorders)
        work = (LAYERS * 4 * HEADS * HEAD_DIM * context * (context + 1) / 2 if kernel == "causal"
                else sum(k.nbytes + v.nbytes for k, v in caches))
        print(f"| {context} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} | {work / b / 1e9:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision whose kernels.c is arm A")
    ap.add_argument("--rows", default="1,9,33,64")
    ap.add_argument("--contexts", help="keys of a decode row's attention, comma-separated: A/B `attend`, not the "
                    "products")
    ap.add_argument("--tree", type=int, default=1, metavar="N", help="with --contexts: a tree of N rows, not one")
    ap.add_argument("--kernel", default="attend", choices=sorted(KERNELS), help="with --contexts: `attend`; "
                    "`tree` (fp32 trees' products, with --tree); `causal` (fp32: a prefill of the whole context)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--reorders", action="store_true", help="B sums in another order: check its attention close to "
                    "A's, not bitwise")
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    dtype, here = getattr(torch, args.dtype), builds.SOURCE
    with tempfile.TemporaryDirectory() as tmp:
        for name in (here.name, *(h.name for h in HEADERS)):  # the revision's source and the headers it has
            old = subprocess.run(["git", "show", f"{args.base}:src/ddscope/models/{name}"], cwd=here.parent,
                                 capture_output=True, text=True)
            if old.returncode == 0:
                (Path(tmp) / name).write_text(old.stdout)
        libs = {"A": library(Path(tmp) / here.name), "B": library(here)}
    print(f"# kernels.c {args.base} (A) against the working tree (B), {args.dtype}, {cpu_model()}, "
          f"{torch.get_num_threads()} threads, {args.repeats} repeats\n")
    if args.contexts:
        attentions(libs, dtype, [int(c) for c in args.contexts.split(",")], args.repeats, args.reorders, args.tree,
                   args.kernel)
    else:
        products(libs, dtype, [int(r) for r in args.rows.split(",")], args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
