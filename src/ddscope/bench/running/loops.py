"""Loops in generated text: a stretch that repeats with a short period until the end. There every draft is right
(a loop is the easiest text there is: the demo target's "____" pins avg_commit at the block's maximum), so its
acceptance is the loop's, not the workload's, and is reported apart."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_PERIOD = 64  # tokens (or characters x 4, on text)
MIN_REPEATS = 3  # the period seen this many times in a row
MIN_LENGTH = 16  # and the looping stretch at least this long


@dataclass(frozen=True)
class Loop:
    start: int  # index of the first item of the repeating tail
    period: int


def find_loop(items: Sequence[Any], max_period: int = MAX_PERIOD, min_length: int = MIN_LENGTH) -> Loop | None:
    """The longest repeating tail: the earliest index from which `items` keeps one period (at most `max_period`)
    to its end, for MIN_REPEATS periods and `min_length` items; None where the end does not loop."""
    n, best = len(items), None
    for p in range(1, min(max_period, n // MIN_REPEATS) + 1):
        i = n - p - 1
        while i >= 0 and items[i] == items[i + p]:
            i -= 1
        start = i + 1
        if n - start >= max(MIN_REPEATS * p, min_length) and (best is None or start < best.start):
            best = Loop(start, p)
    return best


def loop_fields(body: dict[str, Any], commits: list[int] | None) -> dict[str, Any]:
    """A response's loop, on its token ids where it returns them (split by step where the steps are known), else
    on its text's characters (flagged only)."""
    choice = (body.get("choices") or [{}])[0]
    ids, text = choice.get("token_ids"), choice.get("text") or (choice.get("message") or {}).get("content") or ""
    if isinstance(ids, list) and ids:
        loop = find_loop(ids)
        if loop is None:
            return {"loop_from": None}
        out = {"loop_from": loop.start, "loop_period": loop.period, "loop_unit": "token"}
        return {**out, **split_commits(commits, loop.start)} if commits else out
    loop = find_loop(text, 4 * MAX_PERIOD, 4 * MIN_LENGTH)
    return {"loop_from": loop.start if loop else None, **({"loop_period": loop.period, "loop_unit": "char"}
                                                          if loop else {})}


def split_commits(commits: list[int], start: int) -> dict[str, Any]:
    """avg_commit before a loop that begins at generated token `start`, and inside it (a step belongs to where its
    first token falls; the first token, the prefill's, is position 0)."""
    position, before, inside = 1, [], []
    for c in commits:
        (inside if position >= start else before).append(c)
        position += c
    avg = lambda xs: sum(xs) / len(xs) if xs else None
    return {"loop_from": start, "avg_commit_before_loop": avg(before), "avg_commit_in_loop": avg(inside),
            "loop_steps": len(inside)}
