"""The demo pair's step parts at long context, each against what ran before issue 64's third change, in one process
with the arms taking turns (the machine drifts by a fifth within minutes):

1. `trees`: a target forward of n tree rows over `--contexts` cached tokens, on kernels.c's tree products (now at
   any number of keys) against MKL's batched products on a grouped bias (what ran past 2,048 keys; up to 2,048,
   the tree products ran before too);
2. `head`: the vocab head of 1 and 16 rows on kernels.c's panels against torch's product;
3. `drafter`: a DFlash draft (one block) with the drafter's projections on panels against torch's products.

Medians of `--repeats` calls each, A (before) and B (now) alternating call by call, B's outputs checked close to A's.

    python benchmarks/long_context_ab.py [--contexts 2500,3333,5553] [--rows 1,2,4,8,16,32] [--threads 1]
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from ab_harness import alternate
from engine_args import parser

import ddscope.models.drafter as drafter_module
from ddscope import Engine
from ddscope.bench.sweep import cpu_model
from ddscope.models import native
from ddscope.models.drafter import Draft


def arms(a: Callable[[], torch.Tensor], b: Callable[[], torch.Tensor], repeats: int, what: str) -> tuple[float, float]:
    """Median ms of `a` (arm A, before) and `b` (B, now), taking turns; B's output checked close to A's."""
    def run(name: str) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        out = (a if name == "A" else b)()
        return (time.perf_counter() - t0) * 1000, out
    return alternate(run, repeats, what, reorders=True)


def mkl_trees(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`fn` with fp32 trees on MKL's batched products (tree_rows refused), as past 2,048 keys before."""
    def run() -> torch.Tensor:
        keep, native.tree_rows = native.tree_rows, lambda *geometry: False
        try:
            return fn()
        finally:
            native.tree_rows = keep
    return run


def trees(engine: Engine, contexts: list[int], rows: list[int], repeats: int) -> None:
    target = engine.target
    cache = target.new_cache(max(contexts) + max(rows))
    ids = torch.randint(10, target.cfg.vocab_size, (max(contexts),))
    target(ids, torch.arange(len(ids)), cache)  # K/V of a real forward

    def forward(context: int, n: int) -> Callable[[], torch.Tensor]:
        mask = torch.ones(n, context + n, dtype=torch.bool).tril(context) if n > 1 else None
        tokens, positions = torch.zeros(n, dtype=torch.long), torch.arange(context, context + n)

        def run() -> torch.Tensor:
            cache.length = context
            return target(tokens, positions, cache, mask).logits
        return run

    cells = {c: [arms(mkl_trees(forward(c, n)), forward(c, n), repeats, f"{n} rows at {c}") for n in rows]
             for c in contexts}
    print("\n## trees: target forward ms, MKL before / kernels.c now\n")
    print("| context | " + " | ".join(f"{n} rows" for n in rows) + " |\n" + "|---" * (len(rows) + 1) + "|")
    for context, row in cells.items():
        print(f"| {context} | " + " | ".join(f"{a:.2f} / {b:.2f} ({a / b:.2f}x)" for a, b in row) + " |")


def head(engine: Engine, repeats: int) -> None:
    target, cells = engine.target, {}
    for n in (1, 16):
        h = torch.randn(n, target.cfg.geometry.hidden_size)
        with torch.inference_mode():
            cells[n] = arms(lambda: target.lm_head(h), lambda: target.logits(h), repeats, f"head of {n} rows")
    print("\n## head: vocab head ms, torch before / panels now\n\n| rows | ms | speed-up |\n|---|---|---|")
    for n, (a, b) in cells.items():
        print(f"| {n} | {a:.3f} / {b:.3f} | {a / b:.2f}x |")


def drafter(engine: Engine, before: Engine, context: int, repeats: int) -> None:
    """One block drafted at `context` by each engine's drafter, over the same features."""
    features = torch.randn(context, engine.drafter.fc.in_features)

    def draft(e: Engine) -> Callable[[], torch.Tensor]:
        cache = e.drafter.new_cache(context)
        cache.features[:context] = features

        def run() -> torch.Tensor:
            cache.length = 0
            return e.drafter.draft_many(e.target, [Draft(5, context, cache)])[0]
        return run

    a, b = arms(draft(before), draft(engine), repeats, "a draft")
    print(f"\n## drafter: one block at {context}, torch's products before / panels now\n\n"
          f"| ms | speed-up |\n|---|---|\n| {a:.2f} / {b:.2f} | {a / b:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--contexts", default="2500,3333,5553", help="cached tokens (default: %(default)s)")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="tree rows (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=30, help="calls an arm and cell (default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.target, args.drafter)
    keep, drafter_module.pack_linears = drafter_module.pack_linears, lambda layers: None
    try:
        before = Engine.load(args.target, args.drafter)  # its drafter on torch's products
    finally:
        drafter_module.pack_linears = keep
    print(f"# {cpu_model()}, {args.threads} thread(s), {args.repeats} repeats")
    contexts = [int(c) for c in args.contexts.split(",")]
    trees(engine, contexts, [int(n) for n in args.rows.split(",")], args.repeats)
    head(engine, args.repeats)
    drafter(engine, before, max(contexts), args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
