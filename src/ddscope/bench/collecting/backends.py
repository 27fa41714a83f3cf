"""Which server is at the URL, and how to read acceptance from its responses and counters.

Support is detected from what comes back, never from HTTP errors: SGLang and vLLM ignore request
fields they do not know, so a field the response does not answer is a feature the server lacks.
See docs/bench.md for the per-engine references.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ddscope.bench.collecting.acceptance_sources import SOURCES, Acceptance

BACKENDS = ("ddscope", "sglang", "vllm", "llamacpp", "openai")
Metrics = dict[str, list[float]]  # sample name -> values over label sets
Reading = Acceptance | str  # an acceptance, or why the source gives none


def num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ---- per request ---------------------------------------------------------------------------------
# A reader gives (the server's own avg_commit, the verify steps behind the tokens after the first).
# The bench's primary number is the delivered avg_commit, (completion_tokens - 1) / those steps: the
# first token comes from prefill, and a server may count drafts accepted past max_tokens (vLLM).

Steps = tuple[float, float] | None


def _per_step(tokens: float | None, steps: float | None) -> Steps:
    return (tokens / steps, steps) if tokens and steps else None


def _choice(body: dict[str, Any]) -> dict[str, Any]:
    choices = body.get("choices")
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}


def text_digest(body: dict[str, Any]) -> str | None:
    """sha1 of the completion's text (completions or chat shape): equal outputs across servers, at a glance."""
    choice = _choice(body)
    text = choice.get("text", (choice.get("message") or {}).get("content"))
    return hashlib.sha1(text.encode()).hexdigest()[:16] if isinstance(text, str) else None


def _ddscope(body: dict[str, Any], _: int) -> Steps:
    ext = body.get("ddscope") or {}
    avg, steps = num(ext.get("avg_commit")), num(ext.get("verify_steps"))
    return (avg, steps) if avg and steps else None


def _vllm(body: dict[str, Any], _: int) -> Steps:
    spec = (body.get("metrics") or {}).get("speculative_decoding") or {}
    avg, steps = num(spec.get("mean_acceptance_length")), num(spec.get("num_spec_steps"))
    return (avg, steps) if avg and steps else None


def _llamacpp_steps(completion: int, accepted: float) -> float | None:
    # llama.cpp's output is 1 prefill token + (accepted + 1) per drafted step + 1 per undrafted step
    # (drafts are capped at the tokens left), so the steps behind the rest are completion - 1 - accepted.
    steps = completion - 1 - accepted
    return steps if steps > 0 else None


def _llamacpp_timings(body: dict[str, Any], completion: int) -> Steps:
    t = body.get("timings") or {}
    predicted, accepted = num(t.get("predicted_n")), num(t.get("draft_n_accepted"))
    if t.get("draft_n") is None or predicted is None or accepted is None:  # no drafting on this request
        return None
    steps = _llamacpp_steps(completion, accepted)
    return (predicted / (predicted - accepted), steps) if steps and predicted > accepted else None


# source -> (what the response must carry, reader(body, completion_tokens) -> (server avg_commit, steps))
PER_REQUEST: dict[str, tuple[str, Callable[[dict[str, Any], int], Steps]]] = {
    "ddscope.response": ("ddscope.avg_commit", _ddscope),
    "sglang.sglext": ("sglext.spec_tokens_details.spec_verify_ct", lambda b, n: _per_step(
        n, num(((b.get("sglext") or {}).get("spec_tokens_details") or {}).get("spec_verify_ct")))),
    "sglang.meta_info": ("choices[0].meta_info.spec_verify_ct", lambda b, n: _per_step(
        n, num((_choice(b).get("meta_info") or {}).get("spec_verify_ct")))),
    "sglang.generate": ("meta_info.spec_verify_ct", lambda b, n: _per_step(
        n, num((b.get("meta_info") or {}).get("spec_verify_ct")))),
    "vllm.response": ("metrics.speculative_decoding", _vllm),
    "llamacpp.timings": ("timings.draft_n_accepted", _llamacpp_timings),
}


def per_request(name: str, body: dict[str, Any], completion_tokens: int) -> Reading:
    what, reader = PER_REQUEST[name]
    got = reader(body, completion_tokens)
    return Acceptance(got[0], got[1], SOURCES[name]) if got else f"the response has no {what}"


def delivered(acc: Acceptance, completion_tokens: int) -> float | None:
    """Tokens returned after the first, per verify step; None where the source counts no steps."""
    if not acc.verify_steps or completion_tokens < 2:
        return None
    return (completion_tokens - 1) / acc.verify_steps


# ---- counters ------------------------------------------------------------------------------------

@dataclass
class Scrape:
    """One /metrics read: summed values per sample name, and the names printed `%g`-rounded."""
    values: Metrics
    rounded: set[str] = field(default_factory=set)


# Samples printed in exponent form with at most 6 significant digits. From llama.cpp (a double through
# a C++ stream, `%g`) that is every value >= 1e6, rounded: 1234567 -> 1.23457e+06. prometheus_client
# (vLLM, SGLang, ddscope) prints full precision (1.234567e+06), where this form means trailing zeros.
_ROUNDED = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+[-+]?\d(?:\.\d{1,5})?[eE]\+\d+\s*$", re.M)


def parse_metrics(text: str) -> Scrape:
    """Prometheus text -> values per sample name (`_created` samples dropped) and rounded names."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out.setdefault(sample.name, []).append(float(sample.value))
    return Scrape(out, {m.group(1) for m in _ROUNDED.finditer(text)})


def _bonus(accepted: float, drafts: float, _: int) -> Steps:
    return (1.0 + accepted / drafts, drafts) if drafts else None


def _llamacpp_bonus(accepted: float, drafts: float, completion: int) -> Steps:
    steps = _llamacpp_steps(completion, accepted)
    return (1.0 + accepted / drafts, steps) if drafts and steps else None


def _legacy(predicted: float, accepted: float, completion: int) -> Steps:
    # Older llama.cpp counts drafted/accepted tokens only; its own figure is predicted / (predicted - accepted).
    steps = _llamacpp_steps(completion, accepted)
    return (predicted / (predicted - accepted), steps) if steps and predicted > accepted else None


# source -> (counter names, rule(delta of each, completion_tokens) -> (server avg_commit, steps))
COUNTERS: dict[str, tuple[tuple[str, str], Callable[[float, float, int], Steps]]] = {
    "ddscope.counters": (("ddscope:committed_tokens_total", "ddscope:verify_steps_total"),
                         lambda tokens, steps, _: _per_step(tokens, steps)),
    # source: sglang/srt/observability/metrics_collector.py:1861,1866
    "sglang.counters": (("sglang:generation_tokens_total", "sglang:spec_verify_calls_total"),
                        lambda tokens, steps, _: _per_step(tokens, steps)),
    "vllm.counters": (("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total"), _bonus),
    # source: llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/server-task.cpp:1558,1562 (drafts = verify steps)
    "llamacpp.counters": (("llamacpp:spec_decode_num_accepted_tokens_total",
                           "llamacpp:spec_decode_num_drafts_total"), _llamacpp_bonus),
    "llamacpp.legacy_counters": (("llamacpp:tokens_predicted_total", "llamacpp:tokens_drafted_accepted_total"),
                                 _legacy),
}


PRINTF_G = {"llamacpp.counters", "llamacpp.legacy_counters"}  # sources whose server prints `%g`


def counter_delta(name: str, before: Scrape | None, after: Scrape | None, completion_tokens: int) -> Reading:
    if before is None or after is None:
        return "no readable /metrics"
    metrics, rule = COUNTERS[name]
    for metric in metrics:
        if metric not in before.values or metric not in after.values:
            return f"/metrics has no {metric}"
        if name in PRINTF_G and (metric in before.rounded or metric in after.rounded):
            return (f"{metric} is printed %g-rounded to 6 significant digits (e.g. 1.23457e+06): deltas "
                    f"would be off by tens of tokens")
    got = rule(*(sum(after.values[m]) - sum(before.values[m]) for m in metrics), completion_tokens)
    return Acceptance(got[0], got[1], SOURCES[name]) if got else f"{metrics[1]} did not move over the request"


# ---- timing --------------------------------------------------------------------------------------

def server_prefill_s(backend: str, body: dict[str, Any]) -> float | None:
    """Prefill time the server reports, so decode tok/s can exclude it."""
    if backend == "ddscope":
        ms = num((body.get("ddscope") or {}).get("prefill_ms"))
    elif backend == "llamacpp":
        ms = num((body.get("timings") or {}).get("prompt_ms"))
    else:
        ms = None
    return ms / 1000.0 if ms is not None else None


def server_decode(backend: str, body: dict[str, Any], completion_tokens: int) -> tuple[int, float] | None:
    """(tokens, seconds) of the decode phase alone, first to last output token, where the server
    times it per request; the first token belongs to prefill."""
    if backend == "vllm":  # --enable-per-request-metrics; vllm/entrypoints/generate/base/serving.py:76
        seconds = num((body.get("metrics") or {}).get("generation_time_ms"))
        seconds = seconds / 1000.0 if seconds is not None else None
    elif backend == "sglang":  # /generate with --enable-metrics; sglang/srt/observability/req_time_stats.py:516
        meta = body.get("meta_info") or {}
        e2e, first = num(meta.get("e2e_latency")), num(meta.get("first_token_latency"))
        seconds = e2e - first if e2e is not None and first is not None else None
    else:
        seconds = None
    return (completion_tokens - 1, seconds) if seconds and completion_tokens > 1 else None


def constraint_fields(backend: str, route: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema in the server's own request field: vLLM's `structured_outputs` (ddscope's too); SGLang's
    `json_schema` string on /v1/completions and /generate (sglang/srt/entrypoints/openai/protocol.py:400,
    srt/sampling/sampling_params.py:169 in 0.5.23), its `response_format` on chat (protocol.py:1238-1249);
    llama-server's `json_schema`; OpenAI's `response_format` elsewhere."""
    if backend in ("ddscope", "vllm"):
        return {"structured_outputs": {"json": schema}}
    if backend == "sglang" and route != "chat":
        return {"json_schema": json.dumps(schema)}
    if backend == "llamacpp":
        return {"json_schema": schema}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "records", "schema": schema}}}


def grammar_ms(backend: str, body: dict[str, Any]) -> float | None:
    """The grammar's time a verify step, where the server reports it (ddscope)."""
    ext = (body.get("ddscope") or {}) if backend == "ddscope" else {}
    steps, ms = num(ext.get("verify_steps")), num(ext.get("grammar_ms"))
    return ms / steps if steps and ms is not None else None


def engine_step_ms(backend: str, body: dict[str, Any]) -> float | None:
    """The engine's own mean verify-step time, where it reports one (ddscope)."""
    return num((body.get("ddscope") or {}).get("mean_step_ms")) if backend == "ddscope" else None


def nodes_per_step(backend: str, body: dict[str, Any]) -> float | None:
    """Tokens the target verified per step, root included: ddscope's tree nodes, vLLM's drafts (detailed or
    summary per-request metrics); None where the server does not say."""
    if backend == "ddscope":
        ext = body.get("ddscope") or {}
        steps, nodes = num(ext.get("verify_steps")), num(ext.get("nodes_verified"))
    elif backend == "vllm":
        spec = (body.get("metrics") or {}).get("speculative_decoding") or {}
        steps, nodes = num(spec.get("num_spec_steps")), num(spec.get("num_draft_tokens"))
    else:
        return None
    return 1.0 + nodes / steps if steps and nodes is not None else None


def decoding_method(backend: str, body: dict[str, Any]) -> dict[str, Any]:
    """The decoding method and budget the server ran a request with, where it says (ddscope); else None."""
    ext = (body.get("ddscope") or {}) if backend == "ddscope" else {}
    return {"method": ext.get("method"), "budget": ext.get("budget")}


def step_commits(backend: str, body: dict[str, Any], completion_tokens: int) -> list[int] | None:
    """Tokens delivered at each verify step, in order, where the server reports per-step data: they
    sum to completion_tokens - 1 (a server's last steps may count drafts cut at max_tokens)."""
    commits = None
    if backend == "ddscope":
        rounds = (body.get("ddscope") or {}).get("rounds")
        commits = [int(r["committed"]) for r in rounds] if isinstance(rounds, list) and rounds else None
    elif backend == "vllm":  # --per-request-spec-decode-metrics detailed; +1 for the bonus token
        accepted = ((body.get("metrics") or {}).get("speculative_decoding") or {}).get("per_step_accepted")
        commits = [int(a) + 1 for a in accepted] if isinstance(accepted, list) and accepted else None
    return cut_commits(commits, completion_tokens - 1) if commits else None


def cut_commits(commits: list[int], total: int) -> list[int]:
    """The per-step list as delivered: the steps past `total` tokens dropped, the last one trimmed."""
    out, left = [], total
    for c in commits:
        if left <= 0:
            break
        out.append(min(c, left))
        left -= out[-1]
    return out


def cached_of(body: dict[str, Any]) -> int | None:
    """Prompt tokens the server took from its prefix cache: `usage.prompt_tokens_details.cached_tokens`
    (vLLM, SGLang, ddscope), SGLang /generate `meta_info.cached_tokens`, llama.cpp `tokens_cached`
    or `timings.cache_n` (tools/server/server-common.cpp:84)."""
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    for value in (details.get("cached_tokens"), (body.get("meta_info") or {}).get("cached_tokens"),
                  body.get("tokens_cached"), (body.get("timings") or {}).get("cache_n")):
        if num(value) is not None:
            return int(value)
    return None


def usage_of(body: dict[str, Any]) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens): OpenAI `usage`, or SGLang /generate's `meta_info`."""
    usage = body.get("usage") or body.get("meta_info") or {}
    prompt, completion = num(usage.get("prompt_tokens")), num(usage.get("completion_tokens"))
    return (int(prompt) if prompt else None), (int(completion) if completion else None)


# ---- the server ----------------------------------------------------------------------------------

class Server:
    """HTTP access to a server for detection and telemetry scrapes."""

    def __init__(self, base_url: str, client: httpx.Client):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.client = client

    def _get(self, path: str) -> httpx.Response | None:
        try:
            resp = self.client.get(self.base_url + path, timeout=10.0)
        except httpx.HTTPError:
            return None
        return resp if resp.status_code == 200 else None

    def metrics(self) -> Scrape | None:
        resp = self._get("/metrics")
        if resp is None:
            return None
        try:
            return parse_metrics(resp.text)
        except ValueError:  # not Prometheus text
            return None

    def _get_json(self, path: str) -> dict[str, Any]:
        resp = self._get(path)
        try:
            body = resp.json() if resp is not None else None
        except ValueError:
            body = None
        return body if isinstance(body, dict) else {}

    def models(self) -> dict[str, Any]:
        """The first entry of /v1/models."""
        data = self._get_json("/v1/models").get("data")
        return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}

    @staticmethod
    def context_limit(info: dict[str, Any]) -> int | None:
        """Prompt + output tokens a request may hold: vLLM/SGLang `max_model_len`, llama.cpp
        `meta.n_ctx` (per slot; llama.cpp tools/server/server-context.cpp:4537)."""
        value = num(info.get("max_model_len")) or num((info.get("meta") or {}).get("n_ctx"))
        return int(value) if value else None

    def lifetime_accept_length(self) -> float | None:
        """SGLang's lifetime average; /get_server_info is deprecated and warns on every call."""
        for path in ("/server_info", "/get_server_info"):
            states = self._get_json(path).get("internal_states")
            values = [num(s.get("avg_spec_accept_length")) for s in states or [] if isinstance(s, dict)]
            values = [v for v in values if v]
            if values:
                return sum(values) / len(values)
        return None

    def detect(self) -> str:
        """The backend name: from /metrics prefixes first, then /v1/models `owned_by`."""
        resp = self._get("/metrics")
        text = resp.text if resp is not None else ""
        for name, prefix in (("ddscope", "ddscope:"), ("sglang", "sglang:"), ("vllm", "vllm:"),
                             ("llamacpp", "llamacpp:")):
            if prefix in text:
                return name
        owner = str(self.models().get("owned_by", "")).lower().replace(".", "")
        return next((b for b in BACKENDS[:4] if b in owner), "openai")
