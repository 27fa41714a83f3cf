"""`ddscope bench trace`: long streamed generations, each chunk a step, written as results.json, report.md and
trace.png; acceptance by workload with bootstrap intervals. The stream's reading and checks are in trace.py."""
from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ddscope.bench.analyze import analyze
from ddscope.bench.fit import AnalysisError
from ddscope.bench.intervals import category_matrix
from ddscope.bench.loops import find_loop
from ddscope.bench.records import load_rows
from ddscope.bench.trace import (SCHEMA, SKIP_STEPS, VLLM_DRAFTS, StreamFailed, against_sweep, check, generation_fit,
                                 read_stream, rolling_median, steps_of)
from ddscope.util.atomic import atomic_write_text, replacing

WINDOWS = 4  # position windows of the acceptance matrix


def payload(sweep: Any, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
    """The sweep's streamed completions body, with tokens counted per chunk (logprobs) and ddscope's rounds."""
    body = {**sweep.payload("completions", prompt, max_tokens), "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": 0}
    if sweep.backend == "ddscope":
        body["return_rounds"] = True
    return body


def trace_one(sweep: Any, prompt: list[int] | str, max_tokens: int, timeout_s: float,
              alone: bool = True) -> dict[str, Any]:
    """One traced request: its steps, checks and status (`dropped` keeps the partial trace). `alone`: no other
    request in flight, so vLLM's counters around it are its own (else the group's are checked: trace_group)."""
    before = sweep.server.metrics() if sweep.backend == "vllm" and alone else None
    status, error = "complete", None
    try:
        stream = read_stream(sweep.client, sweep.url("completions"), payload(sweep, prompt, max_tokens), timeout_s)
    except StreamFailed as e:
        stream, status, error = e.partial, "dropped", str(e)
    usage = stream.body.get("usage") or {}
    prompt_tokens = int(usage.get("prompt_tokens") or (len(prompt) if isinstance(prompt, list) else 0))
    steps = steps_of(stream, prompt_tokens)
    loop = find_loop(stream.tokens) if stream.counted != "text" else None
    for s in steps:
        s["in_loop"] = loop is not None and s["position"] >= loop.start
    counters = (before, sweep.server.metrics()) if before is not None else None
    checks = check(stream, steps, sweep.backend, speculating(sweep.backend, stream.body, counters), counters)
    if status != "complete":
        checks.fail(f"the trace is partial: {error}")
    return {"status": status, "error": error, "prompt_tokens": prompt_tokens,
            "completion_tokens": usage.get("completion_tokens"), "tokens_counted_by": stream.counted,
            "approximate": checks.approximate, "reasons": checks.reasons, "checks": checks.facts,
            "tokens_sum": checks.tokens_sum, "steps": steps,
            "loop": {"from": loop.start, "period": loop.period} if loop else None}


def speculating(backend: str, body: dict[str, Any], counters: tuple[Any, Any] | None) -> bool | None:
    """Whether the server drafted for this request, where it says: ddscope's method, vLLM's draft counter, llama.cpp's
    timings.draft_n; None where it does not."""
    if backend == "ddscope":
        return (body.get("ddscope") or {}).get("method", "ddtree") != "ar"
    if backend == "vllm" and counters and all(counters):
        before, after = counters
        return sum(after.values.get(VLLM_DRAFTS, [])) > sum(before.values.get(VLLM_DRAFTS, []))
    if backend == "llamacpp" and isinstance(body.get("timings"), dict):
        return bool(body["timings"].get("draft_n"))
    return None


def run(sweep: Any, workloads: list[Any], cfg: dict[str, Any], out: Path, header: dict[str, Any],
        advance: Callable[[str], None]) -> dict[str, Any]:
    """Trace `repeats` generations per workload; results.json is rewritten after each, so a run that stops keeps
    what it traced."""
    doc = {"schema": SCHEMA, **header, "config": cfg, "requests": [], "groups": [], "status": "running"}
    for workload in workloads:
        sweep.workload = workload
        for r in range(cfg["repeats"]):
            prompt = sweep.prompt(cfg["prompt_tokens"], cfg["first_prompt"] + r)
            record = {"workload": workload.label, "repeat": r, "concurrency": 1,
                      **trace_one(sweep, prompt, cfg["max_tokens"], cfg["timeout_s"])}
            if not _keep(doc, [record], out, advance):
                return doc
        for level in [c for c in cfg.get("concurrency", [1]) if c > 1]:
            first = cfg["first_prompt"] + cfg["repeats"]  # new prompts: no stream is served from another's cache
            records, group = trace_group(sweep, [sweep.prompt(cfg["prompt_tokens"], first + k) for k in range(level)],
                                         cfg["max_tokens"], cfg["timeout_s"])
            for k, record in enumerate(records):
                record.update(workload=workload.label, repeat=k, concurrency=level)
            doc["groups"].append({"workload": workload.label, **group})
            if not _keep(doc, records, out, advance):
                return doc
    doc["status"] = "complete"
    write_json(out / "results.json", doc)
    return doc


def _keep(doc: dict[str, Any], records: list[dict[str, Any]], out: Path, advance: Callable[[str], None]) -> bool:
    """Add traced records to the document on disk; False (the document marked aborted) if one was dropped."""
    doc["requests"] += records
    write_json(out / "results.json", doc)
    for r in records:
        advance(f"{r['workload']} #{r['repeat']} (c={r['concurrency']}): {len(r['steps'])} steps"
                + (" (approximate)" if r["approximate"] else ""))
    if all(r["status"] == "complete" for r in records):
        return True
    doc["status"] = "aborted"
    write_json(out / "results.json", doc)
    return False


STEP_COUNTERS = {"ddscope": "ddscope:verify_steps_total", "vllm": VLLM_DRAFTS}
TOKEN_COUNTERS = {"ddscope": "ddscope:generation_tokens_total", "vllm": "vllm:generation_tokens_total"}


def trace_group(sweep: Any, prompts: list[Any], max_tokens: int, timeout_s: float
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`len(prompts)` streams at once, each traced as its own steps; the server's step and token counters around
    the group are checked against the streams' together (each stream's first chunk is its prefill's, no step)."""
    before = sweep.server.metrics()
    with ThreadPoolExecutor(len(prompts)) as pool:
        records = list(pool.map(lambda p: trace_one(sweep, p, max_tokens, timeout_s, alone=False), prompts))
    after = sweep.server.metrics()
    group: dict[str, Any] = {"concurrency": len(prompts), "trace_steps": sum(len(r["steps"]) for r in records),
                             "trace_tokens": sum(r["tokens_sum"] for r in records),
                             "usage_tokens": sum(r["completion_tokens"] or 0 for r in records)}
    for key, names in (("server_steps", STEP_COUNTERS), ("server_tokens", TOKEN_COUNTERS)):
        name = names.get(sweep.backend)
        if name and before is not None and after is not None and name in after.values:
            group[key] = sum(after.values[name]) - sum(before.values.get(name, []))
    reasons = []
    slack = len(prompts) if sweep.backend == "vllm" else 0  # vLLM may count a draft past max_tokens per stream
    if "server_steps" in group and abs(group["server_steps"] - group["trace_steps"]) > slack:
        reasons.append(f"the server counted {group['server_steps']:.0f} steps and the streams hold "
                       f"{group['trace_steps']}: under load their chunks are not its steps")
    if group["trace_tokens"] != group["usage_tokens"] or group.get("server_tokens", group["usage_tokens"]) != \
            group["usage_tokens"]:
        reasons.append(f"tokens: streams {group['trace_tokens']}, usage {group['usage_tokens']}, server "
                       f"{group.get('server_tokens')}")
    group.update(approximate=bool(reasons), reasons=reasons)
    return records, group


def write_json(path: Path, doc: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(doc, indent=1))


# ---- analysis of a trace ----------------------------------------------------------------------------------

def summarize(doc: dict[str, Any], against: Path | None = None, floor: Any = None) -> dict[str, Any]:
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


def _floor(spec: Any, steps: list[dict[str, Any]], lo: float, hi: float) -> dict[str, Any]:
    """The floor's line over the generation's contexts, at its tree size: --nodes, else the median the server
    reported (ddscope's rounds), else 1 (plain decoding: a lower bound for any tree)."""
    from ddscope.bench.limit.floor import floor_line

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
