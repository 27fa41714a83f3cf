"""Results files judged: read side by side (each tagged by its folder, AIPerf runs at several prompt lengths merged
into one sweep, refused unless like for like, overlaid where they share a workload), analysed, set against the
physical floor, printed and written as sweep.png and report.md; a trace goes to its own report.

Like for like: the run settings (max_tokens, workload, temperature, method, backend, model) in which runs compared
side by side differ, each of which moves tok/s or acceptance by itself."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddscope.bench.collecting.aiperf import as_trace
from ddscope.bench.collecting.results import load_rows, parse_point, parse_prediction, trace_doc
from ddscope.bench.errors import BenchError, NothingMeasured, warn
from ddscope.bench.judging.analyze import analyze
from ddscope.bench.judging.fit import sweep_matrix
from ddscope.bench.judging.floor_verdict import against_floor
from ddscope.bench.judging.sweep_report import print_report, write_outputs
from ddscope.bench.judging.trace_report import report_trace
from ddscope.bench.limit import ConfigError, FloorError, HardwareError
from ddscope.bench.limit.cli import FloorArgsError, FloorRequest, floor_spec, kept_floor
from ddscope.util.options import stdout_console

Loaded = list[tuple[list[dict[str, Any]], dict[str, Any]]]  # per file: (rows, load_rows metadata)

def analyze_files(files: list[Path], out: Path | None, baseline: str | None, window: int, as_json: bool,
                  points: list[str], predict: list[str], allow_mismatch: bool, floor: FloorRequest | None,
                  as_aiperf_trace: bool) -> int:
    """`bench analyze`: one trace (or an AIPerf run read as one), set against at most one prompt sweep; else
    results files and --point rows, side by side."""
    if not files and not points:
        raise BenchError("give at least one FILE or --point")
    if as_aiperf_trace:  # an AIPerf run's chunks as a trace
        if len(files) != 1:
            raise BenchError("--as-trace reads one AIPerf run")
        return judge_trace(as_trace(files[0]), out, None, floor, as_json)
    traces = [(path, doc) for path in files if (doc := trace_doc(path)) is not None]
    if traces:  # a trace, set against the prompt sweep given beside it
        sweeps = [path for path in files if path not in dict(traces)]
        if len(traces) > 1 or len(sweeps) > 1 or points:
            raise BenchError("analyze takes one trace, and at most one prompt sweep's results.json to set it against")
        return judge_trace(traces[0][1], out, sweeps[0] if sweeps else None, floor, as_json)
    return judge_files(files, out, baseline, window, as_json, points, predict, allow_mismatch, floor)


def judge_trace(doc: dict[str, Any], out: Path | None, against: Path | None, floor: FloorRequest | None,
                as_json: bool) -> int:
    """A trace's report, beside its physical floor where floor options are given or kept in the trace."""
    floor = floor or kept_floor(doc)
    return report_trace(doc, out, against, floor_spec(floor, doc.get("backend")) if floor else None, as_json)


def judge_files(paths: list[Path], out: Path | None, baseline: str | None, window: int, as_json: bool,
                points: list[str] = (), predict: list[str] = (), allow_mismatch: bool = False,
                floor: FloorRequest | None = None) -> int:
    """Analyse results files (plus --point rows), print, and write outputs to `out`; with floor options (given,
    or kept in the first results file), each point beside its physical floor."""
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    errors: dict[str, int] = {}
    loaded, tags = merge_aiperf([load_rows(path) for path in paths], tags_of(paths))
    notes = like_for_like(loaded, tags, allow_mismatch)
    if overlaid(loaded):
        baseline, meta["runs"] = overlay(loaded, tags, baseline)
    for file_rows, file_meta in loaded:
        rows += file_rows
        for msg, count in (file_meta.pop("errors", None) or {}).items():
            errors[msg] = errors.get(msg, 0) + count
        for key, value in file_meta.items():  # the first file (the baseline's) describes the setup
            meta.setdefault(key, value)
    meta["errors"] = errors
    rows += [parse_point(spec, i) for i, spec in enumerate(points, 1)]
    if not rows:
        details = "; ".join(f"{n} x {msg}" for msg, n in errors.items())
        raise NothingMeasured("no point could be measured" + (f": {details}" if details else ""))
    analysis = analyze(rows, baseline=baseline, window=window)
    analysis.notes[:0] = notes
    analysis.by_category = sweep_matrix(rows)
    kept = floor is None
    floor = floor or kept_floor(meta)
    if floor is not None:
        try:
            analysis.limit = against_floor(analysis, floor_spec(floor, meta.get("backend")))
        except (ConfigError, FloorError, HardwareError, FloorArgsError) as e:
            if not kept:
                raise
            analysis.notes.append(f"the run's floor options cannot be used here, so no floor: {e}")
    predictions = [analysis.predict(*parse_prediction(spec)) for spec in predict]
    if as_json:
        print(json.dumps(analysis.to_dict(predictions), indent=1))
    else:
        print_report(analysis, stdout_console(), meta, predictions)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_outputs(analysis, meta, out)
    return 0


# ---- runs side by side ------------------------------------------------------------------------------------------

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


def merge_aiperf(loaded: Loaded,
                  tags: list[str]) -> tuple[Loaded, list[str]]:
    """AIPerf runs, one per prompt length, as one sweep: their rows together under the first one's setup."""
    runs = [i for i, (_, meta) in enumerate(loaded) if (meta.get("backend") or {}).get("name") == "aiperf"]
    if len(runs) < 2:
        return loaded, tags
    rows = [row for i in runs for row in loaded[i][0]]
    errors: dict[str, int] = {}
    for i in runs:
        for msg, n in (loaded[i][1].get("errors") or {}).items():
            errors[msg] = errors.get(msg, 0) + n
    merged = (rows, {**loaded[runs[0]][1], "errors": errors})
    keep = [i for i in range(len(loaded)) if i not in runs[1:]]
    return [merged if i == runs[0] else loaded[i] for i in keep], ["aiperf" if i == runs[0] else tags[i] for i in keep]


def like_for_like(loaded: Loaded, tags: list[str],
                   allow_mismatch: bool) -> list[str]:
    """Refuse files whose runs differ in a setting that moves tok/s or acceptance by itself, unless allowed
    (then a warning, kept as the report's first note); and notes on the settings a file does not record."""
    if len(loaded) < 2:
        return []
    differ, unknown = run_differences([(tag, meta, {row["label"] for row in rows})
                                       for (rows, meta), tag in zip(loaded, tags)])
    if not differ:
        return unknown
    what = f"runs differ in {', '.join(differ)}"
    if not allow_mismatch:
        raise BenchError(f"{what}: {' and '.join(tags)} are not like for like (--allow-mismatch compares them "
                         f"anyway)")
    warning = f"{what}: compared anyway (--allow-mismatch), so a gap between them is not like for like"
    warn(warning)
    return [f"WARNING: {warning}", *unknown]


def overlaid(loaded: Loaded) -> bool:
    """Several files that share a workload label: runs to overlay (e.g. old and new drafter)."""
    seen: set[str] = set()
    for rows, _ in loaded:
        labels = {r["label"] for r in rows}
        if labels & seen:
            return True
        seen |= labels
    return False


def overlay(loaded: Loaded, tags: list[str],
             baseline: str | None) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """Label each file's rows `label [tag]`; returns the baseline as a tagged label (default: the
    first file's first curve) and each file's acceptance and tok/s setup by tag."""
    for (rows, _), tag in zip(loaded, tags):
        for row in rows:
            row["label"] = f"{row['label']} [{tag}]"
    labels = {row["label"] for rows, _ in loaded for row in rows}
    if baseline is None:
        baseline = next((row["label"] for row in loaded[0][0]), None)
    elif baseline not in labels:  # untagged ("padding"): the first file's curve of that name
        baseline = next((f"{baseline} [{t}]" for t in tags if f"{baseline} [{t}]" in labels), baseline)
    runs = {tag: {k: meta.get(k) for k in ("acceptance_source", "acceptance_refused", "tok_per_s")}
            for (_, meta), tag in zip(loaded, tags)}
    return baseline, runs


def tags_of(paths: list[Path]) -> list[str]:
    """A short distinct name per file: its folder (old/results.json -> old), else its path."""
    names = [p.resolve().parent.name or p.stem for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]
