"""An AIPerf 0.13 run as bench records: users who ran `aiperf profile` at a few prompt lengths have every number the
decomposition needs, per request, in `profile_export.jsonl` (`--export-level records`).

A line is {"metadata", "metrics": {tag: {"value", "unit"}}, "spec_decode_acceptance", "error"}
(aiperf/common/models/record_models.py:1714-1742, post_processors/record_export_jsonl_writer.py:66-93). The
acceptance record is AIPerf's reading of vLLM's `metrics.speculative_decoding` (aiperf/spec_decode/vllm_adapter.py),
or of ddscope's, which has the same shape. Acceptance is never guessed: a run without it reads the server's own
counters where AIPerf scraped them (SERVER_METRICS, on by default in 0.13: aiperf/server_metrics/json_exporter.py,
deltas over the profiling phase only), else gives tok/s only.
"""
from __future__ import annotations

import json
from pathlib import Path
from statistics import median
from typing import Any

from ddscope.bench.collecting.backends import cut_commits
from ddscope.bench.errors import AnalysisError

EXPORT = "profile_export.jsonl"
SERVER_METRICS = "server_metrics_export.json"
# Prometheus family names, as AIPerf keys them (a counter without `_total`); ddscope serves them too.
DRAFTS, TOKENS, DECODE = "vllm:spec_decode_num_drafts", "vllm:generation_tokens", "vllm:request_decode_time_seconds"
TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}


class AIPerfError(AnalysisError):
    """An AIPerf export that cannot be read, saying why."""


def export_file(path: Path) -> Path | None:
    """The profile_export.jsonl of an artifact folder (searched below it) or the file itself; None if not AIPerf's."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.rglob(EXPORT))
        return found[0] if found else None
    return path if path.is_file() and path.name.endswith(".jsonl") and _looks_like(path) else None


def _looks_like(path: Path) -> bool:
    with path.open() as f:
        first = next((line for line in f if line.strip()), "")
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and {"metadata", "metrics"} <= set(row)


def _value(metrics: dict[str, Any], tag: str, ms: bool = False) -> Any:
    entry = metrics.get(tag)
    if not isinstance(entry, dict) or entry.get("value") is None:
        return None
    value, unit = entry["value"], str(entry.get("unit", "ms"))
    if not ms:
        return value
    scale = TO_MS.get(unit)
    if scale is None:
        raise AIPerfError(f"{tag}: unit {unit!r} is not a time unit this reader knows ({', '.join(TO_MS)})")
    return [v * scale for v in value] if isinstance(value, list) else value * scale


def record(row: dict[str, Any]) -> dict[str, Any] | None:
    """One request as a bench record (None for a failed one): usage tokens, the decode rate from TTFT and latency,
    delivered avg_commit over the spec steps, the per-step commits (detailed), and the streamed chunk gaps."""
    m = row.get("metrics") or {}
    prompt = _value(m, "usage_prompt_tokens") or _value(m, "input_sequence_length")
    completion = _value(m, "usage_completion_tokens") or _value(m, "output_sequence_length")
    ttft, latency = _value(m, "time_to_first_token", ms=True), _value(m, "request_latency", ms=True)
    if row.get("error") or not prompt or not completion or not latency:
        return None
    decode_ms = latency - (ttft or 0.0)
    decode = ttft is not None and completion > 1 and decode_ms > 0
    out = {"prompt_tokens": float(prompt), "completion_tokens": int(completion),
           "tok_per_s": (completion - 1) / decode_ms * 1e3 if decode else completion / latency * 1e3,
           "tok_per_s_basis": "client_minus_prefill" if decode else "client_latency",
           "e2e_tok_per_s": completion / latency * 1e3, "ttft_s": ttft / 1e3 if ttft is not None else None,
           "chunk_gaps_ms": _value(m, "inter_chunk_latency", ms=True), "avg_commit": None, "server_avg_commit": None,
           "commits": None, "verify_steps": None}
    spec = row.get("spec_decode_acceptance") or {}
    steps = spec.get("num_spec_steps") or _value(m, "spec_decode_steps")
    accepted = spec.get("num_accepted_draft_tokens", _value(m, "spec_decode_accepted_draft_tokens"))
    if steps:
        out.update(avg_commit=(completion - 1) / steps, server_avg_commit=1 + (accepted or 0) / steps,
                   verify_steps=steps)
        if spec.get("per_step_accepted"):
            out["commits"] = cut_commits([a + 1 for a in spec["per_step_accepted"]], completion - 1)
    return out


def server_counted(path: Path, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where the run has no per-request spec records but AIPerf scraped the server's counters: the run's avg_commit
    (its tokens after each request's first over its verify steps) and step time (its decode time over its steps),
    put on every row, so the point is the run's as the server counts it; the acceptance source it names, or None."""
    try:
        metrics = json.loads(path.read_text())["metrics"]
        drafts, tokens = (sum(s["stats"]["total"] for s in metrics[k]["series"]) for k in (DRAFTS, TOKENS))
        decode = metrics[DECODE]["series"]
        decode_s, finished = sum(s["stats"]["sum"] for s in decode), sum(s["stats"]["count"] for s in decode)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not drafts or not finished or tokens <= finished:
        return None
    commit, step_ms = (tokens - finished) / drafts, 1e3 * decode_s / drafts
    for r in rows:
        r.update(avg_commit=commit, server_avg_commit=commit, tok_per_s=1e3 * commit / step_ms,
                 tok_per_s_basis="server_decode", verify_steps=(r["completion_tokens"] - 1) / commit)
    return {"name": "aiperf.server_metrics", "kind": "server_counters", "approximate": False,
            "definition": f"the run's ({tokens:.0f} generation tokens - {finished:.0f} requests) / {drafts:.0f} "
                          f"{DRAFTS} and {decode_s:.3f} s of {DECODE} / the same steps, over AIPerf's profiling phase "
                          f"({path.name})"}


def load(path: Path, label: str = "aiperf") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows for analyze from one AIPerf run (one prompt length): each request a record of the run's context (the
    median prompt length), and the run's setup as a results.json header has it."""
    file = export_file(path)
    if file is None:
        raise AIPerfError(f"{path}: no AIPerf {EXPORT} (run aiperf profile with --export-level records)")
    rows, failed = [], 0
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            got = record(json.loads(line))
        except (ValueError, TypeError) as e:
            raise AIPerfError(f"{file}:{n}: {e}") from e
        if got is None:
            failed += 1
        else:
            rows.append(got)
    if not rows:
        raise AIPerfError(f"{file}: no request succeeded ({failed} failed)")
    counted = None if any(r["avg_commit"] for r in rows) else server_counted(file.parent / SERVER_METRICS, rows)
    context = round(median(r["prompt_tokens"] for r in rows))
    for r in rows:
        r.update(label=label, context=context, concurrency=1)
    spec = any(r["avg_commit"] for r in rows)
    whole = any(r["tok_per_s_basis"] == "client_latency" for r in rows)  # a request without TTFT (not streamed)
    meta = {"config": {"workload": label}, "backend": {"name": "aiperf", "url": str(file)},
            "acceptance_source": {"name": "aiperf.spec_decode_acceptance", "kind": "per_request", "approximate": False,
                                  "definition": "(usage completion_tokens - 1) / the request's spec-decode steps, "
                                                "from the server's per-request record as AIPerf exported it"}
            if spec else counted or {},
            "acceptance_refused": {} if spec or counted else {
                "aiperf": "the run has no per-request spec-decode records (the server gave no per-request metrics, "
                          "e.g. vLLM without --per-request-spec-decode-metrics): tok/s only, acceptance not guessed"},
            "tok_per_s": {"basis": "server_decode", "includes_prefill": False,
                          "definition": "the server's decode time over its verify steps, from its counters as AIPerf "
                                        "scraped them"} if counted else
                         {"basis": "client_latency", "includes_prefill": True,
                          "definition": "completion_tokens / AIPerf's request_latency (some requests have no time to "
                                        "first token: the run was not streamed)"} if whole else
                         {"basis": "client_minus_prefill", "includes_prefill": False,
                          "definition": "(completion_tokens - 1) / (AIPerf's request_latency - time_to_first_token)"},
            "errors": {"the request failed in AIPerf's record": failed} if failed else {}}
    return rows, meta


def as_trace(path: Path) -> dict[str, Any]:
    """A streamed AIPerf run as a `bench trace` document: each request's chunk gaps (`inter_chunk_latency`, one per
    chunk after the first) as its steps' times and, where the record is detailed, `per_step_accepted` + 1 as their
    commits. A chunk is a step only where their counts agree; otherwise the request is marked approximate."""
    from ddscope.bench.collecting.stream_steps import SCHEMA

    file = export_file(path)
    if file is None:
        raise AIPerfError(f"{path}: no AIPerf {EXPORT}")
    requests = []
    for i, line in enumerate(line for line in file.read_text().splitlines() if line.strip()):
        try:
            got = record(json.loads(line))
        except (ValueError, TypeError) as e:
            raise AIPerfError(f"{file}: record {i + 1}: {e}") from e
        if got is None:
            continue
        gaps, commits = got["chunk_gaps_ms"] or [], got["commits"]
        reasons = []
        if not gaps:
            reasons.append("the run was not streamed: no inter_chunk_latency")
        if commits is None:
            reasons.append("no per-step record (the server's per-request metrics at `detailed`): commits unknown")
        elif len(commits) != len(gaps):
            reasons.append(f"{len(gaps)} chunks after the first against {len(commits)} steps: chunks are not steps")
        known = commits is not None and len(commits) == len(gaps)  # else each step's commit is unknown: None
        steps, position = [], 1
        for k, gap in enumerate(gaps):
            commit = commits[k] if known else None
            steps.append({"position": position, "context": got["prompt_tokens"] + position, "commit": commit,
                          "gap_ms": gap})
            position += commit or 1  # unknown commits: positions count chunks
        requests.append({"workload": "aiperf", "repeat": i, "status": "complete", "error": None,
                         "prompt_tokens": got["prompt_tokens"], "completion_tokens": got["completion_tokens"],
                         "tokens_counted_by": "aiperf per_step_accepted", "approximate": bool(reasons),
                         "reasons": reasons, "checks": {}, "tokens_sum": 1 + sum(s["commit"] or 0 for s in steps),
                         "steps": steps})
    if not requests:
        raise AIPerfError(f"{file}: no request succeeded")
    prompt = round(median(r["prompt_tokens"] for r in requests))
    return {"schema": SCHEMA, "backend": {"name": "aiperf", "url": str(file)}, "status": "complete",
            "config": {"prompt_tokens": prompt, "max_tokens": max(r["completion_tokens"] for r in requests),
                       "repeats": len(requests), "workloads": ["aiperf"], "floor": None},
            "requests": requests}
