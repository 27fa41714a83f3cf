"""The trace run: long streamed generations (ignore_eos), each read as steps (`collecting/stream_steps.py`), alone
and N at a time, with results.json rewritten after each so a run that stops keeps what it traced. The trace's
report is `judging/trace_report.py`."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ddscope.bench.collecting.stream_steps import SCHEMA, VLLM_DRAFTS, StreamFailed, check, read_stream, steps_of
from ddscope.bench.running.loops import find_loop
from ddscope.util.atomic import atomic_write_text


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
