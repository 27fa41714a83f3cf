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

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median, pstdev
from typing import Any

import numpy as np

ON_PAR = math.log(1.03)  # gaps under 3%, about the run-to-run noise on a shared CPU, are on par
HUBER_K = 1.345          # the usual 95%-efficiency tuning constant
R2_MIN = 0.5             # below this the line explains less step-time variance than it leaves
SHARE_MIN, SHARE_MAX = -1.0, 2.0  # beyond these, opposing terms cancel and a share reads as nonsense


class AnalysisError(ValueError):
    """Input that cannot be analysed, with a message that says why."""


class NothingMeasured(AnalysisError):
    """No request produced a measurement: the one case that exits 1."""


@dataclass
class Point:
    label: str
    prompt_tokens: float
    tok_per_s: float
    avg_commit: float | None
    n: int = 1
    tok_per_s_sd: float = 0.0
    avg_commit_sd: float = 0.0
    step_ms_sd: float = 0.0
    engine_step_ms: float | None = None
    log_lines: int | None = None  # server log lines behind avg_commit, over the repeats
    server_avg_commit: float | None = None  # the server's own figure, where it differs from the delivered one
    nodes_per_step: float | None = None  # tokens the target verified per step (tree nodes with the root), where said

    @property
    def step_ms(self) -> float | None:
        return 1000.0 * self.avg_commit / self.tok_per_s if self.avg_commit else None


@dataclass
class Fit:
    a_ms: float
    b_ms_per_token: float
    r2: float | None
    n_points: int

    def step_ms(self, ctx: float) -> float:
        return self.a_ms + self.b_ms_per_token * ctx

    @property
    def poor(self) -> bool:
        """A line through 3+ contexts that explains under R2_MIN of the step-time variance."""
        return self.r2 is not None and self.n_points >= 3 and self.r2 < R2_MIN

    def tok_per_s(self, ctx: float, commit: float) -> float:
        """The prediction tok/s(ctx, commit) = commit / step(ctx)."""
        return 1000.0 * commit / self.step_ms(ctx)


def robust_fit(x: list[float], y: list[float], iterations: int = 50) -> Fit:
    """Huber IRLS line fit (resists a stray slow request) with the ordinary R^2 of the final line."""
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    if len(xs) == 0:
        raise AnalysisError("no points to fit")
    if len(np.unique(xs)) < 2:  # one context: a flat line through the median
        return Fit(float(np.median(ys)), 0.0, None, len(xs))
    design = np.column_stack([np.ones_like(xs), xs])
    weights = np.ones_like(xs)
    coef = np.zeros(2)
    for _ in range(iterations):
        sw = np.sqrt(weights)
        new, *_ = np.linalg.lstsq(design * sw[:, None], ys * sw, rcond=None)
        converged = np.allclose(new, coef, rtol=1e-10, atol=1e-12)
        coef = new
        resid = ys - design @ coef
        scale = 1.4826 * np.median(np.abs(resid))  # MAD about zero: a shifted line still has spread
        if converged or scale <= 1e-12 * max(1.0, float(np.abs(ys).max())):
            break
        cut = HUBER_K * scale
        weights = np.minimum(1.0, cut / np.maximum(np.abs(resid), 1e-300))
    resid = ys - design @ coef
    ss_tot = float(((ys - ys.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return Fit(float(coef[0]), float(coef[1]), r2, len(xs))


# ---- input -------------------------------------------------------------------------------------

def _aggregate(rows: list[dict[str, Any]]) -> list[Point]:
    """Median over repeats of each (label, context) group; spread as the population sd."""
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
        points.append(Point(
            label=label, prompt_tokens=median(r["prompt_tokens"] for r in grp), tok_per_s=median(tps),
            avg_commit=median(commits) if len(commits) == len(grp) else None, n=len(grp),
            tok_per_s_sd=pstdev(tps), avg_commit_sd=pstdev(commits) if commits else 0.0,
            step_ms_sd=pstdev(steps) if steps else 0.0, engine_step_ms=median(engine) if engine else None,
            log_lines=sum(logged) if logged else None,
            server_avg_commit=median(server) if len(server) == len(grp) else None,
            nodes_per_step=median(nodes) if nodes else None))
    return sorted(points, key=lambda p: (p.label, p.prompt_tokens))


def _num(value: Any, what: str, where: str) -> float | None:
    if value in (None, ""):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise AnalysisError(f"{where}: {what} {value!r} is not a number") from None
    if not math.isfinite(out) or out < 0:
        raise AnalysisError(f"{where}: {what} {value!r} must be a finite number >= 0")
    return out


def _clean(raw: dict[str, Any], where: str, default_label: str) -> dict[str, Any] | None:
    """A measured row with numeric fields, or None for rows that recorded an error."""
    if raw.get("error"):
        return None
    row = {"label": str(raw.get("label") or default_label), "context": raw.get("context")}
    for key in ("prompt_tokens", "tok_per_s", "avg_commit", "server_avg_commit", "engine_step_ms", "log_lines",
                "e2e_tok_per_s", "aggregate_tok_per_s", "ttft_s", "nodes_per_step"):
        row[key] = _num(raw.get(key), key, where)
    row["concurrency"] = int(_num(raw.get("concurrency"), "concurrency", where) or 1)
    if not row["prompt_tokens"] or not row["tok_per_s"]:
        raise AnalysisError(f"{where}: prompt_tokens and tok_per_s must both be > 0")
    if row["context"] in (None, ""):
        row["context"] = row["prompt_tokens"]
    row["commits"] = raw.get("commits")
    return row


def load_rows(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Measured rows and metadata from a results.json, an AIPerf run (its artifact folder or profile_export.jsonl),
    or a CSV with columns prompt_tokens,tok_per_s,avg_commit[,label]."""
    from ddscope.bench import aiperf

    if aiperf.export_file(path) is not None:
        raw_rows, meta = aiperf.load(path)
        return [r for i, raw in enumerate(raw_rows, 1) if (r := _clean(raw, f"{path}:{i}", "aiperf"))], meta
    if path.is_dir():
        raise AnalysisError(f"{path} is a folder with no AIPerf {aiperf.EXPORT} in it")
    if not path.is_file():
        raise AnalysisError(f"file not found: {path}")
    if path.suffix == ".json":
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise AnalysisError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
            raise AnalysisError(f"{path} is not a ddscope bench results.json (no 'records' list)")
        raw_rows = doc["records"]
        meta = {k: doc.get(k) for k in ("config", "backend", "acceptance_source", "acceptance_refused",
                                        "tok_per_s", "server_log", "status", "abort_reason", "errors")}
    else:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = {"prompt_tokens", "tok_per_s", "avg_commit"} - set(reader.fieldnames or [])
            if missing:
                raise AnalysisError(f"{path} lacks CSV column(s) {', '.join(sorted(missing))}")
            raw_rows = list(reader)
        meta = {}
    rows = [r for i, raw in enumerate(raw_rows, 1) if (r := _clean(raw, f"{path}:{i}", path.stem))]
    return rows, meta


def parse_prediction(spec: str) -> tuple[float, float]:
    """`CTX:COMMIT`, e.g. "8000:4" for the tok/s predicted at 8000 tokens with avg_commit 4."""
    parts = spec.split(":")
    if len(parts) != 2:
        raise AnalysisError(f"--predict {spec!r}: expected CTX:COMMIT")
    ctx, commit = (_num(v, name, f"--predict {spec}") for v, name in zip(parts, ("context", "avg_commit")))
    if not ctx or not commit:
        raise AnalysisError(f"--predict {spec!r}: context and avg_commit must be > 0")
    return ctx, commit


def parse_point(spec: str, index: int) -> dict[str, Any]:
    """`CTX:TPS:COMMIT[:LABEL]`, e.g. "4000:45:3.1" for 45 tok/s at 4000 tokens with avg_commit 3.1."""
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise AnalysisError(f"--point {spec!r}: expected CTX:TPS:COMMIT[:LABEL]")
    raw = dict(zip(("prompt_tokens", "tok_per_s", "avg_commit"), parts[:3]))
    raw["label"] = parts[3] if len(parts) == 4 else f"point{index}"
    row = _clean(raw, f"--point {spec}", raw["label"])
    if not row or not row["avg_commit"]:
        raise AnalysisError(f"--point {spec!r}: avg_commit must be > 0")
    return row


# ---- like for like -----------------------------------------------------------------------------

# Run settings that move tok/s or acceptance by themselves: (section, key) in results.json.
SETTINGS = {"max_tokens": ("config", "max_tokens"), "workload": ("config", "workload"),
            "temperature": ("config", "temperature"), "method": ("backend", "method"),
            "backend": ("backend", "name"), "model": ("backend", "model")}

Run = tuple[str, dict[str, Any], set[str]]  # (tag, load_rows metadata, curve labels)


def _setting(meta: dict[str, Any], name: str) -> Any:
    section, key = SETTINGS[name]
    return (meta.get(section) or {}).get(key)


def _groups(runs: list[Run]) -> Iterator[tuple[str, list[Run]]]:
    """(setting, the runs compared in it): all of them, but for the workload those that share a curve,
    since padding beside code is the comparison diagnose makes."""
    labels = sorted(set().union(*(labels for *_, labels in runs)))
    for name in SETTINGS:
        if name == "workload":
            yield from ((name, [run for run in runs if label in run[2]]) for label in labels)
        else:
            yield name, runs


def run_differences(runs: list[Run]) -> tuple[list[str], list[str]]:
    """The settings in which runs differ, as "max_tokens (128 vs 600)", and notes naming the settings a
    run does not record (older files, CSV, a server that does not say): unknown, so not compared."""
    differ: dict[str, None] = {}  # dicts as ordered sets
    unknown: dict[str, dict[str, None]] = {}
    for name, group in _groups(runs):
        if len(group) < 2:
            continue
        values = [_setting(meta, name) for _, meta, _ in group]
        known = list(dict.fromkeys(v for v in values if v is not None))
        if len(known) > 1:
            differ[f"{name} ({' vs '.join(map(str, known))})"] = None
        for (tag, *_), value in zip(group, values):
            if value is None:
                unknown.setdefault(tag, {})[name] = None
    notes = [f"{tag} does not record {', '.join(names)}: not compared with the other runs"
             for tag, names in unknown.items()]
    return list(differ), notes


# ---- attribution -------------------------------------------------------------------------------

@dataclass
class Attribution:
    label: str
    prompt_tokens: float
    tok_per_s: float
    avg_commit: float
    step_ms: float
    reference: str
    ref_prompt_tokens: float
    ref_tok_per_s: float
    ref_avg_commit: float
    ref_step_ms: float
    gap_log: float
    acceptance_log: float
    context_log: float
    residual_log: float
    acceptance_share: float | None
    step_share: float | None
    context_share: float | None
    residual_share: float | None
    step_vs_curve_pct: float
    warning: str | None = None  # why the shares are withheld (None: they are printed)
    verdict: str = ""


def _share(term: float, gap: float) -> float | None:
    return term / gap if abs(gap) > 1e-12 else None


def attribute(p: Point, fit: Fit, ref_ctx: float, ref_commit: float, ref_step: float,
              reference: str) -> Attribution:
    """The gap's terms and shares; shares set to None, with a warning, where they cannot be read."""
    step = p.step_ms
    assert p.avg_commit and step
    curve, ref_curve = fit.step_ms(p.prompt_tokens), fit.step_ms(ref_ctx)
    acc = math.log(ref_commit / p.avg_commit)
    ctx = math.log(curve / ref_curve)
    resid = math.log(step / curve) - math.log(ref_step / ref_curve)
    gap = acc + ctx + resid
    a = Attribution(
        label=p.label, prompt_tokens=p.prompt_tokens, tok_per_s=p.tok_per_s, avg_commit=p.avg_commit,
        step_ms=step, reference=reference, ref_prompt_tokens=ref_ctx,
        ref_tok_per_s=1000.0 * ref_commit / ref_step, ref_avg_commit=ref_commit, ref_step_ms=ref_step,
        gap_log=gap, acceptance_log=acc, context_log=ctx, residual_log=resid,
        acceptance_share=_share(acc, gap), step_share=_share(ctx + resid, gap),
        context_share=_share(ctx, gap), residual_share=_share(resid, gap),
        step_vs_curve_pct=100.0 * (step / curve - 1.0))
    a.warning = _share_warning(a, fit)
    if a.warning:
        a.acceptance_share = a.step_share = a.context_share = a.residual_share = None
    a.verdict = verdict(a)
    return a


def _share_warning(a: Attribution, fit: Fit) -> str | None:
    if fit.poor:
        return f"the step-time fit is poor (R^2 = {fit.r2:.2f} < {R2_MIN:g})"
    shares = (a.acceptance_share, a.step_share, a.context_share, a.residual_share)
    if any(s is not None and not SHARE_MIN <= s <= SHARE_MAX for s in shares):
        return (f"the terms pull in opposite directions (a share would fall outside "
                f"[{SHARE_MIN:.0%}, {SHARE_MAX:.0%}])")
    return None


def _pct(x: float | None) -> str:
    """A share in whole percent; a share that rounds to zero prints "0%", never "-0%"."""
    return "n/a" if x is None else f"{round(100.0 * x) + 0:.0f}%"


def verdict(a: Attribution) -> str:
    """Plain words, e.g. "slower by 48% (...), mostly acceptance: 82% of the gap is acceptance
    (3.10 vs 6.00 tokens/step); step time is 9% above the baseline curve"."""
    change = 100.0 * (a.tok_per_s / a.ref_tok_per_s - 1.0)
    head = (f"{abs(change):.0f}% ({a.tok_per_s:.1f} vs {a.ref_tok_per_s:.1f} tok/s at {a.prompt_tokens:.0f} "
            f"tokens, against {a.reference})")
    if abs(a.gap_log) < ON_PAR:
        return f"on par: within {head}"
    direction = "slower" if a.gap_log > 0 else "faster"
    if a.warning:
        return (f"{direction} by {head}; shares withheld: {a.warning}. Raw ratios: avg_commit "
                f"x{a.avg_commit / a.ref_avg_commit:.2f} ({a.avg_commit:.2f} vs {a.ref_avg_commit:.2f} tokens/step), "
                f"step time x{a.step_ms / a.ref_step_ms:.2f} ({a.step_ms:.2f} vs {a.ref_step_ms:.2f} ms), "
                f"fitted step x{math.exp(a.context_log):.2f}")
    terms = {"acceptance": a.acceptance_log, "context scaling": a.context_log, "other step cost": a.residual_log}
    cause = max(terms, key=lambda k: terms[k] * math.copysign(1.0, a.gap_log))
    parts = [(f"{_pct(a.acceptance_share)} of the gap is acceptance "
              f"({a.avg_commit:.2f} vs {a.ref_avg_commit:.2f} tokens/step)")]
    if a.context_log:
        parts.append(f"{_pct(a.context_share)} is context scaling (fitted step "
                     f"x{math.exp(a.context_log):.2f} from {a.ref_prompt_tokens:.0f} tokens)")
        parts.append(f"{_pct(a.residual_share)} is other step cost")
    parts.append(f"step time is {abs(a.step_vs_curve_pct):.0f}% "
                 f"{'above' if a.step_vs_curve_pct >= 0 else 'below'} the baseline curve")
    return f"{direction} by {head}, mostly {cause}: " + "; ".join(parts)


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
    limit: dict[str, Any] | None = None  # the physical floor beside the measurements (ddscope.bench.limit.verdict)
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
        asked = _num(ctx, "context", label)
        if asked and abs(real - asked) > max(2.0, 0.02 * asked):
            notes.append(f"{label}: {asked:.0f} tokens were asked for and the server counted {real:.0f} "
                         f"({100 * (real / asked - 1):+.0f}%); rows show the server's count")
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
    notes = _length_notes(rows)
    base = sorted((p for p in points if p.label == baseline and p.avg_commit), key=lambda p: p.prompt_tokens)
    if not base:
        notes.append(f"baseline {baseline!r} has no acceptance data: tok/s only, no decomposition")
        return Analysis(baseline, None, points, [], _position_report(rows, window), notes, by_concurrency)
    fit = robust_fit([p.prompt_tokens for p in base], [p.step_ms for p in base])
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
