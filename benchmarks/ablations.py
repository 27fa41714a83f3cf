"""Before/after numbers for the engine's optimisations, measured side by side in one process.

Each optimisation is switched off by swapping in the straightforward code it replaced; arms run
interleaved (shuffled per repeat) and the table reports median ms per step and the ratio.

    python benchmarks/ablations.py [--target DIR --drafter DIR] [--repeats 7] [--max-tokens 600]
"""
from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch

from ddscope import Engine, engine as engine_mod
from engine_args import load_engine, parser
from ddscope.model import rope


class RecomputedRope:
    """Before: cos/sin computed from scratch for every forward."""

    def __init__(self, table):
        self.head_dim, self.theta = table.head_dim, table.theta

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope(positions, self.head_dim, self.theta, dtype)


class FullRedecode:
    """Before: the whole completion re-decoded every round."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids = tokenizer, []

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return text if final or not text.endswith("\ufffd") else text.rstrip("\ufffd")


@contextlib.contextmanager
def rope_recomputed(engine: Engine) -> Iterator[None]:
    saved = engine.target.rope, engine.drafter.rope
    engine.target.rope, engine.drafter.rope = RecomputedRope(saved[0]), RecomputedRope(saved[1])
    try:
        yield
    finally:
        engine.target.rope, engine.drafter.rope = saved


@contextlib.contextmanager
def full_redecode(engine: Engine) -> Iterator[None]:
    saved = engine_mod.IncrementalText
    engine_mod.IncrementalText = FullRedecode
    try:
        yield
    finally:
        engine_mod.IncrementalText = saved


ABLATIONS: dict[str, Callable[[Engine], contextlib.AbstractContextManager]] = {
    "rope table": rope_recomputed,
    "incremental detokenize": full_redecode,
}


def step_ms(engine: Engine, prompt: list[int], method: str, budget: int | None, max_tokens: int) -> float:
    """Wall ms per step after prefill: detokenisation and stop checks run outside the phase timers."""
    t0 = time.perf_counter()
    out = engine.generate(prompt, max_new_tokens=max_tokens, method=method, budget=budget, ignore_eos=True)
    wall_ms = 1000 * (time.perf_counter() - t0) - out.stats.prefill_ms
    return wall_ms / out.stats.verify_steps


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=600)
    args = p.parse_args(argv)
    engine = load_engine(args)
    prompt = engine.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    rng = random.Random(0)
    print("| optimisation | method | before ms/step | after ms/step | after/before |\n|---|---|---|---|---|")
    for name, off in ABLATIONS.items():
        for method, budget in [("ar", None), ("ddtree", 32)]:
            times: dict[str, list[float]] = {"before": [], "after": []}
            for _ in range(args.repeats):
                for arm in rng.sample(["before", "after"], 2):
                    ctx = off(engine) if arm == "before" else contextlib.nullcontext()
                    with ctx:
                        times[arm].append(step_ms(engine, prompt, method, budget, args.max_tokens))
            before, after = statistics.median(times["before"]), statistics.median(times["after"])
            print(f"| {name} | {method}{'-' + str(budget) if budget else ''} | {before:.3f} | {after:.3f} | "
                  f"{after / before:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
