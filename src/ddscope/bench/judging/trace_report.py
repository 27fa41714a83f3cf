"""A trace judged: per workload the generation's step-time fit (against a prompt sweep's line and the physical
floor's where given), acceptance by generated position with bootstrap intervals, loops apart, the checks' outcome;
written as report.md and trace.png. The run that records a trace is `bench/running/trace.py`."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ddscope.bench.collecting.results import load_rows
from ddscope.bench.collecting.stream_steps import SKIP_STEPS
from ddscope.bench.errors import AnalysisError, Stopped
from ddscope.bench.judging.analyze import analyze
from ddscope.bench.judging.fit import Fit, category_matrix, robust_fit
from ddscope.bench.limit.floor import FloorSpec, floor_line
from ddscope.util.atomic import atomic_write_text, replacing

WINDOWS = 4  # position windows of the acceptance matrix


def report_trace(doc: dict[str, Any], out: Path | None, against: Path | None, floor: FloorSpec | None,
                 as_json: bool) -> int:
    """Judge a trace: print its summary (JSON or words) and write report.md and trace.png to `out`; a trace
    whose stream was dropped raises Stopped once its report is out (exit 1)."""
    summary = summarize(doc, against, floor)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_report(doc, summary, out)
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        print("\n".join(lines(doc, summary)))
    if doc["status"] != "complete":
        dropped = next((r["error"] for r in doc["requests"] if r["status"] != "complete"), "the run was interrupted")
        raise Stopped(f"the stream was dropped: {dropped}; the partial trace is kept, marked")
    return 0


def summarize(doc: dict[str, Any], against: Path | None = None, floor: FloorSpec | None = None) -> dict[str, Any]:
    """Per workload: the generation's step-time fit (against the prompt sweep's where given, and the physical
    floor's line with a FloorSpec), acceptance by position window, the checks' outcome; and the matrix of
    avg_commit by workload and position."""
    max_tokens = doc["config"]["max_tokens"]
    width = max(1, math.ceil(max_tokens / WINDOWS))
    sweep_fit = _sweep_fit(against) if against else None
    workloads, cells = {}, {}
    for label in dict.fromkeys(r["workload"] for r in doc["requests"]):
        reqs = [r for r in doc["requests"] if r["workload"] == label and r.get("concurrency", 1) == 1]
        steps = [s for r in reqs for s in r["steps"]]
        late = [s for r in reqs for s in r["steps"][SKIP_STEPS:]]  # each request's warm-up steps left out
        fit = generation_fit(late)
        counted = [s["commit"] for s in steps if s["commit"] is not None]
        lo, hi = (min(s["context"] for s in steps), max(s["context"] for s in steps)) if steps else (0, 0)
        entry = {"requests": len(reqs), "steps": len(steps), "fit": fit.__dict__ if fit else None,
                 "approximate": any(r["approximate"] for r in reqs),
                 "reasons": sorted({why for r in reqs for why in r["reasons"]}),
                 "avg_commit": sum(counted) / len(counted) if counted else None,
                 **_loop_split(reqs, steps),
                 "median_gap_ms": float(np.median([s["gap_ms"] for s in late])) if late else None}
        if fit and sweep_fit:
            entry["against_sweep"] = against_sweep(fit, sweep_fit, lo, hi)
        entry["under_load"] = _under_load([r for r in doc["requests"] if r["workload"] == label])
        if floor is not None and late:
            entry["floor"] = _floor(floor, late, lo, hi)
        workloads[label] = entry
        for s in steps:
            if s["commit"] is not None:
                cells.setdefault((label, s["position"] // width * width), []).append(s["commit"])
    return {"workloads": workloads, "matrix": category_matrix(cells), "window": width}


def _under_load(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per concurrency level: the median step (chunk gap, each stream's warm-up steps left out) and avg_commit."""
    out = {}
    for level in sorted({r.get("concurrency", 1) for r in reqs}):
        steps = [s for r in reqs if r.get("concurrency", 1) == level for s in r["steps"][SKIP_STEPS:]]
        commits = [s["commit"] for s in steps if s["commit"] is not None]
        if steps:
            out[str(level)] = {"streams": sum(1 for r in reqs if r.get("concurrency", 1) == level),
                               "median_gap_ms": float(np.median([s["gap_ms"] for s in steps])),
                               "avg_commit": sum(commits) / len(commits) if commits else None}
    return out


def _loop_split(reqs: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Acceptance inside the requests' looping stretches apart from outside them (a loop is the easiest text)."""
    inside = [s["commit"] for s in steps if s.get("in_loop") and s["commit"] is not None]
    outside = [s["commit"] for s in steps if not s.get("in_loop") and s["commit"] is not None]
    if not inside:
        return {"looping_requests": 0}
    return {"looping_requests": sum(1 for r in reqs if r.get("loop")),
            "loop_from": [r["loop"]["from"] for r in reqs if r.get("loop")],
            "avg_commit_in_loop": sum(inside) / len(inside),
            "avg_commit_outside_loop": sum(outside) / len(outside) if outside else None}


def _floor(spec: FloorSpec, steps: list[dict[str, Any]], lo: float, hi: float) -> dict[str, Any]:
    """The floor's line over the generation's contexts, at its tree size: --nodes, else the median the server
    reported (ddscope's rounds), else 1 (plain decoding: a lower bound for any tree)."""
    nodes = spec.nodes or float(np.median([s.get("nodes", 1) for s in steps]))
    a, b = floor_line(spec.shape, spec.hw, [lo, hi], **spec.kw(nodes))
    # one gap can beat it (a chunk held back makes the next one's gap short); their median cannot
    gap, ctx = float(np.median([s["gap_ms"] for s in steps])), float(np.median([s["context"] for s in steps]))
    return {"a_ms": a, "b_ms_per_token": b, "nodes": nodes, "median_gap_ms": gap, "median_below": gap < a + b * ctx}


def _sweep_fit(path: Path) -> Any:
    rows, _ = load_rows(path)
    fit = analyze(rows).fit
    if fit is None:
        raise AnalysisError(f"{path}: the sweep has no step-time fit to set the generation against")
    return fit


def lines(doc: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """The terminal's and report.md's words."""
    out = [f"trace: {doc['backend']['name']} at {doc['backend']['url']}, {doc['config']['prompt_tokens']} prompt "
           f"tokens, {doc['config']['max_tokens']} out, {doc['config']['repeats']} repeat(s) per workload; "
           f"status {doc['status']}"]
    for g in doc.get("groups", []):
        truth = (f"the server counted {g['server_steps']:.0f}" if "server_steps" in g else "the server counts no steps")
        out.append(f"- {g['workload']} at c={g['concurrency']}: the streams' {g['trace_steps']} steps together, "
                   f"{truth}; {g['trace_tokens']} tokens, usage {g['usage_tokens']}"
                   + (f" (approximate: {'; '.join(g['reasons'])})" if g["approximate"] else ""))
    for label, w in summary["workloads"].items():
        fit = w["fit"]
        line = f"- {label}: {w['steps']} steps, avg_commit {w['avg_commit']:.2f}" if w["avg_commit"] else f"- {label}"
        if fit:
            line += (f"; step_ms = {fit['a_ms']:.2f} + {1e3 * fit['b_ms_per_token']:.3f} ms per 1k tokens over the "
                     f"generation (R^2 {fit['r2']:.2f})" if fit["r2"] is not None else "")
        out.append(line)
        load = w.get("under_load") or {}
        if len(load) > 1 and "1" in load:
            alone = load["1"]["median_gap_ms"]
            for level, x in load.items():
                if level != "1":
                    out.append(f"  under load (c={level}, {x['streams']} streams): step {x['median_gap_ms']:.2f} ms, "
                               f"x{x['median_gap_ms'] / alone:.2f} the step alone ({alone:.2f} ms); avg_commit "
                               f"{x['avg_commit'] or 0:.2f} against {load['1']['avg_commit'] or 0:.2f} alone")
        if w.get("looping_requests"):
            outside = w["avg_commit_outside_loop"]
            out.append(f"  loop: {w['looping_requests']} of {w['requests']} generations end in a loop (from token "
                       f"{', '.join(map(str, w['loop_from']))}): avg_commit {w['avg_commit_in_loop']:.2f} in it"
                       + (f", {outside:.2f} outside it" if outside else "")
                       + "; acceptance there is the loop's, not the workload's")
        if "against_sweep" in w:
            out.append(f"  {w['against_sweep']['verdict']}")
        if "floor" in w:
            f = w["floor"]
            ratio = (f"; the measured line is {fit['a_ms'] / f['a_ms']:.1f}x its intercept"
                     if fit and f["a_ms"] > 0 else "")
            out.append(f"  floor: {f['a_ms']:.3f} ms + {1e3 * f['b_ms_per_token']:.4f} ms per 1k tokens "
                       f"({f['nodes']:g} tokens a step){ratio}")
            if f["median_below"]:
                out.append(f"  WARNING: the median gap ({f['median_gap_ms']:.2f} ms) beats its floor: a wrong model or "
                           "input, or chunks that are not steps")
        if w["approximate"]:
            out.append("  APPROXIMATE: " + "; ".join(w["reasons"]))
    facts = [r["checks"] for r in doc["requests"] if "rounds_equal" in r["checks"]]
    timed = [f for f in facts if f.get("gap_over_engine")]
    if facts:
        line = f"- step boundaries: {sum(f['rounds_equal'] for f in facts)}/{len(facts)} requests' steps equal the " \
               "server's rounds"
        if timed:
            line += (f"; median gap / engine step {float(np.median([f['gap_over_engine'] for f in timed])):.3f}; "
                     f"stream jitter p50 {float(np.median([f['jitter_p50_ms'] for f in timed])):.2f} ms, p90 "
                     f"{float(np.median([f['jitter_p90_ms'] for f in timed])):.2f} ms a step")
        out.append(line)
    out.append("")
    out.append(f"avg_commit by workload and generated position (95% bootstrap interval over steps; windows of "
               f"{summary['window']} tokens):")
    out.append("| workload | positions | avg_commit | 95% interval | steps |")
    out.append("|---|---|---|---|---|")
    for cell in summary["matrix"]:
        lo, hi = cell["ci95"]
        out.append(f"| {cell['category']} | {cell['column']}-{cell['column'] + summary['window']} | "
                   f"{cell['avg_commit']:.2f} | {lo:.2f}-{hi:.2f} | {cell['steps']} |")
    return out


def plot(doc: dict[str, Any], summary: dict[str, Any], path: Path, against: Any = None) -> None:
    """Commit and step time against generated position, rolling medians, with the generation's fit and the
    prompt sweep's line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, label in enumerate(summary["workloads"]):
        steps = sorted((s for r in doc["requests"] if r["workload"] == label for s in r["steps"]),
                       key=lambda s: s["position"])
        if not steps:
            continue
        x = [s["position"] for s in steps]
        width = max(5, len(steps) // 40)
        counted = [(s["position"], s["commit"]) for s in steps if s["commit"] is not None]
        if counted:
            left.plot([p for p, _ in counted], rolling_median([c for _, c in counted], width), color=f"C{i}",
                      label=label)
        right.plot(x, rolling_median([s["gap_ms"] for s in steps], width), color=f"C{i}", alpha=0.8,
                   label=f"{label} step ms")
        w = summary["workloads"][label]
        prompt = steps[0]["context"] - steps[0]["position"]
        ends = [x[0], x[-1]]
        if w["fit"]:
            a, b = w["fit"]["a_ms"], w["fit"]["b_ms_per_token"]
            right.plot(ends, [a + b * (prompt + e) for e in ends], color=f"C{i}", linestyle="--",
                       label=f"{label} generation fit")
        if "floor" in w:
            f = w["floor"]
            right.plot(ends, [f["a_ms"] + f["b_ms_per_token"] * (prompt + e) for e in ends], color="grey",
                       linestyle=":", label=f"{label} physical floor")
        if "against_sweep" in w:
            sf = w["against_sweep"]["sweep_fit"]
            right.plot(ends, [sf["a_ms"] + sf["b_ms_per_token"] * (prompt + e) for e in ends], color="black",
                       linewidth=1, label="prompt sweep's line")
    left.set(xlabel="generated position", ylabel="tokens committed a step (rolling median)",
             title="acceptance along the generation")
    right.set(xlabel="generated position", ylabel="ms between chunks (rolling median)",
              title="step time along the generation")
    left.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    for ax in (left, right):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def write_report(doc: dict[str, Any], summary: dict[str, Any], out: Path) -> None:
    plot(doc, summary, out / "trace.png")
    body = ["# ddscope bench trace", "", *lines(doc, summary), "", "![trace](trace.png)", "",
            "Each streamed chunk is one step: its tokens the step's commit, the gap before it the step's time "
            "(docs/bench.md, Traces). The first chunk is the prefill's token."]
    atomic_write_text(out / "report.md", "\n".join(body) + "\n")


def generation_fit(steps: list[dict[str, Any]]) -> Fit | None:
    """step_ms = a + b*context over the generation's own steps (past each request's warm-up ones)."""
    if len(steps) < 3:
        return None
    return robust_fit([s["context"] for s in steps], [s["gap_ms"] for s in steps])


def rolling_median(values: list[float], width: int) -> list[float]:
    half = width // 2
    return [statistics.median(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def against_sweep(gen: Fit, sweep: Fit, lo: float, hi: float) -> dict[str, Any]:
    """How far the generation's steps rise above the prompt sweep's line over the contexts the generation ran at:
    a rise is something that accumulates while generating (the cache written token by token, the drafter's
    own state), not the context's length."""
    start, end = gen.step_ms(lo) - sweep.step_ms(lo), gen.step_ms(hi) - sweep.step_ms(hi)
    rise = end - start
    words = ("accumulates while generating" if rise > max(0.05 * sweep.step_ms(hi), 0.5) else
             "falls while generating" if rise < -max(0.05 * sweep.step_ms(hi), 0.5) else "follows the prompt sweep")
    return {"sweep_fit": asdict(sweep), "offset_start_ms": start, "offset_end_ms": end, "rise_ms": rise,
            "rise_pct": 100 * rise / sweep.step_ms(hi) if sweep.step_ms(hi) > 0 else math.nan,
            "verdict": f"step time {words}: {end:+.2f} ms against the prompt sweep's line at {hi:.0f} tokens, "
                       f"{start:+.2f} at {lo:.0f} ({rise:+.2f} ms over the generation)"}
