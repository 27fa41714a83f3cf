"""Terminal table, sweep.png and report.md from an `Analysis`."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddscope.bench.judging.analyze import Analysis
from ddscope.bench.judging.fit import Point
from ddscope.util.atomic import atomic_write_text, replacing


def _pm(value: float | None, sd: float, digits: int) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f} ±{sd:.{digits}f}" if sd else f"{value:.{digits}f}"


def _row(a: Analysis, i: int, headers: list[str]) -> list[str]:
    p = a.points[i]
    engine = f"{p.engine_step_ms:.2f}" if p.engine_step_ms else "-"
    row = [p.label, f"{p.prompt_tokens:.0f}", _pm(p.tok_per_s, p.tok_per_s_sd, 1),
           _pm(p.avg_commit, p.avg_commit_sd, 2), _pm(p.step_ms, p.step_ms_sd, 2), engine, str(p.n)]
    if FLOOR_HEADER in headers:
        floor = a.floor_of(i)
        row.append(f"{floor['floor_ms']:.2f}" if floor else "-")
    if SERVER_HEADER in headers:
        row.append(f"{p.server_avg_commit:.2f}" if p.server_avg_commit else "-")
    if LOG_HEADER in headers:
        row.append(str(p.log_lines) if p.log_lines is not None else "-")
    return row


DECAY_NOTE = 0.1  # the terminal lists acceptance-by-position only where it moved this much
HEADERS = ["workload", "prompt_tok", "tok/s", "avg_commit", "step_ms", "engine ms", "n"]
SERVER_HEADER = "server"  # the server's own avg_commit, shown where it differs from the delivered one
FLOOR_HEADER = "floor ms"  # the step's physical floor (ddscope.bench.limit), with --hardware
LOG_HEADER = "log lines"  # shown when a server log was followed: the lines behind each avg_commit
SERVER_NOTE = ("avg_commit is delivered: the tokens returned after the first (which prefill yields) per verify "
               "step; `server` is the server's own avg_commit, which reads higher where the server counts the "
               "prefill token (SGLang's accept length) or drafts accepted past max_tokens (vLLM), and llama.cpp's "
               "counters leave out undrafted steps.")


def _differs(p: Point) -> bool:
    return bool(p.server_avg_commit and p.avg_commit and abs(p.server_avg_commit / p.avg_commit - 1) > 0.005)


def _headers(a: Analysis) -> list[str]:
    return (HEADERS + ([FLOOR_HEADER] if a.limit else [])
            + ([SERVER_HEADER] if any(_differs(p) for p in a.points) else [])
            + ([LOG_HEADER] if any(p.log_lines is not None for p in a.points) else []))


def _acceptance_lines(run: dict[str, Any], tag: str | None) -> list[str]:
    out = []
    source = run.get("acceptance_source") or {}
    if source:
        approx = " (approximate)" if source.get("approximate") else ""
        where = f" [{tag}]" if tag else ""
        out.append(f"acceptance{where}: {source['name']} [{source['kind']}]{approx}: {source['definition']}")
    return out + [f"  refused {name}: {why}" for name, why in (run.get("acceptance_refused") or {}).items()]


def _rate_line(rate: dict[str, Any], tag: str | None) -> str:
    prefill = "includes prefill" if rate.get("includes_prefill") else "decode only"
    where = f" [{tag}]" if tag else ""
    return f"tok/s{where}: {rate['basis']} ({prefill}): {rate['definition']}"


def setup_lines(meta: dict[str, Any]) -> list[str]:
    """Where acceptance (per overlaid run) and tok/s come from, why other sources were refused, the
    log totals, and a warning when the log gap is too short for the timestamps seen."""
    runs = meta.get("runs") or {None: meta}
    out = [line for tag, run in runs.items() for line in _acceptance_lines(run, tag)]
    rates = {tag: run["tok_per_s"] for tag, run in runs.items() if run.get("tok_per_s")}
    if len({json.dumps(rate, sort_keys=True) for rate in rates.values()}) > 1:
        out += [_rate_line(rate, tag) for tag, rate in rates.items()]
        out.append("  warning: the runs time tok/s differently; compare their tok/s with care")
    elif rates:
        out.append(_rate_line(next(iter(rates.values())), None))
    decoding = meta.get("backend") or {}
    if decoding.get("method"):
        budget = f", budget {decoding['budget']}" if decoding.get("budget") is not None else ""
        out.append(f"decoding: {decoding['method']}{budget}, the same at every context (as the server reported it)")
    log = meta.get("server_log") or {}
    if log:
        out.append(f"server log ({log['origin']}): {log['lines_seen']} lines, {log['lines_recognised']} with "
                   f"acceptance ({', '.join(log['formats']) or 'none'}), {log['lines_used']} used, "
                   f"{log['lines_straddling']} straddling two requests (dropped), "
                   f"{log['lines_outside_requests']} outside any request")
        if "command_exit_code" in log:
            out.append(f"  the log command exited early, with code {log['command_exit_code']}")
        if log.get("gap_s", float("inf")) <= log.get("min_gap_s", 0.0):
            out.append(f"  warning: --log-gap {log['gap_s']:g} s does not exceed the window slack plus the "
                       f"timestamps' resolution ({log['min_gap_s']:g} s): windows may touch and lines straddle; "
                       f"use a larger --log-gap")
    return out


def _decay_rows(a: Analysis) -> list[dict[str, Any]]:
    """Acceptance-by-position entries with more than one window (one window shows no trend)."""
    return [pos for pos in a.acceptance_by_position if len(pos["windows"]) > 1]


def fit_line(a: Analysis) -> str:
    if a.fit is None:
        return "no step-time fit (the baseline has no acceptance data)"
    r2 = "n/a" if a.fit.r2 is None else f"{a.fit.r2:.3f}"
    return (f"step_ms(ctx) = {a.fit.a_ms:.3f} + {a.fit.b_ms_per_token:.3g} * ctx: {a.fit.a_ms:.2f} ms plus "
            f"{a.fit.b_ms_per_token * 1000:.3f} ms per 1k tokens of context (robust fit on {a.baseline}, "
            f"{a.fit.n_points} points, R^2 = {r2})")


def category_lines(a: Analysis) -> list[str]:
    """avg_commit by workload and context, with 95% bootstrap intervals."""
    if not a.by_category:
        return []
    lines = ["| workload | prompt_tok | avg_commit | 95% interval | n |", "|---|---|---|---|---|"]
    for c in a.by_category:
        lo, hi = c["ci95"]
        lines.append(f"| {c['category']} | {c['column']} | {c['avg_commit']:.2f} | {lo:.2f}-{hi:.2f} | {c['steps']} |")
    return lines


def limit_lines(a: Analysis) -> list[str]:
    """The floor's line beside the fit, what it assumed, and the verdict against it (the levers come first)."""
    if not a.limit:
        return []
    hw, model = a.limit["assumed"]["hardware"], a.limit["assumed"]["model"]
    out = [f"floor: {model['name']} on {hw.get('gpus', 1)} x {hw['name']} ({hw['bandwidth_gbps']:g} GB/s, bf16 "
           f"{hw['tflops']['bf16']:g} TFLOPS; {a.limit['assumed']['routing'] if model['experts'] else 'dense'})"]
    line = a.limit.get("line")
    if line:
        out.append(f"floor line: {line['a_ms']:.3f} ms + {1e3 * line['b_ms_per_token']:.4f} ms per 1k tokens "
                   f"({line['nodes']:g} tokens verified a step)")
    return out + [f"- against the floor: {v}" for v in a.limit["verdict"]]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def concurrency_lines(a: Analysis) -> list[str]:
    """The concurrency axis as a markdown table: did throughput fall because of batching (per-request step
    time up), acceptance (avg_commit down), or neither (aggregate up)?"""
    if not a.by_concurrency:
        return []
    lines = ["| workload | context | concurrency | n | aggregate tok/s | per-request tok/s | avg_commit | step_ms "
             "| TTFT ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in a.by_concurrency:
        ttft = None if r["ttft_s"] is None else 1000 * r["ttft_s"]
        lines.append(f"| {r['label']} | {r['context']} | {r['concurrency']} | {r['n']} | "
                     f"{_fmt(r['aggregate_tok_per_s'], '.1f')} | {_fmt(r['tok_per_s'], '.1f')} | "
                     f"{_fmt(r['avg_commit'], '.2f')} | {_fmt(r['step_ms'], '.2f')} | {_fmt(ttft, '.0f')} |")
    return lines


def print_report(a: Analysis, console: Console, meta: dict[str, Any],
                 predictions: list[dict[str, float]] = ()) -> None:
    """The terminal table (median ±sd over repeats), the setup, the fit, verdicts and notes."""
    # Compact and unwrapped, so a row holds on one line of an 80-column terminal: one workload goes
    # into the title instead of a column.
    headers = _headers(a)
    labels = sorted({p.label for p in a.points})
    keep = [i for i, h in enumerate(headers) if not (h == "workload" and len(labels) == 1)]
    title = "ddscope bench" + (f" ({labels[0]})" if len(labels) == 1 else "") + ": tok/s = avg_commit / step_time"
    table = Table(title=Text(title), box=box.SIMPLE_HEAD, pad_edge=False)
    for i in keep:
        table.add_column(headers[i], justify="left" if headers[i] == "workload" else "right",
                         no_wrap=headers[i] != "workload")
    for n in range(len(a.points)):
        row = _row(a, n, headers)
        table.add_row(*(Text(row[i]) for i in keep))  # Text: "[old]" in a label is no markup
    console.print(table)
    if SERVER_HEADER in headers:
        console.print(SERVER_NOTE, highlight=False)
    for line in setup_lines(meta):
        console.print(line, highlight=False, markup=False)
    say = functools.partial(console.print, highlight=False, markup=False)
    say(fit_line(a))
    for line in limit_lines(a):
        say(line)
    for pred in predictions:
        say(f"- predicted at {pred['prompt_tokens']:.0f} tokens with avg_commit {pred['avg_commit']:.2f}: "
            f"{pred['tok_per_s']:.1f} tok/s (step {pred['step_ms']:.2f} ms)")
    for att in a.attributions:
        say(f"- {att.label} @ {att.prompt_tokens:.0f}: {att.verdict}")
    moved = [pos for pos in _decay_rows(a) if abs(pos["last_over_first"] - 1.0) >= DECAY_NOTE]
    for pos in moved:
        wins = pos["windows"]
        say(f"- acceptance over the generation, {pos['label']} @ {pos['context']:.0f}: "
            f"{wins[0]['avg_commit']:.2f} (tokens {wins[0]['start']}-{wins[0]['end']}) -> "
            f"{wins[-1]['avg_commit']:.2f} (tokens {wins[-1]['start']}-{wins[-1]['end']})")
    if _decay_rows(a) and not moved:
        say(f"- acceptance holds over the generation (last window within {DECAY_NOTE:.0%} of the first)")
    if a.by_category:
        say("")
        say("avg_commit by workload (95% bootstrap interval over the steps, or the requests where the server gives "
            "no per-step data):")
        for line in category_lines(a):
            say(line)
    if a.by_concurrency:
        say("")
        say("by concurrency (aggregate tok/s over each group's wall time; TTFT when streamed):")
        for line in concurrency_lines(a):
            say(line)
    for note in a.notes:
        say(f"note: {note}")
    for message, count in (meta.get("errors") or {}).items():
        console.print(f"[red]errors[/red]: {count} x {message}", highlight=False)


def plot(a: Analysis, path: Path) -> None:
    """tok/s and avg_commit against context on twin axes and step_ms against context with the fit (requests
    one after another); aggregate tok/s against concurrency, when levels above 1 were measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 * bool(a.points) + bool(a.by_concurrency)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    if a.by_concurrency:
        _concurrency_panel(axes[0][-1], a)
    if a.points:
        _context_panels(*axes[0][:2], a)
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)  # the temp name ends in .tmp, not .png
    plt.close(fig)


def _concurrency_panel(ax, a: Analysis) -> None:
    """Aggregate tok/s against concurrency, a line per workload and context."""
    lines: dict[tuple[str, Any], list[tuple[int, float]]] = {}
    for r in a.by_concurrency:
        if r["aggregate_tok_per_s"] is not None:
            lines.setdefault((r["label"], r["context"]), []).append((r["concurrency"], r["aggregate_tok_per_s"]))
    for (label, context), pts in lines.items():
        ax.plot(*zip(*pts), marker="o", label=f"{label} @ {context}")
    levels = sorted({r["concurrency"] for r in a.by_concurrency})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tok/s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title("throughput vs concurrency")


def _context_panels(left, right, a: Analysis) -> None:
    """tok/s and avg_commit against context (left), step time and its fit (right)."""
    twin = left.twinx()
    labels = sorted({p.label for p in a.points}, key=lambda lbl: (lbl != a.baseline, lbl))
    for i, label in enumerate(labels):
        pts = [p for p in a.points if p.label == label]
        x = [p.prompt_tokens for p in pts]
        color = f"C{i}"
        left.errorbar(x, [p.tok_per_s for p in pts], yerr=[p.tok_per_s_sd for p in pts], marker="o",
                      color=color, label=f"{label} tok/s")
        acc = [(p.prompt_tokens, p.avg_commit) for p in pts if p.avg_commit]
        if acc:
            twin.plot(*zip(*acc), marker="s", linestyle="--", color=color, alpha=0.7,
                      label=f"{label} avg_commit")
            steps = [(p.prompt_tokens, p.step_ms) for p in pts if p.step_ms]
            right.errorbar(*zip(*steps), yerr=[p.step_ms_sd for p in pts if p.step_ms], marker="o",
                           linestyle="none", color=color, label=f"{label} step_ms")
        engine = [(p.prompt_tokens, p.engine_step_ms) for p in pts if p.engine_step_ms]
        if engine:  # the engine's own phases: the distance to step_ms is server overhead
            right.plot(*zip(*engine), marker="x", linestyle="none", color=color, label=f"{label} engine step")
    floors = [(p.prompt_tokens, a.floor_of(i)["floor_ms"]) for i, p in enumerate(a.points) if a.floor_of(i)]
    if floors:
        floors.sort()
        right.plot(*zip(*floors), marker="v", linestyle=":", color="grey", label="physical floor")
    if a.fit is not None:
        xs = [p.prompt_tokens for p in a.points]
        lo, hi = min(xs), max(xs)
        right.plot([lo, hi], [a.fit.step_ms(lo), a.fit.step_ms(hi)], color="black", linewidth=1,
                   label=f"fit: {a.fit.a_ms:.2f} ms + {a.fit.b_ms_per_token * 1000:.3f} ms/1k tok"
                         + ("" if a.fit.r2 is None else f" (R²={a.fit.r2:.3f})"))
    left.set_xlabel("prompt tokens")
    left.set_ylabel("tok/s")
    twin.set_ylabel("avg_commit (tokens / verify step)")
    left.set_ylim(bottom=0)
    twin.set_ylim(bottom=0)
    handles = left.get_legend_handles_labels()
    twin_handles = twin.get_legend_handles_labels()
    left.legend(handles[0] + twin_handles[0], handles[1] + twin_handles[1], fontsize=8, loc="lower left")
    left.set_title("throughput and acceptance vs context")
    right.set_xlabel("prompt tokens")
    right.set_ylabel("step_ms = 1000 * avg_commit / tok/s")
    right.set_ylim(bottom=0)
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=8)
    right.set_title("verify step time vs context")


def markdown(a: Analysis, meta: dict[str, Any], plot_name: str | None) -> str:
    """report.md: setup, table, plot, fit and verdict."""
    backend = meta.get("backend") or {}
    lines = ["# ddscope bench report", ""]
    if backend:
        lines.append(f"- backend: {backend.get('name')} at {backend.get('url')}, model `{backend.get('model')}`")
    lines += [f"- {line.strip()}" for line in setup_lines(meta)]
    if meta.get("status"):
        reason = f" ({meta['abort_reason']})" if meta.get("abort_reason") else ""
        lines.append(f"- status: {meta['status']}{reason}")
    headers = _headers(a)
    lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_row(a, i, headers)) + " |" for i in range(len(a.points))]
    lines += ["", "Values are medians over repeats, ± the standard deviation."]
    if SERVER_HEADER in headers:
        lines += ["", SERVER_NOTE]
    if a.by_category:
        lines += ["", "## Acceptance by workload", "", *category_lines(a)]
    if a.by_concurrency:
        lines += ["", "## By concurrency", "", *concurrency_lines(a)]
    if plot_name:
        lines += ["", f"![sweep]({plot_name})"]
    lines += ["", "## Fit", "", fit_line(a), ""]
    if a.limit:
        lines += ["## Against the physical floor", "", *limit_lines(a), "", *_lever_table(a), ""]
    lines += ["## Verdict", ""]
    lines += [f"- **{att.label} @ {att.prompt_tokens:.0f}**: {att.verdict}" for att in a.attributions] or \
        ["- nothing to compare (one point, or no acceptance data)"]
    if _decay_rows(a):
        lines += ["", "## Acceptance over the generation", "",
                  "| workload | context | first window | last window | last/first |", "|---|---|---|---|---|"]
        for pos in _decay_rows(a):
            first, last = pos["windows"][0], pos["windows"][-1]
            lines.append(f"| {pos['label']} | {pos['context']:.0f} | {first['avg_commit']:.2f} "
                         f"({first['start']}-{first['end']}) | {last['avg_commit']:.2f} "
                         f"({last['start']}-{last['end']}) | {pos['last_over_first']:.2f} |")
    errors = meta.get("errors") or {}
    if errors or a.notes:
        lines += ["", "## Notes", ""]
        lines += [f"- error, {count} request(s): {msg}" for msg, count in errors.items()]
        lines += [f"- {note}" for note in a.notes]
    return "\n".join(lines) + "\n"


def _lever_table(a: Analysis) -> list[str]:
    levers = (a.limit or {}).get("levers") or []
    if not levers:
        return []
    rows = ["| workload | prompt_tok | lever | tok/s | tok/s if | gain |", "|---|---|---|---|---|---|"]
    rows += [f"| {lv['label']} | {lv['prompt_tokens']:.0f} | {lv['lever']}: {lv['what']} | {lv['tok_per_s']:.1f} | "
             f"{lv['tok_per_s_if']:.1f} | x{lv['gain']:.2f} |" for lv in levers]
    return rows


def write_outputs(a: Analysis, meta: dict[str, Any], out_dir: Path) -> None:
    """sweep.png and report.md next to results.json."""
    has_points = bool(a.points or a.by_concurrency)
    if has_points:
        plot(a, out_dir / "sweep.png")
    atomic_write_text(out_dir / "report.md", markdown(a, meta, "sweep.png" if has_points else None))
