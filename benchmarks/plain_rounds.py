"""What a round of `auto` costs where drafting does not pay (sampling), against `ar`, in one process.

Two measurements, each interleaved so that the machine's drift lands on both sides alike:
1. one target forward of 1 and of 2 tokens over `--context` cached tokens (a plain round, and a plain
   round that also verifies a 1-token lookup branch);
2. whole generations alternating `ar` and ddtree `auto` on the same code prompts at `--temperature`
   (prefix cache off, so both prefill in full): mean step ms, prefill ms, drafted steps.

    python benchmarks/plain_rounds.py [--context 3333] [--prompts 6] [--temperature 0.7] [--threads 1]
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
from engine_args import parser

from ddscope import Engine
from ddscope.bench.sweep import cpu_model
from ddscope.bench.workloads import fit_ids, load_workload
from ddscope.models.kv_pool import KVCache

ARMS = {"ar": {"method": "ar"}, "auto": {"method": "ddtree", "budget": "auto"}}


def forward_ms(engine: Engine, cache: KVCache, context: int, n: int) -> float:
    target = engine.target
    cache.length = context
    tokens = torch.zeros(n, dtype=torch.long)
    mask = torch.ones(n, context + n, dtype=torch.bool) if n > 1 else None
    t0 = time.perf_counter()
    target(tokens, torch.arange(context, context + n), cache, mask)
    return (time.perf_counter() - t0) * 1000


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--context", type=int, default=3333)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--forwards", type=int, default=150)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.target, args.drafter, prefix_cache=False)
    workload = load_workload("code")
    print(f"{cpu_model()}, {args.threads} thread(s), context {args.context}, T={args.temperature:g}")

    warm = fit_ids(workload, 0, args.context, engine.tokenizer)
    cache = engine.target.new_cache(args.context + 2)
    engine.target(torch.tensor(warm), torch.arange(len(warm)), cache)  # the cache holds a real prefix
    ms: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.forwards):
        for n in ms:
            ms[n].append(forward_ms(engine, cache, args.context, n))
    one, two = (statistics.median(ms[n]) for n in ms)
    print(f"forward of 1 token {one:.2f} ms, of 2 tokens {two:.2f} ms ({two / one:.2f}x), medians of {args.forwards}")

    stats: dict[str, list[dict]] = {a: [] for a in ARMS}
    for i in range(args.prompts + 1):  # prompt 0 warms both arms up (and `auto`'s calibration)
        ids = fit_ids(workload, 100 + i, args.context, engine.tokenizer)
        for arm in (list(ARMS) if i % 2 else list(ARMS)[::-1]):
            out = engine.generate(ids, max_new_tokens=args.max_tokens, ignore_eos=True,
                                  temperature=args.temperature, seed=i, **ARMS[arm])
            if i:
                stats[arm].append(out.stats.to_dict(rounds=False))
    print("| arm | mean step ms | prefill ms | verify steps | drafted steps |\n|---|---|---|---|---|")
    for arm, runs in stats.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("mean_step_ms", "prefill_ms", "verify_steps")}
        print(f"| {arm} | {med['mean_step_ms']:.2f} | {med['prefill_ms']:.0f} | {med['verify_steps']:.0f} | "
              f"{[r['drafted_steps'] for r in runs]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
