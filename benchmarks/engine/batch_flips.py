"""How often batching flips a greedy token: each request run alone, then all of them in one batch, per dtype;
and how often a method's output alone leaves `ar`'s alone (each on an empty prefix cache).

Equality under batching holds up to floating-point ties: a different batch changes the reduction order of a
row's matmuls, which in bf16 can move a near-tie's argmax. A flip is the first token where the batched output
leaves the request's output alone (after it, the two continue from different texts and are not compared).

    python benchmarks/engine/batch_flips.py [--prompts 24] [--max-tokens 96] [--dtypes float32,bfloat16]
                                     [--methods ar,dflash,ddtree]

Writes docs/results/batch-flips.json; docs/server.md quotes it.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

import torch

from ddscope.bench.running.workloads import load_workload
from ddscope.engine import Engine

OUT = Path(__file__).resolve().parents[2] / "docs" / "results" / "batch-flips.json"


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.processor())


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def batched(engine: Engine, prompts: list[list[int]], kw: dict) -> list[list[int]]:
    seqs = [engine.sequence(p, **kw) for p in prompts]
    for s in seqs:
        engine.add(s)
    out = {s.id: [] for s in seqs}
    while engine.busy:
        engine.step()
        for s in seqs:
            while s.outbox:
                out[s.id] += s.outbox.popleft().token_ids
    return [out[s.id] for s in seqs]


def cold(engine: Engine, prompt: list[int], kw: dict) -> list[int]:
    """One request alone on an empty prefix cache: a hit would prefill the prompt's tail apart from its head,
    in other sums than one prefill's, and that is not what is compared here."""
    engine.scheduler.blocks.clear_cache()
    return engine.generate(prompt, **kw).token_ids


def measure(dtype: str, method: str, prompts: list[str], max_tokens: int) -> dict:
    engine = Engine.load(dtype=dtype, max_num_seqs=len(prompts))
    ids = [engine.encode(p)[-200:] for p in prompts]
    kw = dict(method=method, budget=32, max_new_tokens=max_tokens, ignore_eos=True)
    alone = [cold(engine, p, kw) for p in ids]
    ar = [cold(engine, p, {**kw, "method": "ar"}) for p in ids] if method != "ar" else alone
    from_ar = [first_difference(a, b) for a, b in zip(ar, alone)]
    engine.scheduler.blocks.clear_cache()  # no prefix shared with the runs alone
    together = batched(engine, ids, kw)
    firsts = [first_difference(a, b) for a, b in zip(alone, together)]
    compared = sum(len(a) if f is None else f + 1 for a, f in zip(alone, firsts))
    flips = sum(f is not None for f in firsts)
    return {"dtype": dtype, "method": method, "requests": len(ids), "batch": len(ids), "diverged": flips,
            "tokens_compared": compared, "flips_per_1k_tokens": 1000 * flips / compared,
            "first_divergence": [f for f in firsts if f is not None],
            "diverged_from_ar": sum(f is not None for f in from_ar),
            "first_divergence_from_ar": [f for f in from_ar if f is not None]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--methods", default="ar,dflash,ddtree")
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = list(load_workload("code").prompts[:args.prompts])
    rows = [measure(d, m, prompts, args.max_tokens) for d in args.dtypes.split(",") for m in args.methods.split(",")]
    for r in rows:
        print(f"{r['dtype']:>9} {r['method']:>6}: {r['diverged']}/{r['requests']} requests diverged, "
              f"{r['flips_per_1k_tokens']:.2f} flips per 1k tokens ({r['tokens_compared']} compared); alone, "
              f"{r['diverged_from_ar']}/{r['requests']} left ar's output")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"cpu": cpu_name(), "torch": torch.__version__, "rows": rows,
                               "command": "python benchmarks/engine/batch_flips.py"}, indent=2) + "\n")


if __name__ == "__main__":
    main()
