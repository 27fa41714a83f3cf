"""Throughput decomposition and regression attribution.

tok/s = avg_commit / step_time, so step_ms = 1000 * avg_commit / tok_per_s. A robust line
step_ms(ctx) = a + b*ctx is fitted to the baseline's points. A point is compared with a reference
(the baseline curve at the same context, or for baseline points the baseline's shortest context):

    ln(tps_ref / tps) = ln(commit_ref / commit)       acceptance
                      + ln(step_fit(ctx) / step_fit(ctx_ref))   context scaling (0 at the same ctx)
                      + ln(step / step_fit(ctx)) - ln(step_ref / step_fit(ctx_ref))   other step cost

and each term's share of the gap is term / ln(tps_ref / tps). Shares are only as good as the fit and
only readable when the terms do not cancel: with a poor fit (R^2 < R2_MIN on 3+ contexts) or a share
outside [SHARE_MIN, SHARE_MAX], the verdict says so and gives the raw ratios instead.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import median, pstdev
from typing import Any

import numpy as np

from ddscope.bench.collecting.results import as_number
from ddscope.bench.errors import AnalysisError, NothingMeasured
from ddscope.bench.judging.attribution import Attribution, attribute
from ddscope.bench.judging.fit import R2_MIN, Fit, Point, robust_fit


def _pooled(grp: list[dict[str, Any]]) -> tuple[float, float, float | None] | None:
    """(avg_commit, decode tok/s, the server's own avg_commit) of a run of different prompts as a server counts it: all its tokens after the
    first over all its verify steps, and over all its decode time (what vLLM's counters and AIPerf's token-weighted
    figures give); None for repeats of one prompt (their median is the point) or without per-request counts."""
    prompts = {r.get("prompt_sha1") for r in grp}
    if len(grp) < 2 or (len(prompts) == 1 and None not in prompts):
        return None
    if not all(r.get("verify_steps") and r.get("completion_tokens") and r.get("avg_commit") for r in grp):
        return None
    tokens, steps = sum(r["completion_tokens"] - 1 for r in grp), sum(r["verify_steps"] for r in grp)
    decode_s = sum((r["completion_tokens"] - 1) / r["tok_per_s"] for r in grp)
    server = (sum(r["server_avg_commit"] * r["verify_steps"] for r in grp) / steps
              if all(r.get("server_avg_commit") for r in grp) else None)
    return tokens / steps, tokens / decode_s, server


def _aggregate(rows: list[dict[str, Any]]) -> list[Point]:
    """Each (label, context) group: a run of different prompts pooled as the server counts it (_pooled), repeats
    of one prompt by their median; the spread across requests as the population sd."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["label"], row["context"]), []).append(row)
    points = []
    for (label, _), grp in groups.items():
        commits = [r["avg_commit"] for r in grp if r.get("avg_commit")]
        steps = [1000.0 * r["avg_commit"] / r["tok_per_s"] for r in grp if r.get("avg_commit")]
        engine = [r["engine_step_ms"] for r in grp if r.get("engine_step_ms")]
        tps = [r["tok_per_s"] for r in grp]
        logged = [int(r["log_lines"]) for r in grp if r.get("log_lines") is not None]
        server = [r["server_avg_commit"] for r in grp if r.get("server_avg_commit")]
        nodes = [r["nodes_per_step"] for r in grp if r.get("nodes_per_step")]
        grammar = [r["grammar_ms"] for r in grp if r.get("grammar_ms") is not None]
        pooled = _pooled(grp)
        commit = median(commits) if len(commits) == len(grp) else None
        points.append(Point(
            label=label, prompt_tokens=median(r["prompt_tokens"] for r in grp),
            tok_per_s=pooled[1] if pooled else median(tps), avg_commit=pooled[0] if pooled else commit, n=len(grp),
            tok_per_s_sd=pstdev(tps), avg_commit_sd=pstdev(commits) if commits else 0.0,
            step_ms_sd=pstdev(steps) if steps else 0.0, engine_step_ms=median(engine) if engine else None,
            log_lines=sum(logged) if logged else None,
            server_avg_commit=(pooled[2] if pooled else median(server)) if len(server) == len(grp) else None,
            nodes_per_step=median(nodes) if nodes else None, grammar_ms=median(grammar) if grammar else None,
            summary="pooled" if pooled else "median"))
    return sorted(points, key=lambda p: (p.label, p.prompt_tokens))


# ---- acceptance against generated position ------------------------------------------------------

def acceptance_windows(commit_lists: list[list[int]], window: int) -> list[dict[str, float]]:
    """avg_commit per window of generated positions, pooled over requests: a step belongs to the
    window its first token falls in."""
    if window < 1:
        raise AnalysisError("the acceptance window must be at least 1 token")
    tokens: dict[int, int] = {}
    steps: dict[int, int] = {}
    for commits in commit_lists:
        pos = 0
        for c in commits:
            w = pos // window
            tokens[w] = tokens.get(w, 0) + c
            steps[w] = steps.get(w, 0) + 1
            pos += c
    return [{"start": w * window, "end": (w + 1) * window, "avg_commit": tokens[w] / steps[w],
             "steps": steps[w]} for w in sorted(steps)]


# ---- the whole analysis ------------------------------------------------------------------------

@dataclass
class Analysis:
    baseline: str
    fit: Fit | None
    points: list[Point]
    attributions: list[Attribution]
    acceptance_by_position: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    by_concurrency: list[dict[str, Any]] = field(default_factory=list)  # concurrency_table's rows
    limit: dict[str, Any] | None = None  # the physical floor beside the measurements (ddscope.bench.judging.floor_verdict)
    by_category: list[dict[str, Any]] = field(default_factory=list)  # intervals.sweep_matrix: workloads x contexts

    def floor_of(self, i: int) -> dict[str, Any] | None:
        """Point i's floor (floor_ms, bound, parts, break_even_commit), where one was computed."""
        return (self.limit or {}).get("points", {}).get(i)

    def attribution_of(self, p: Point) -> Attribution | None:
        return next((a for a in self.attributions if a.label == p.label and a.prompt_tokens == p.prompt_tokens),
                    None)

    def predict(self, ctx: float, commit: float) -> dict[str, float]:
        """tok/s the baseline's step curve predicts at this context and acceptance."""
        if self.fit is None:
            raise AnalysisError("no step-time fit to predict from (the baseline has no acceptance data)")
        return {"prompt_tokens": ctx, "avg_commit": commit, "step_ms": self.fit.step_ms(ctx),
                "tok_per_s": self.fit.tok_per_s(ctx, commit)}

    def to_dict(self, predictions: list[dict[str, float]] = ()) -> dict[str, Any]:
        def point(i: int, p: Point) -> dict[str, Any]:
            floor = self.floor_of(i)
            out = {**asdict(p), "step_ms": p.step_ms, "floor_step_ms": floor["floor_ms"] if floor else None,
                   "floor": floor,
                   # the curve's tok/s at this point's own acceptance: actual / predicted = step residual
                   "predicted_tok_per_s": self.fit.tok_per_s(p.prompt_tokens, p.avg_commit)
                   if self.fit and p.avg_commit else None}
            a = self.attribution_of(p)
            if a is not None:
                return {**out, **asdict(a)}
            why = "no acceptance data: tok/s only" if not p.avg_commit else "the baseline reference point"
            return {**out, "acceptance_share": None, "step_share": None, "verdict": why}

        limit = self.limit or {}
        return {
            "baseline": self.baseline,
            "fit": asdict(self.fit) if self.fit else None,
            "limit": limit.get("line"),
            "limit_verdict": limit.get("verdict", []),
            "levers": limit.get("levers", []),
            "limit_assumed": limit.get("assumed"),
            "points": [point(i, p) for i, p in enumerate(self.points)],
            "predictions": list(predictions),
            "acceptance_by_position": self.acceptance_by_position,
            "by_concurrency": self.by_concurrency,
            "by_category": self.by_category,
            "notes": self.notes + limit.get("notes", []),
        }


def _interp_commit(base: list[Point], ctx: float) -> float:
    xs = [p.prompt_tokens for p in base]
    return float(np.interp(ctx, xs, [p.avg_commit for p in base]))


def _position_report(rows: list[dict[str, Any]], window: int) -> list[dict[str, Any]]:
    groups: dict[tuple[str, Any], list[list[int]]] = {}
    for r in rows:
        if r.get("commits"):
            groups.setdefault((r["label"], r["context"]), []).append(r["commits"])
    out = []
    lengths = _real_lengths(rows)
    for (label, ctx), lists in sorted(groups.items(), key=lambda kv: (kv[0][0], float(kv[0][1]))):
        wins = acceptance_windows(lists, window)
        decay = wins[-1]["avg_commit"] / wins[0]["avg_commit"] if len(wins) > 1 else 1.0
        out.append({"label": label, "context": lengths[(label, ctx)], "windows": wins, "last_over_first": decay})
    return out


def _real_lengths(rows: list[dict[str, Any]]) -> dict[tuple[str, Any], float]:
    """The median prompt length the server counted, per (label, requested context)."""
    groups: dict[tuple[str, Any], list[float]] = {}
    for r in rows:
        groups.setdefault((r["label"], r["context"]), []).append(r["prompt_tokens"])
    return {key: median(values) for key, values in groups.items()}


def _length_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Where the server counted other prompt lengths than were asked for (prompts sized without a tokenizer)."""
    notes = []
    for (label, ctx), real in sorted(_real_lengths(rows).items(), key=lambda kv: (kv[0][0], float(kv[0][1]))):
        asked = as_number(ctx, "context", label)
        if asked and abs(real - asked) > max(2.0, 0.02 * asked):
            notes.append(f"{label}: {asked:.0f} tokens were asked for and the server counted {real:.0f} "
                         f"({100 * (real / asked - 1):+.0f}%); rows show the server's count")
    return notes


def _grammar_shares(points: list[Point]) -> list[str]:
    """The grammar's part of each constrained point's step (what the server reports of it)."""
    each = [f"{p.grammar_ms:.2f} of {p.step_ms:.2f} ms ({100 * p.grammar_ms / p.step_ms:.0f}%) at "
            f"{p.prompt_tokens:.0f}" for p in points if p.grammar_ms and p.step_ms]
    return [f"structured outputs: the grammar's time a step (masks and matcher), {', '.join(each)}"] if each else []


TREE_SIZE_SPREAD = 1.15  # tokens verified a step may vary this much across the fitted points


def _mixed_trees(base: list[Point]) -> list[str]:
    """A flag where the fitted points verified trees of different sizes (`auto`, a peer's dynamic speculation):
    a step's cost grows with its rows, so the line would mix the tree size with the context."""
    sized = [p for p in base if p.nodes_per_step]
    if len(sized) < 2:
        return []
    nodes = [p.nodes_per_step for p in sized]
    if max(nodes) <= TREE_SIZE_SPREAD * min(nodes):
        return []
    each = ", ".join(f"{p.nodes_per_step:.1f} at {p.prompt_tokens:.0f}" for p in sized)
    return [f"the tree size varied across contexts (tokens verified a step: {each}): the step-time line mixes "
            f"tree size with context, so its shares are not context scaling alone; hold the tree fixed "
            f"(bench sweep --budget N)"]


def _loop_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Points whose outputs end in a loop, with the acceptance inside the loop apart from before it."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["label"], r["context"]), []).append(r)
    notes = []
    for (label, ctx), grp in groups.items():
        looping = [r for r in grp if r.get("loop_from") is not None]
        if not looping:
            continue
        unit = looping[0].get("loop_unit") or "token"
        line = (f"{label} @ {ctx}: {len(looping)} of {len(grp)} outputs end in a loop (from {unit} "
                f"{median(r['loop_from'] for r in looping):.0f}, period {median(r['loop_period'] for r in looping):.0f})")
        inside = [r["avg_commit_in_loop"] for r in looping if r.get("avg_commit_in_loop")]
        before = [r["avg_commit_before_loop"] for r in looping if r.get("avg_commit_before_loop")]
        if inside:
            line += f": avg_commit {median(inside):.2f} in the loop"
            line += f", {median(before):.2f} before it" if before else ""
        notes.append(line + "; acceptance there is the loop's, not the workload's")
    return notes


def concurrency_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (label, context, concurrency) with a level above 1 measured: the medians of aggregate tok/s (all
    requests' tokens over the group's wall time; one after another: each request's end-to-end tok/s),
    per-request tok/s, avg_commit and step time, and TTFT (streamed). Batching shows as the per-request
    step time growing with the level; acceptance as avg_commit falling."""
    if all(r.get("concurrency", 1) == 1 for r in rows):
        return []
    groups: dict[tuple[str, Any, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["label"], r["context"], r.get("concurrency", 1)), []).append(r)

    def med(grp: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in grp if r.get(key) is not None]
        return median(values) if values else None

    table = []
    for (label, context, c), grp in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        steps = [1000.0 * r["avg_commit"] / r["tok_per_s"] for r in grp if r.get("avg_commit")]
        table.append({"label": label, "context": context, "concurrency": c, "n": len(grp),
                      "aggregate_tok_per_s": med(grp, "aggregate_tok_per_s" if c > 1 else "e2e_tok_per_s"),
                      "tok_per_s": med(grp, "tok_per_s"), "avg_commit": med(grp, "avg_commit"),
                      "step_ms": median(steps) if steps else None, "ttft_s": med(grp, "ttft_s")})
    return table


def analyze(rows: list[dict[str, Any]], baseline: str | None = None, window: int = 32) -> Analysis:
    """Fit the baseline's step curve and attribute every other point's gap to it (requests sent one after
    another); tabulate the concurrency levels beside it."""
    if not rows:
        raise NothingMeasured("no measured points (every request failed or the file is empty)")
    by_concurrency = concurrency_table(rows)
    rows = [r for r in rows if r.get("concurrency", 1) == 1]
    if not rows:
        return Analysis("", None, [], [], [], ["no requests were sent one after another: the context sweep is "
                                               "empty, the concurrency table stands alone"], by_concurrency)
    points = _aggregate(rows)
    labels = sorted({p.label for p in points})
    if baseline is None:
        baseline = "padding" if "padding" in labels else labels[0]
    elif baseline not in labels:
        raise AnalysisError(f"baseline {baseline!r} is not among the labels: {', '.join(labels)}")
    notes = _length_notes(rows) + _loop_notes(rows)
    base = sorted((p for p in points if p.label == baseline and p.avg_commit), key=lambda p: p.prompt_tokens)
    if not base:
        notes.append(f"baseline {baseline!r} has no acceptance data: tok/s only, no decomposition")
        return Analysis(baseline, None, points, [], _position_report(rows, window), notes, by_concurrency)
    fit = robust_fit([p.prompt_tokens for p in base], [p.step_ms for p in base])
    notes += _mixed_trees(base) + _grammar_shares(points)
    if fit.poor:
        notes.append(f"the step-time fit is poor (R^2 = {fit.r2:.2f} < {R2_MIN:g}): attribution shares are "
                     f"withheld and raw ratios shown; step time does not follow context on a line here")
    if fit.r2 is None:
        notes.append("the baseline has one context: the step curve is flat, context scaling is not measured")
    ref = base[0]
    attributions = []
    for p in points:
        if not p.avg_commit:
            notes.append(f"{p.label} at {p.prompt_tokens:.0f} tokens has no acceptance data: tok/s only")
        elif min(fit.step_ms(p.prompt_tokens), fit.step_ms(ref.prompt_tokens)) <= 0:  # a noisy slope, extrapolated
            notes.append(f"the fitted step curve is not positive at {p.prompt_tokens:.0f} tokens: "
                         f"{p.label} there is not attributed")
        elif p.label == baseline and p is not ref:
            attributions.append(attribute(p, fit, ref.prompt_tokens, ref.avg_commit, ref.step_ms,
                                          f"{baseline} at {ref.prompt_tokens:.0f} tokens"))
        elif p.label != baseline:
            lo, hi = base[0].prompt_tokens, base[-1].prompt_tokens
            if not lo <= p.prompt_tokens <= hi:
                notes.append(f"{p.label} at {p.prompt_tokens:.0f} tokens lies outside the baseline's "
                             f"contexts ({lo:.0f}-{hi:.0f}): the curve is extrapolated")
            attributions.append(attribute(p, fit, p.prompt_tokens, _interp_commit(base, p.prompt_tokens),
                                          fit.step_ms(p.prompt_tokens), f"the {baseline} curve"))
    return Analysis(baseline, fit, points, attributions, _position_report(rows, window), notes, by_concurrency)
