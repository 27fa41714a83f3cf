"""Paired engine A/B: this tree's engine against an earlier commit's, one request alone at a time (c=1).

The machine's speed drifts by a fifth within minutes, more than the differences worth finding, so the two
engines run in two processes that take turns request by request (in ABBA order), on the same prompts, and
the statistic is the median of the per-request ratios of step time (decode time / verify steps). Both load
the same verify-cost table (calibrated once, here), so `auto` sizes trees from the same costs. Phases are
summed per arm; their boundaries may differ between commits (the batched runner counts acceptance in
`commit`, the batch-1 loop in `verify`).

    python benchmarks/engine/engine_ab.py [--baseline ff55f21] [--requests 20] [--budget auto] [--tokens 192]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from ab_harness import WORK, abba, baseline_tree

from ddscope.bench.limit.hardware import cpu_model
from ddscope.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
try:
    from ddscope.policy.cost import VerifyCost
except ImportError:  # a tree from before the package's rooms
    from ddscope.budget import VerifyCost
from ddscope.bench.running.workloads import load_workload
from ddscope.engine import Engine
torch.set_num_threads(1)
engine = Engine.load()
table = json.load(open(sys.argv[2]))
engine.verify_cost = VerifyCost(table["ctx"], table["nodes"], table["ms"])
prompts = list(load_workload("code").prompts[40:80])
engine.generate(prompts[0], max_new_tokens=32, ignore_eos=True, budget="auto")  # warm-up
print("ready", flush=True)
for line in sys.stdin:
    i, budget, tokens = line.split()
    g = engine.generate(prompts[int(i) % len(prompts)], max_new_tokens=int(tokens), ignore_eos=True,
                        budget=budget if budget == "auto" else int(budget))
    d = g.stats.to_dict(False)
    print(json.dumps({"decode_s": g.stats.decode_s, "steps": d["verify_steps"], "phase_ms": d["phase_ms"]}), flush=True)
"""


class Arm:
    """One engine in a process of its own, answering one request per line."""

    def __init__(self, src: Path, table: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(src), str(table)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        while (line := self.proc.stdout.readline()) and line.strip() != "ready":
            pass
        if not line:
            raise RuntimeError(f"the engine of {src} did not start")

    def run(self, i: int, budget: str, tokens: int) -> dict:
        self.proc.stdin.write(f"{i} {budget} {tokens}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="ff55f21", help="commit of the engine to compare against")
    p.add_argument("--requests", type=int, default=20, help="paired requests (default: %(default)s)")
    p.add_argument("--budget", default="auto", help="node budget, N or auto (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=192, help="tokens out per request (default: %(default)s)")
    args = p.parse_args()
    WORK.mkdir(exist_ok=True)
    table = WORK / "verify-cost.json"
    engine = Engine.load()
    engine.calibrate()
    table.write_text(json.dumps(engine.verify_cost.to_dict()))
    del engine
    arms = {"baseline": Arm(baseline_tree(args.baseline, WORK), table), "this tree": Arm(ROOT / "src", table)}
    ratios, phases = [], {k: {} for k in arms}
    steps = dict.fromkeys(arms, 0)
    for i in range(args.requests):
        order = abba(i, tuple(arms))
        got = {k: arms[k].run(i, args.budget, args.tokens) for k in order}
        ms = {k: 1000 * r["decode_s"] / r["steps"] for k, r in got.items()}
        ratios.append(ms["this tree"] / ms["baseline"])
        for k, r in got.items():
            steps[k] += r["steps"]
            for name, v in r["phase_ms"].items():
                phases[k][name] = phases[k].get(name, 0.0) + v
        print(f"request {i}: step ms baseline {ms['baseline']:.2f}, this tree {ms['this tree']:.2f} "
              f"({ratios[-1]:.3f})", flush=True)
    for a in arms.values():
        a.close()
    print(f"\n{cpu_model()}, budget {args.budget}, {args.requests} requests x {args.tokens} tokens: median step "
          f"time this tree / {args.baseline} = {median(ratios):.3f}")
    for k in arms:
        print(f"  {k}: " + ", ".join(f"{n} {v / steps[k]:.2f} ms" for n, v in phases[k].items()) + " a step")


if __name__ == "__main__":
    main()
