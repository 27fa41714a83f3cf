"""Measured results read back, as an analysis reads them: rows from a sweep's results.json, an AIPerf run or a CSV;
a trace's results.json whole; and points or predictions given on the command line."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from ddscope.bench.collecting import aiperf
from ddscope.bench.collecting.stream_steps import SCHEMA as TRACE_SCHEMA
from ddscope.bench.errors import AnalysisError


def as_number(value: Any, what: str, where: str) -> float | None:
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
                "e2e_tok_per_s", "aggregate_tok_per_s", "ttft_s", "nodes_per_step", "grammar_ms"):
        row[key] = as_number(raw.get(key), key, where)
    row["concurrency"] = int(as_number(raw.get("concurrency"), "concurrency", where) or 1)
    if not row["prompt_tokens"] or not row["tok_per_s"]:
        raise AnalysisError(f"{where}: prompt_tokens and tok_per_s must both be > 0")
    if row["context"] in (None, ""):
        row["context"] = row["prompt_tokens"]
    row["commits"] = raw.get("commits")
    row["completion_tokens"] = as_number(raw.get("completion_tokens"), "completion_tokens", where)
    row["verify_steps"] = as_number(raw.get("verify_steps"), "verify_steps", where)
    for key in ("loop_from", "loop_period", "avg_commit_in_loop", "avg_commit_before_loop"):
        row[key] = as_number(raw.get(key), key, where)
    row["loop_unit"] = raw.get("loop_unit")
    row["prompt_sha1"] = raw.get("prompt_sha1")  # None (AIPerf): unknown, taken as a prompt of its own
    return row


def load_rows(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Measured rows and metadata from a results.json, an AIPerf run (its artifact folder or profile_export.jsonl),
    or a CSV with columns prompt_tokens,tok_per_s,avg_commit[,label]."""
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
    ctx, commit = (as_number(v, name, f"--predict {spec}") for v, name in zip(parts, ("context", "avg_commit")))
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


def trace_doc(path: Path) -> dict[str, Any] | None:
    """A `bench trace` results.json, else None."""
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == TRACE_SCHEMA else None
