"""Context-length mix for long-context distillation: `16-512:0.4,512-2048:0.3,2048-5888:0.3`.

Each distilled item draws a bucket by weight and a prompt length uniformly inside it, so the drafter's
training anchors (which sit in the target's continuation, right after the prompt) spread over the whole
context range instead of clustering at short prompts. The same mix can also reshape an existing
distilled set for training (`select_mix`), e.g. to weight a fine-tune towards long contexts.
"""
from __future__ import annotations

import random
from typing import Any, NamedTuple


class Bucket(NamedTuple):
    lo: int        # inclusive, tokens
    hi: int        # exclusive
    share: float   # normalised weight


def parse_context_lengths(spec: str, option: str = "--context-lengths") -> tuple[Bucket, ...]:
    """`LO-HI:WEIGHT,...` -> buckets with shares summing to 1; a bad entry raises a one-line ValueError
    naming `option`."""
    raw: list[tuple[int, int, float]] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        span, _, weight = item.partition(":")
        lo_s, dash, hi_s = span.partition("-")
        try:
            lo, hi, w = int(lo_s), int(hi_s), float(weight or 1)
        except ValueError:
            raise ValueError(f"{option} entry {item!r}: expected LO-HI:WEIGHT, e.g. 512-2048:0.3") from None
        if not dash or lo < 1 or hi <= lo or w < 0:
            raise ValueError(f"{option} entry {item!r}: need 1 <= LO < HI and WEIGHT >= 0")
        raw.append((lo, hi, w))
    total = sum(w for *_, w in raw)
    if not raw or total <= 0:
        raise ValueError(f"{option} {spec!r} names no bucket with a positive weight")
    return tuple(Bucket(lo, hi, w / total) for lo, hi, w in raw)


def sample_length(buckets: tuple[Bucket, ...], rng: random.Random) -> int:
    """One prompt length: a bucket by share, then uniform inside it."""
    bucket = rng.choices(buckets, weights=[b.share for b in buckets])[0]
    return rng.randrange(bucket.lo, bucket.hi)


def select_mix(records: list[dict[str, Any]], buckets: tuple[Bucket, ...], seed: int) -> list[dict[str, Any]]:
    """The largest subset of distilled `records` whose prompt lengths follow `buckets`' shares: every record
    of the scarcest bucket (relative to its share), a seeded random choice from the others, in item order.
    Records outside every bucket are left out."""
    groups = [[r for r in records if b.lo <= r["prompt_len"] < b.hi] for b in buckets]
    total = min((len(g) / b.share for g, b in zip(groups, buckets) if b.share > 0), default=0.0)
    rng = random.Random(seed)
    kept = [r for g, b in zip(groups, buckets) for r in rng.sample(g, min(len(g), round(total * b.share)))]
    if not kept:
        raise ValueError("the training mix selects no distilled record: a bucket with a positive share is empty")
    return sorted(kept, key=lambda r: r["i"])
