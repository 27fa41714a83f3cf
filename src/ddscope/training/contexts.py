"""Context-length mix for long-context distillation: `16-512:0.4,512-2048:0.3,2048-5888:0.3`.

Each distilled item draws a bucket by weight and a prompt length uniformly inside it, so the drafter's
training anchors (which sit in the target's continuation, right after the prompt) spread over the whole
context range instead of clustering at short prompts.
"""
from __future__ import annotations

import random
from typing import NamedTuple


class Bucket(NamedTuple):
    lo: int        # inclusive, tokens
    hi: int        # exclusive
    share: float   # normalised weight


def parse_context_lengths(spec: str) -> tuple[Bucket, ...]:
    """`LO-HI:WEIGHT,...` -> buckets with shares summing to 1; a bad entry raises a one-line ValueError."""
    raw: list[tuple[int, int, float]] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        span, _, weight = item.partition(":")
        lo_s, dash, hi_s = span.partition("-")
        try:
            lo, hi, w = int(lo_s), int(hi_s), float(weight or 1)
        except ValueError:
            raise ValueError(f"--context-lengths entry {item!r}: expected LO-HI:WEIGHT, e.g. 512-2048:0.3") from None
        if not dash or lo < 1 or hi <= lo or w < 0:
            raise ValueError(f"--context-lengths entry {item!r}: need 1 <= LO < HI and WEIGHT >= 0")
        raw.append((lo, hi, w))
    total = sum(w for *_, w in raw)
    if not raw or total <= 0:
        raise ValueError(f"--context-lengths {spec!r} names no bucket with a positive weight")
    return tuple(Bucket(lo, hi, w / total) for lo, hi, w in raw)


def sample_length(buckets: tuple[Bucket, ...], rng: random.Random) -> int:
    """One prompt length: a bucket by share, then uniform inside it."""
    bucket = rng.choices(buckets, weights=[b.share for b in buckets])[0]
    return rng.randrange(bucket.lo, bucket.hi)
