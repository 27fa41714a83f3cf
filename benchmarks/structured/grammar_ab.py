"""Drafts grown under the grammar against drafts masked at the verify only (vLLM's way), side by side on one engine.

Each request runs under both arms in alternation (steer, verify-only, then the reverse order for the next), greedy,
on the demo pair by default; acceptance is exact (the same tokens either way, which is asserted), tok/s is the
engine's own decode time. Prints a Markdown table of medians over the requests:

    python benchmarks/structured/grammar_ab.py --methods dflash,ddtree:32 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess

import torch

from ddscope.bench.running.workloads import STRUCTURED, STRUCTURED_PROMPTS
from ddscope.engine import Engine
from ddscope.structured.constraint import Constraint

def constraint(fields: dict) -> Constraint:
    """A workload's `structured_outputs` as the engine's constraint (compact JSON, as both servers run it)."""
    ((kind, spec),) = fields.items()
    return Constraint(kind, spec if isinstance(spec, str) else json.dumps(spec), any_whitespace=False)


WORKLOADS = {name: constraint(fields) for name, fields in STRUCTURED.items()}
PROMPTS = STRUCTURED_PROMPTS


def run(engine: Engine, prompt: str, method: str, budget: int | None, c: Constraint, steer: bool) -> dict:
    out = engine.generate(prompt, max_new_tokens=64, method=method, budget=budget, constraint=c, steer=steer)
    s = out.stats.to_dict(rounds=False)
    return {"ids": out.token_ids, "commit": s["avg_commit"], "steps": s["verify_steps"],
            "committed": s["committed_tokens"], "decode_s": s["decode_s"], "masks": s["grammar_masks"],
            "grammar_ms": s["grammar_ms"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target"), p.add_argument("--drafter")
    p.add_argument("--methods", default="dflash,ddtree:32", help="method[:budget], comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="passes over the prompts (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.target, args.drafter)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"CPU: {model} ({platform.machine()}), {args.threads} thread(s), fp32, 64 tokens out, greedy\n")
    print("| workload | method | avg_commit steered | verify-only | tok/s steered | verify-only | ratio | "
          "masks/step | grammar ms/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, c in WORKLOADS.items():
        for spec in args.methods.split(","):
            method, _, budget = spec.partition(":")
            arms: dict[bool, list[dict]] = {True: [], False: []}
            for r in range(args.rounds):
                for i, prompt in enumerate(PROMPTS):
                    order = (True, False) if (r + i) % 2 == 0 else (False, True)
                    got = {steer: run(engine, prompt, method, int(budget) if budget else None, c, steer)
                           for steer in order}
                    assert got[True]["ids"] == got[False]["ids"], "the arms must commit the same tokens"
                    for steer in order:
                        arms[steer].append(got[steer])
            commit = {k: sum(x["committed"] for x in v) / sum(x["steps"] for x in v) for k, v in arms.items()}
            rate = {k: statistics.median(x["committed"] / x["decode_s"] for x in v if x["decode_s"])
                    for k, v in arms.items()}
            per_step = sum(x["masks"] for x in arms[True]) / sum(x["steps"] for x in arms[True])
            ms = sum(x["grammar_ms"] for x in arms[True]) / sum(x["steps"] for x in arms[True])
            print(f"| {name} | {spec} | {commit[True]:.2f} | {commit[False]:.2f} | {rate[True]:.0f} | "
                  f"{rate[False]:.0f} | {rate[True] / rate[False]:.2f}x | {per_step:.1f} | {ms:.2f} |")


if __name__ == "__main__":
    main()
