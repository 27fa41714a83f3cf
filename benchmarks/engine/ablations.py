"""Before/after numbers for the engine's optimisations, measured side by side in one process.

Each optimisation is switched off by swapping in the straightforward code it replaced; arms run
interleaved (shuffled per repeat) and the table reports median ms per step and the ratio.

    python benchmarks/engine/ablations.py [--target DIR --drafter DIR] [--repeats 7] [--max-tokens 600] [--context N]

`--context N` pads the prompt to N tokens (the padding workload): attention costs show at long context.
"""
from __future__ import annotations

import contextlib
import random
import statistics
import sys
from pathlib import Path
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from engine_args import load_engine, parser

from ddscope import Engine
from ddscope.bench.running.workloads import fit_ids, load_workload
from ddscope.models import layers as layers_mod
from ddscope.models.layers import RMSNorm, rope
from ddscope.speculative import completion as completion_mod
from ddscope.speculative import proposers as proposers_mod
from ddscope.speculative import sampling


class RecomputedRope:
    """Before: cos/sin computed from scratch for every forward."""

    def __init__(self, table):
        self.head_dim, self.theta = table.head_dim, table.theta

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope(positions, self.head_dim, self.theta, dtype)


class FullRedecode:
    """Before: the whole completion re-decoded for every token (IncrementalText's interface)."""

    def __init__(self, tokenizer, **decode: bool):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        return self.text

    def flush(self) -> None:
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)


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
    saved = completion_mod.IncrementalText
    completion_mod.IncrementalText = FullRedecode
    try:
        yield
    finally:
        completion_mod.IncrementalText = saved


@contextlib.contextmanager
def swapped(*swaps: tuple[object, str, object]) -> Iterator[None]:
    """Set each (owner, attribute, value) for the duration, then put the originals back."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, value in swaps:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def unfused_rms_norm(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """Before: the statistics op by op."""
    h = x.float()
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def ungrouped_attend(self, q, k, v, mask, causal=False):
    """Before: SDPA's own GQA over a boolean mask, each query head on its own."""
    if mask is not None and mask.dtype != torch.bool:  # a grouped bias: back to the boolean rows
        mask = mask[:q.shape[1]] == 0
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                         enable_gqa=q.shape[0] != k.shape[0])
    return self.o_proj(out[0].transpose(0, 1).reshape(q.shape[1], -1))


def argmax(scores: torch.Tensor) -> torch.Tensor:
    return scores.argmax(-1)


ABLATIONS: dict[str, Callable[[Engine], contextlib.AbstractContextManager]] = {
    "rope table": rope_recomputed,
    "incremental detokenize": full_redecode,
    "fused RMSNorm": lambda e: swapped((RMSNorm, "forward", unfused_rms_norm)),
    "grouped-query attention": lambda e: swapped((layers_mod.Attention, "attend", ungrouped_attend)),
    "max() for argmax": lambda e: swapped((sampling, "first_max", argmax), (proposers_mod, "first_max", argmax)),
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
    p.add_argument("--context", type=int, default=0, help="pad the prompt to this many tokens (default: a short one)")
    args = p.parse_args(argv)
    engine = load_engine(args)
    prompt = engine.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    if args.context:
        prompt = fit_ids(load_workload("padding"), 0, args.context, engine.tokenizer)
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
