"""How often the target's greedy text falls into a loop: the share of greedy generations whose last
`--tail` tokens repeat with a period of at most `--max-period` tokens.

A looping target makes acceptance a property of the loop, not of the drafter (a loop is easy to
draft, until the drafter meets one it has not learned), so this number belongs next to any
acceptance figure of the demo pair. Generation is `ddtree` greedy, which is token-identical to `ar`.

    python benchmarks/drafter/loop_rate.py [--workloads code,math] [--contexts 0,2048] [--prompts 20]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from engine_args import load_engine, parser
from tqdm import tqdm

from ddscope.bench.running.workloads import fit_ids, load_workload


def loop_period(tokens: list[int], tail: int, max_period: int) -> int | None:
    """The smallest period p <= max_period with which the last `tail` tokens repeat, else None."""
    t = tokens[-tail:]
    if len(t) < tail:
        return None
    return next((p for p in range(1, max_period + 1) if all(t[i] == t[i - p] for i in range(p, tail))), None)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--workloads", default="code,math")
    p.add_argument("--contexts", default="0", help="prompt lengths in tokens; 0 = the prompt as it is")
    p.add_argument("--prompts", type=int, default=20, help="prompts per workload and context")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--tail", type=int, default=48, help="tokens at the end that must repeat")
    p.add_argument("--max-period", type=int, default=16)
    args = p.parse_args(argv)
    if not 0 < args.tail <= args.max_tokens:
        p.error("--tail must be in [1, --max-tokens]")
    engine = load_engine(args)
    contexts = [int(c) for c in args.contexts.split(",")]
    workloads = [load_workload(spec) for spec in args.workloads.split(",")]  # a missing data set fails now
    print("| workload | ctx | generations | looping | loop rate | periods |\n|---|---|---|---|---|---|")
    for workload in workloads:
        spec = workload.label
        for ctx in contexts:
            periods = []
            for i in tqdm(range(args.prompts), desc=f"{spec} @ {ctx}", leave=False, file=sys.stderr):
                n = ctx or len(engine.encode(workload.prompts[i % len(workload.prompts)]))
                ids = fit_ids(workload, i, n, engine.tokenizer)
                out = engine.generate(ids, max_new_tokens=args.max_tokens, method="ddtree", budget="auto",
                                      ignore_eos=True, temperature=0.0)
                periods.append(loop_period(out.token_ids, args.tail, args.max_period))
            looping = [q for q in periods if q is not None]
            print(f"| {spec} | {ctx or 'as is'} | {len(periods)} | {len(looping)} | "
                  f"{len(looping) / len(periods):.0%} | {sorted(set(looping))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
