"""Measurements set against their floor: each point's floor, the fit's intercept and slope against the
floor's (the floor from `bench/limit/`), the part of the step that is far from its floor, and the levers ranked
by what they would give.

Levers at a point of measured step s = a + b*ctx + r (r: the point's distance from the fit) and avg_commit c:
- step_fixed: the intercept at its floor, s' = s - (a - a_floor);
- step_context: the slope at its floor, s' = s - (b - b_floor) * ctx;
- acceptance: c at the baseline workload's avg_commit at that context (interpolated), the step unchanged.
Each gives tok/s' = 1000 c' / s'. A step is never brought below its own floor.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ddscope.bench.judging.analyze import Analysis
from ddscope.bench.limit.floor import Floor, FloorSpec, floor_line
from ddscope.bench.limit.hardware import host

NEAR, FAR = 1.5, 3.0  # measured over floor: close to the floor up to NEAR, near it up to FAR, far beyond


def _ratio_words(measured: float, floor: float) -> str:
    if floor <= 0:
        return "no floor to compare with"
    r = measured / floor
    where = "close to its floor" if r <= NEAR else "near its floor" if r <= FAR else "far from its floor"
    return f"{r:.1f}x its floor, {where}"


def _levers(a: Analysis, fit_a: float, fit_b: float, lim_a: float, lim_b: float,
            floors: dict[int, Floor]) -> list[dict[str, Any]]:
    base = sorted((p for p in a.points if p.label == a.baseline and p.avg_commit), key=lambda p: p.prompt_tokens)
    out = []
    for i, p in enumerate(a.points):
        if not p.avg_commit or i not in floors:
            continue
        step, least = p.step_ms, floors[i].floor_ms
        commit_if = max(p.avg_commit, float(np.interp(p.prompt_tokens, [q.prompt_tokens for q in base],
                                                      [q.avg_commit for q in base]))) if base else p.avg_commit
        options = {
            "step_fixed": ("the fixed part of the step at its floor", max(least, step - max(0.0, fit_a - lim_a)),
                           p.avg_commit),
            "step_context": ("the context part of the step at its floor",
                             max(least, step - max(0.0, fit_b - lim_b) * p.prompt_tokens), p.avg_commit),
            "acceptance": (f"avg_commit at the {a.baseline} workload's ({commit_if:.2f})", step, commit_if)}
        rows = [{"lever": lever, "label": p.label, "prompt_tokens": p.prompt_tokens, "what": what,
                 "tok_per_s": p.tok_per_s, "tok_per_s_if": p.tok_per_s * (commit / p.avg_commit) * (step / s_if)}
                for lever, (what, s_if, commit) in options.items()]
        for row in rows:
            row["gain"] = row["tok_per_s_if"] / row["tok_per_s"]
        out += sorted(rows, key=lambda r: -r["gain"])
    return out


def _floors(a: Analysis, spec: FloorSpec) -> tuple[dict[int, Floor], list[str]]:
    """Each point's floor, and notes for points without one or beating theirs."""
    floors: dict[int, Floor] = {}
    notes: list[str] = []
    for i, p in enumerate(a.points):
        nodes = spec.nodes or p.nodes_per_step  # given, else what the server said
        if nodes is None:
            notes.append(f"{p.label} at {p.prompt_tokens:.0f} tokens: the server did not say how many tokens a step "
                         f"verified; pass --nodes for its floor")
            continue
        floors[i] = spec.floor(p.prompt_tokens, nodes)
        for what, value in (("step", p.step_ms), ("engine step", p.engine_step_ms)):
            if value and value < floors[i].floor_ms:
                why = (BEATEN_HOST if spec.hw.name == "host" else "that is a wrong model or a wrong input "
                       "(--hardware, --gpus, --nodes, a prefix-cache hit), never a result")
                notes.append(f"WARNING: {p.label} at {p.prompt_tokens:.0f} tokens: the measured {what} ({value:.2f} ms) "
                             f"beats its floor ({floors[i].floor_ms:.2f} ms): {why}")
    return floors, notes


BEATEN_HOST = ("the host's rates were measured again and the floor is still above it: a floor to re-measure on a "
               "quieter machine (ddscope bench limit --hardware host --remeasure), not a wrong model")


def against_floor(a: Analysis, spec: FloorSpec) -> dict[str, Any]:
    """The analysis's `limit` section: floors per point, the line, verdict lines and levers. Points without a
    tree size (no --nodes, and the server did not say) get none, with a note. A step that beats the host's own
    floor has the host measured again first (its best rates are kept: ddscope.bench.limit.hardware.host)."""
    floors, notes = _floors(a, spec)
    if spec.hw.name == "host" and any(BEATEN_HOST in n for n in notes):
        spec = replace(spec, hw=host(spec.hw.measured.get("threads"), remeasure=True))
        floors, notes = _floors(a, spec)
    base = [i for i, p in enumerate(a.points) if p.label == a.baseline and i in floors]
    out: dict[str, Any] = {"assumed": spec.assumed(), "notes": notes, "levers": [], "verdict": [],
                           "points": {i: {**f.to_dict(), "break_even_commit": spec.break_even(f.prompt_tokens, f.nodes)}
                                      for i, f in floors.items()}}
    if not base or a.fit is None:
        return out
    nodes = float(np.median([floors[i].nodes for i in base]))
    lim_a, lim_b = floor_line(spec.shape, spec.hw, [a.points[i].prompt_tokens for i in base], **spec.kw(nodes))
    out["line"] = {"a_ms": lim_a, "b_ms_per_token": lim_b, "nodes": nodes}
    out["levers"] = _levers(a, a.fit.a_ms, a.fit.b_ms_per_token, lim_a, lim_b, floors)
    out["verdict"] = _verdict(a, lim_a, lim_b, floors[base[0]], out["levers"])
    _annotate(a, lim_b, out["levers"])
    return out


def _annotate(a: Analysis, lim_b: float, levers: list[dict[str, Any]]) -> None:
    """Each attribution's verdict, finished against the floor: "context scaling" that is far from its floor is
    the path that reads the context, not the context; and the levers at that point, largest first."""
    far = lim_b > 0 and a.fit.b_ms_per_token > FAR * lim_b
    for att in a.attributions:
        here = [lv for lv in levers if lv["label"] == att.label and lv["prompt_tokens"] == att.prompt_tokens]
        if not here:
            continue
        if far and ("mostly context scaling" in att.verdict or "fitted step" in att.verdict):
            att.verdict += (f"; but the context part of the step is {a.fit.b_ms_per_token / lim_b:.0f}x its floor, "
                            f"so this is the cost of the path that reads the context, not of the context itself")
        att.verdict += "; levers here: " + ", ".join(f"{lv['lever']} x{lv['gain']:.2f}" for lv in here)


def _verdict(a: Analysis, lim_a: float, lim_b: float, first: Floor, levers: list[dict[str, Any]]) -> list[str]:
    fit = a.fit
    fixed = (f"fixed part: {fit.a_ms:.2f} ms measured against a floor of {lim_a:.2f} ms "
             f"({_ratio_words(fit.a_ms, lim_a)}; {first.bound}-bound)")
    if fit.a_ms > FAR * lim_a:
        fixed += (": the step is overhead-bound (per-op dispatch, framework and launch costs), not "
                  f"{first.bound}-bound")
    lines = [fixed]
    if fit.r2 is not None:
        ctx = (f"context part: {1e3 * fit.b_ms_per_token:.3f} ms per 1k tokens measured against a floor of "
               f"{1e3 * lim_b:.4f} ({_ratio_words(fit.b_ms_per_token, lim_b)})")
        if fit.b_ms_per_token > FAR * lim_b and fit.b_ms_per_token * 1000 > 0.05 * fit.a_ms:
            ctx += ": look first at the attention path the verify step takes (the kernel that reads the cache " \
                   "under a tree mask)"
        lines.append(ctx)
    for p in a.points:  # the top lever at each point
        top = next((lv for lv in levers if lv["label"] == p.label and lv["prompt_tokens"] == p.prompt_tokens), None)
        if top and top["gain"] > 1.03:
            lines.append(f"{p.label} at {p.prompt_tokens:.0f} tokens: the biggest lever is {top['lever']} "
                         f"({top['what']}): {top['tok_per_s']:.1f} -> {top['tok_per_s_if']:.1f} tok/s, "
                         f"x{top['gain']:.2f}")
    return lines
