"""What `--budget auto` costs per round, measured inside real generations.

Times the tree proposer (`tree`: log-probs, build, and for auto the sizing) for a fixed budget and
for auto, and auto's other calls (`drafts`, `observe`), while the engine decodes, so the numbers
include the cold caches that follow each model forward (the same call timed in a tight loop is
several times faster and would understate the cost).

    python benchmarks/engine/policy_overhead.py [--prompts 3] [--max-tokens 256]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
import time
from collections.abc import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from engine_args import load_engine, parser

from ddscope.bench.running.workloads import fit_ids, load_workload
from ddscope.policy.auto import AutoBudget
from ddscope.speculative.proposers import DDTree

TIMED = {"tree": (DDTree, "tree"), "drafts": (AutoBudget, "drafts"), "observe": (AutoBudget, "observe")}


def timed(fn: Callable, sink: list[float]) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sink.append((time.perf_counter() - t0) * 1000)
        return out
    return wrapper


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args(argv)
    engine = load_engine(args)
    workload = load_workload("code")
    sinks: dict[str, list[float]] = {label: [] for label in TIMED}
    for label, (cls, name) in TIMED.items():
        setattr(cls, name, timed(getattr(cls, name), sinks[label]))
    print("| budget | call | calls | median ms | mean ms |\n|---|---|---|---|---|")
    for budget in (16, "auto"):
        for sink in sinks.values():
            sink.clear()
        for i in range(args.prompts):
            ids = fit_ids(workload, i, len(engine.encode(workload.prompts[i])), engine.tokenizer)
            engine.generate(ids, max_new_tokens=args.max_tokens, method="ddtree", budget=budget, ignore_eos=True)
        for label, sink in sinks.items():
            if sink:
                print(f"| {budget} | {label} | {len(sink)} | {statistics.median(sink):.3f} | "
                      f"{statistics.fmean(sink):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
