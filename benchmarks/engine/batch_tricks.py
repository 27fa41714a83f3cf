"""Do the batch-1 forward's tricks still pay inside a batch? Each is switched off in turn and a batched
step's target forward timed both ways, in one process, interleaved (shuffled per repeat), medians.

- grouped-query bias: a segment of at most GROUPED_QUERIES rows (a tree, a token) attends with the query
  heads of one K/V head run as one head over an additive bias, K/V read once per group; off: SDPA's own
  GQA over the boolean mask, every query head on its own.
- last-row-only prefill: past its K/V, the last layer runs a prefill chunk's rows only where something
  reads them later (the drafter's window of features, the last row's logits); off: every row.

The batches are what `ddscope serve` verifies: B trees of `--nodes` nodes (plus the root), each over
`--context` cached tokens and up to 256 more (what it has generated), and the same beside a prefill chunk
of a 1000-token prompt. K/V contents do not change the cost, so the caches are the pool's zeroes.

    python benchmarks/engine/batch_tricks.py [--batches 1,4,8,16] [--nodes 16] [--context 1000] [--repeats 21]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from statistics import median

import torch

from ddscope.bench.limit.hardware import cpu_model
from ddscope.engine import Engine
from ddscope.models import target as model_mod
from ddscope.models.kv_pool import BLOCK, Pages
from ddscope.models.target import Segment

PROMPT = 1000  # the prefill chunk's prompt, as the concurrency benchmark's longest


def sequence(engine: Engine, first_block: int, ctx: int) -> tuple[Pages, object]:
    """A sequence of `ctx` cached tokens on its own run of the pool's blocks (room for a prefill chunk)."""
    pages = Pages()
    pages.extend(list(range(first_block, first_block + -(-(ctx + PROMPT) // BLOCK))))
    cache = engine.pool.target_cache(pages)
    cache.length = ctx
    return pages, cache


def tree_segment(cache, nodes: int, rng: random.Random) -> Segment:
    """A tree of `nodes` nodes and its root: each node under a random earlier one, seeing its ancestors."""
    parents = [-1] + [rng.randrange(i) for i in range(1, nodes + 1)]
    seen = torch.zeros(nodes + 1, nodes + 1, dtype=torch.bool)
    depth = [0] * (nodes + 1)
    for i, p in enumerate(parents):
        if p >= 0:
            seen[i], depth[i] = seen[p], depth[p] + 1
        seen[i, i] = True
    start = cache.length
    mask = torch.ones(nodes + 1, start + nodes + 1, dtype=torch.bool)
    mask[:, start:] = seen
    tokens = torch.tensor([rng.randrange(1000) for _ in range(nodes + 1)])
    return Segment(tokens, torch.tensor(depth) + start, cache, mask)


def prefill_segment(engine: Engine, cache, tail: bool) -> Segment:
    """The whole of a PROMPT-token prompt as one chunk, its last layer cut as the engine cuts it (or not)."""
    reach = max(0, PROMPT - engine.drafter.horizon) // BLOCK * BLOCK if engine.drafter.horizon else 0
    tokens = torch.arange(PROMPT) % 1000
    return Segment(tokens, torch.arange(PROMPT), cache, None, PROMPT - reach if tail else None, "last")


def forward_ms(engine: Engine, segments: list[Segment], capture: tuple[int, ...]) -> float:
    lengths = [s.cache.length for s in segments]
    t0 = time.perf_counter()
    engine.target.forward_many(segments, capture)
    ms = 1000 * (time.perf_counter() - t0)
    for s, n in zip(segments, lengths):
        s.cache.length = n
    return ms


def measure(engine: Engine, batch: int, nodes: int, context: int, prefill: bool, repeats: int,
            rng: random.Random) -> dict:
    """Median ms of the batch's forward with every trick on, and with each switched off."""
    capture = engine.drafter.cfg.target_layer_ids
    room = -(-(context + 256 + PROMPT) // BLOCK)  # blocks a sequence
    contexts = [context + rng.randrange(256) for _ in range(batch)]
    caches = [sequence(engine, i * room, c)[1] for i, c in enumerate(contexts)]
    trees = [tree_segment(c, nodes, rng) for c in caches]
    chunk_cache = sequence(engine, batch * room, 0)[1]
    arms = {"all on": (model_mod.GROUPED_QUERIES, True), "grouped-query bias off": (0, True)}
    if prefill:
        arms["last-row-only prefill off"] = (model_mod.GROUPED_QUERIES, False)
    times: dict[str, list[float]] = {a: [] for a in arms}
    saved = model_mod.GROUPED_QUERIES
    try:
        for _ in range(repeats + 1):  # the first repeat warms up
            for arm in rng.sample(list(arms), len(arms)):
                model_mod.GROUPED_QUERIES, tail = arms[arm]
                segments = ([prefill_segment(engine, chunk_cache, tail)] if prefill else []) + trees
                times[arm].append(forward_ms(engine, segments, capture))
    finally:
        model_mod.GROUPED_QUERIES = saved
    return {a: median(t[1:]) for a, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--nodes", type=int, default=16, help="nodes a tree (the root comes on top)")
    p.add_argument("--context", type=int, default=1000, help="cached tokens under each tree (plus up to 256)")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=1, help="torch threads (ddscope serve's default on 2 cores)")
    p.add_argument("--out", type=Path, default=Path("docs/results"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    most = max(int(x) for x in args.batches.split(","))  # the pool is cut to what most + 1 sequences can fill
    engine = Engine.load(kv_cache_mb=1 << 14, max_model_len=args.context + 256 + PROMPT, max_num_seqs=most + 1)
    rng = random.Random(0)
    lines = [f"# The batch-1 tricks inside a batch ({cpu_model()}, fp32, demo pair, {args.threads} thread)", "",
             f"`python benchmarks/engine/batch_tricks.py --batches {args.batches} --nodes {args.nodes} --repeats "
             f"{args.repeats} --context {args.context} --threads {args.threads}`: median ms of one batched target "
             f"forward (B trees of {args.nodes}+1 nodes over {args.context}-{args.context + 255} cached tokens "
             f"each, and the same beside a {PROMPT}-token prefill "
             "chunk), each trick switched off in turn, arms interleaved.", "",
             "| batch | all on ms | grouped-query bias off | ratio on/off | last-row-only prefill off | ratio on/off |",
             "|---|---|---|---|---|---|"]
    for b in (int(x) for x in args.batches.split(",")):
        for prefill in (False, True):
            r = measure(engine, b, args.nodes, args.context, prefill, args.repeats, rng)
            on, g = r["all on"], r["grouped-query bias off"]
            t = r.get("last-row-only prefill off")
            row = (f"| {b} trees{' + prefill' if prefill else ''} | {on:.2f} | {g:.2f} | {on / g:.3f} | "
                   + (f"{t:.2f} | {on / t:.3f} |" if t else "- | - |"))
            lines.append(row)
            print(row, flush=True)
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"batch-tricks-ctx{args.context}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
