"""Paired server A/B: `ddscope serve` of this tree against an earlier commit's, at one concurrency, in ABBA
pairs of blocks on the same prompts (the machine drifts by a fifth within minutes; a pair's two blocks
drift alike, and each server runs first as often as second). Prompts as benchmarks/serving/concurrency.py sends
them: code, 10-1000 tokens, 128/256 out, T=0, streamed, each block new. Prints each pair and the medians.

    python benchmarks/serving/serve_ab.py --baseline 0199ab2 [--concurrency 8] [--pairs 8] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from ab_harness import WORK, abba, baseline_server, load, model_of, prompts_for

from ddscope.bench.limit.hardware import cpu_model
from ddscope.bench.running.server import serve_process
from ddscope.engine import Engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the earlier commit")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--out", type=Path, help="write every block's numbers here (JSON)")
    args = p.parse_args()
    engine = Engine.load(kv_cache_mb=128)  # the tokenizer, for the prompts
    WORK.mkdir(exist_ok=True)
    arms = ("this tree", args.baseline)
    got: dict[str, list[dict]] = {a: [] for a in arms}
    n = max(16, 2 * args.concurrency)
    with ExitStack() as stack:
        urls = {arms[0]: stack.enter_context(serve_process([], WORK / "serve-ab-this.log")),
                arms[1]: stack.enter_context(baseline_server(args.baseline, WORK)(WORK / "serve-ab-base.log"))}
        models = {a: model_of(u) for a, u in urls.items()}
        for a in arms:  # each server's first requests, outside the measurement
            asyncio.run(load(urls[a], models[a], prompts_for(engine, 100_000, 4), 4))
        for i in range(args.pairs):
            prompts = prompts_for(engine, 50_000 + i * n, n)
            for a in abba(i, arms):
                res = asyncio.run(load(urls[a], models[a], prompts, args.concurrency))
                got[a].append({"tok_s": res["tok_s"], "ttft_p50": res["ttft_p50"]})
            print(f"pair {i}: " + ", ".join(f"{a} {got[a][-1]['tok_s']:.0f} tok/s TTFT p50 "
                                            f"{1000 * got[a][-1]['ttft_p50']:.0f} ms" for a in arms), flush=True)
    ratio = median(x["tok_s"] / y["tok_s"] for x, y in zip(*got.values()))
    ttft = median(x["ttft_p50"] / y["ttft_p50"] for x, y in zip(*got.values()))
    print(f"{cpu_model()}, c={args.concurrency}, {args.pairs} pairs: tok/s {arms[0]} / {arms[1]} median {ratio:.3f}, "
          f"TTFT p50 median ratio {ttft:.3f}; medians " + ", ".join(
              f"{a} {median(r['tok_s'] for r in got[a]):.0f} tok/s, TTFT p50 "
              f"{1000 * median(r['ttft_p50'] for r in got[a]):.0f} ms" for a in arms))
    if args.out:
        args.out.write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
