"""How well the drafter's probabilities predict acceptance: the data behind `Acceptance`.

Decodes with a fixed-budget DDTree and, for every verified draft token whose parent was accepted
(so the target actually tested it), records the drafter's conditional probability, whether it
was its parent's top-ranked child, and whether the target accepted it. Prints one reliability
table per temperature: probability bin -> acceptance rate, top-1 tokens and siblings apart.

    python benchmarks/engine/calibration.py [--temperatures 0,1] [--budget 64] [--prompts 3]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from engine_args import load_engine, parser

from ddscope import Engine
from ddscope.bench.running.workloads import fit_ids, load_workload
from ddscope.speculative.proposers import DDTree
from ddscope.speculative.stats import RoundStats
from ddscope.speculative.tree import DraftTree

EDGES = (0, .02, .05, .1, .2, .3, .4, .5, .6, .7, .8, .9, .95, .99, 1.0001)


class Recording(DDTree):
    """A fixed-budget DDTree that keeps (probability, top-1, accepted) for every tested token."""

    def __init__(self, budget: int):
        super().__init__(budget, lookup=False)  # the drafter's own tokens only
        self.rows: list[tuple[float, bool, bool]] = []
        self._tree: DraftTree | None = None

    def tree(self, root, draft_logits, sampling, ctx_len, history=(), steer=None) -> DraftTree:
        self._tree = super().tree(root, draft_logits, sampling, ctx_len, history, steer)
        return self._tree

    def observe(self, rnd: RoundStats, path: list[int], committed: list[int]) -> None:
        t, on_path, first = self._tree, set(path), set()
        for i in range(1, len(t.tokens)):
            parent = t.parents[i]
            if parent in on_path:
                self.rows.append((float(np.exp(t.scores[i] - t.scores[parent])), parent not in first, i in on_path))
            first.add(parent)


def record(engine: Engine, ids: list[int], budget: int, temperature: float, max_tokens: int, seed: int) -> list:
    seq = engine.sequence(ids, max_new_tokens=max_tokens, method="ddtree", budget=budget, temperature=temperature,
                          seed=seed, ignore_eos=True)
    seq.decoder.proposer = proposer = Recording(budget)
    for _ in engine.follow(seq):
        pass
    return proposer.rows


def table(rows: list[tuple[float, bool, bool]]) -> str:
    r = np.array(rows, dtype=float)
    lines = ["| drafter p | top-1: n | top-1: mean p | top-1: accepted | siblings: n | siblings: mean p | siblings: accepted |",
             "|---|---|---|---|---|---|---|"]
    for lo, hi in zip(EDGES[:-1], EDGES[1:]):
        cells = []
        for top1 in (1.0, 0.0):
            sel = r[(r[:, 1] == top1) & (r[:, 0] >= lo) & (r[:, 0] < hi)]
            cells += [f"{len(sel)}", f"{sel[:, 0].mean():.3f}", f"{sel[:, 2].mean():.3f}"] if len(sel) else ["0", "-", "-"]
        if any(c != "0" for c in cells[::3]):
            lines.append(f"| {lo:.2f}-{min(hi, 1):.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--workloads", default="code,math,chat")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args(argv)
    engine = load_engine(args)
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        rows = []
        for name in args.workloads.split(","):
            workload = load_workload(name)
            for i in range(min(args.prompts, len(workload.prompts))):
                ids = fit_ids(workload, i, len(engine.encode(workload.prompts[i])), engine.tokenizer)
                rows += record(engine, ids, args.budget, temperature, args.max_tokens, seed=i)
                print(f"  T={temperature:g} {name} prompt {i + 1}: {len(rows)} tested tokens", file=sys.stderr)
        print(f"\n### T={temperature:g}, ddtree budget {args.budget}\n\n{table(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
