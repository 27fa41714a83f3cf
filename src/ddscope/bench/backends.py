"""Which server is at the URL, and where its acceptance (tokens committed per verify step) lives.

Every number the bench reports as acceptance comes from one `AcceptanceSource`, recorded with its
definition: with or without the bonus token, per request, counter difference, windowed gauge or
lifetime average, and whether it is an approximation. When a server gives nothing, the sweep says
so and reports tok/s only: acceptance is never invented. Gauges are never differenced.
See docs/bench.md for the per-engine references.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

BACKENDS = ("ddscope", "sglang", "vllm", "llamacpp", "openai")
Metrics = dict[str, list[float]]  # sample name -> values over label sets


@dataclass(frozen=True)
class AcceptanceSource:
    name: str
    kind: str             # per_request | counter_delta | windowed_gauge | lifetime | none
    includes_bonus: bool  # whether avg_commit counts the target's own (bonus) token
    approximate: bool
    definition: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Acceptance:
    avg_commit: float
    verify_steps: float | None
    source: AcceptanceSource


def _src(name: str, kind: str, definition: str, approximate: bool = False) -> AcceptanceSource:
    # Every source below is normalised to include the bonus token, the convention of all four engines.
    return AcceptanceSource(name, kind, True, approximate, definition)


NONE = AcceptanceSource("none", "none", False, False, "the server reports no acceptance: tok/s only")
SOURCES = {s.name: s for s in (
    _src("ddscope.response", "per_request",
         "response extension ddscope.avg_commit = committed_tokens / verify_steps"),
    _src("ddscope.counters", "counter_delta",
         "delta ddscope:committed_tokens_total / delta ddscope:verify_steps_total around the request"),
    _src("sglang.sglext", "per_request",
         "usage.completion_tokens / sglext.spec_tokens_details.spec_verify_ct (return_spec_tokens_details)"),
    _src("sglang.meta_info", "per_request",
         "usage.completion_tokens / meta_info.spec_verify_ct (return_meta_info or /generate)"),
    _src("sglang.gauge", "windowed_gauge",
         "gauge sglang:spec_accept_length read after the request: an average over the server's last "
         "log window, possibly including other traffic; never differenced", approximate=True),
    _src("sglang.server_info", "lifetime",
         "/get_server_info internal_states[].avg_spec_accept_length: averaged over the server's "
         "whole lifetime, not this request", approximate=True),
    _src("vllm.response", "per_request",
         "metrics.speculative_decoding.mean_acceptance_length = 1 + num_accepted_draft_tokens / "
         "num_spec_steps (--per-request-spec-decode-metrics)"),
    _src("vllm.counters", "counter_delta",
         "1 + delta vllm:spec_decode_num_accepted_tokens_total / delta vllm:spec_decode_num_drafts_total"),
    _src("llamacpp.timings", "per_request",
         "timings.predicted_n / (predicted_n - draft_n_accepted): llama.cpp gives no verify-step "
         "count, so steps are approximated as predicted_n - draft_n_accepted", approximate=True),
    _src("llamacpp.counters", "counter_delta",
         "1 + delta llamacpp:spec_decode_num_accepted_tokens_total / delta "
         "llamacpp:spec_decode_num_drafts_total"),
    _src("llamacpp.legacy_counters", "counter_delta",
         "delta llamacpp:tokens_predicted_total / (delta tokens_predicted_total - delta "
         "tokens_drafted_accepted_total): steps approximated as in timings", approximate=True),
)}

# Request fields that switch per-request telemetry on, tried in order until the server accepts one.
REQUEST_EXTRAS: dict[str, list[dict[str, Any]]] = {
    "ddscope": [{"return_rounds": True}, {}],
    "sglang": [{"return_spec_tokens_details": True}, {"return_meta_info": True}, {}],
}


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _per_request(backend: str, body: dict[str, Any], completion_tokens: int) -> Acceptance | None:
    """Acceptance carried by the response body itself."""
    if backend == "ddscope":
        ext = body.get("ddscope") or {}
        avg, steps = _num(ext.get("avg_commit")), _num(ext.get("verify_steps"))
        return Acceptance(avg, steps, SOURCES["ddscope.response"]) if avg and steps else None
    if backend == "sglang":
        choice = (body.get("choices") or [{}])[0]
        places = (("sglang.sglext", (body.get("sglext") or {}).get("spec_tokens_details")),
                  ("sglang.meta_info", choice.get("meta_info") or body.get("meta_info")))
        for name, details in places:
            steps = _num((details or {}).get("spec_verify_ct"))
            if steps:
                return Acceptance(completion_tokens / steps, steps, SOURCES[name])
        return None
    if backend == "vllm":
        spec = (body.get("metrics") or {}).get("speculative_decoding") or {}
        avg, steps = _num(spec.get("mean_acceptance_length")), _num(spec.get("num_spec_steps"))
        return Acceptance(avg, steps, SOURCES["vllm.response"]) if avg and steps else None
    if backend == "llamacpp":
        t = body.get("timings") or {}
        predicted, accepted = _num(t.get("predicted_n")), _num(t.get("draft_n_accepted"))
        if t.get("draft_n") is None or not predicted or accepted is None or predicted <= accepted:
            return None
        steps = predicted - accepted
        return Acceptance(predicted / steps, steps, SOURCES["llamacpp.timings"])
    return None


def _delta(before: Metrics, after: Metrics, name: str) -> float | None:
    if name not in before or name not in after:
        return None
    return sum(after[name]) - sum(before[name])


def _bonus_ratio(accepted: float | None, drafts: float | None) -> tuple[float, float] | None:
    return (1.0 + accepted / drafts, drafts) if accepted is not None and drafts else None


Delta = Callable[[str], "float | None"]


def _ddscope_rule(d: Delta) -> tuple[float, float] | None:
    steps, committed = d("ddscope:verify_steps_total"), d("ddscope:committed_tokens_total")
    return (committed / steps, steps) if steps and committed is not None else None


def _llamacpp_legacy_rule(d: Delta) -> tuple[float, float] | None:
    # Older builds count drafted/accepted tokens only; steps ~ predicted - accepted, as for timings.
    predicted, accepted = d("llamacpp:tokens_predicted_total"), d("llamacpp:tokens_drafted_accepted_total")
    if not predicted or accepted is None or predicted <= accepted:
        return None
    return predicted / (predicted - accepted), predicted - accepted


# backend -> [(source name, rule)] in order of preference; a rule maps counter deltas to
# (avg_commit, verify_steps).
COUNTER_RULES: dict[str, list[tuple[str, Callable[[Delta], tuple[float, float] | None]]]] = {
    "ddscope": [("ddscope.counters", _ddscope_rule)],
    "vllm": [("vllm.counters", lambda d: _bonus_ratio(
        d("vllm:spec_decode_num_accepted_tokens_total"), d("vllm:spec_decode_num_drafts_total")))],
    "llamacpp": [
        ("llamacpp.counters", lambda d: _bonus_ratio(
            d("llamacpp:spec_decode_num_accepted_tokens_total"), d("llamacpp:spec_decode_num_drafts_total"))),
        ("llamacpp.legacy_counters", _llamacpp_legacy_rule),
    ],
}


def _counter_delta(backend: str, before: Metrics, after: Metrics, only: str | None = None) -> Acceptance | None:
    for name, rule in COUNTER_RULES.get(backend, []):
        if only in (None, name):
            got = rule(lambda metric: _delta(before, after, metric))
            if got:
                return Acceptance(got[0], got[1], SOURCES[name])
    return None


def parse_metrics(text: str) -> Metrics:
    """Prometheus text -> {sample name: [values over label sets]}; `_created` samples are dropped."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out.setdefault(sample.name, []).append(float(sample.value))
    return out


class Server:
    """HTTP access to an OpenAI-compatible server for detection and telemetry scrapes."""

    def __init__(self, base_url: str, client: httpx.Client):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.client = client

    def _get(self, path: str) -> httpx.Response | None:
        try:
            resp = self.client.get(self.base_url + path, timeout=10.0)
        except httpx.HTTPError:
            return None
        return resp if resp.status_code == 200 else None

    def metrics(self) -> Metrics | None:
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
        """The first entry of /v1/models (id, owned_by, max_model_len where given)."""
        data = self._get_json("/v1/models").get("data")
        return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}

    def lifetime_accept_length(self) -> float | None:
        """SGLang's lifetime-cumulative average (both route spellings exist across versions)."""
        for path in ("/get_server_info", "/server_info"):
            states = self._get_json(path).get("internal_states")
            values = [_num(s.get("avg_spec_accept_length")) for s in states or [] if isinstance(s, dict)]
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


class AcceptanceReader:
    """One source, chosen by a probe request, then read the same way for every request."""

    def __init__(self, backend: str, server: Server):
        self.backend, self.server, self.source = backend, server, NONE

    def snapshot(self) -> Metrics | None:
        """Counters before a request, when the source is a counter difference."""
        return self.server.metrics() if self.source.kind == "counter_delta" else None

    def choose(self, body: dict[str, Any], completion_tokens: int,
               before: Metrics | None, after: Metrics | None) -> None:
        """Pick the best source the probe's response and scrapes show: per request, counters,
        windowed gauge, lifetime, or none."""
        found = _per_request(self.backend, body, completion_tokens)
        if found is None and before is not None and after is not None:
            found = _counter_delta(self.backend, before, after)
        if found is not None:
            self.source = found.source
        elif self.backend == "sglang" and after and "sglang:spec_accept_length" in after:
            self.source = SOURCES["sglang.gauge"]
        elif self.backend == "sglang" and self.server.lifetime_accept_length():
            self.source = SOURCES["sglang.server_info"]
        else:
            self.source = NONE

    def read(self, body: dict[str, Any], completion_tokens: int, before: Metrics | None) -> Acceptance | None:
        kind = self.source.kind
        if kind == "per_request":
            got = _per_request(self.backend, body, completion_tokens)
            return got if got and got.source == self.source else None
        if kind == "counter_delta":
            after = self.server.metrics()
            return _counter_delta(self.backend, before, after, self.source.name) if before and after else None
        if kind == "windowed_gauge":
            values = (self.server.metrics() or {}).get("sglang:spec_accept_length") or []
            values = [v for v in values if v > 0]  # idle ranks report 0
            return Acceptance(sum(values) / len(values), None, self.source) if values else None
        if kind == "lifetime":
            value = self.server.lifetime_accept_length()
            return Acceptance(value, None, self.source) if value else None
        return None


def server_prefill_s(backend: str, body: dict[str, Any]) -> float | None:
    """Prefill time the server reports, so decode tok/s can exclude it."""
    if backend == "ddscope":
        ms = _num((body.get("ddscope") or {}).get("prefill_ms"))
    elif backend == "llamacpp":
        ms = _num((body.get("timings") or {}).get("prompt_ms"))
    else:
        ms = None
    return ms / 1000.0 if ms is not None else None


def engine_step_ms(backend: str, body: dict[str, Any]) -> float | None:
    """The engine's own mean verify-step time, where it reports one (ddscope)."""
    return _num((body.get("ddscope") or {}).get("mean_step_ms")) if backend == "ddscope" else None


def step_commits(backend: str, body: dict[str, Any]) -> list[int] | None:
    """Tokens committed at each verify step, in order, where the server reports per-step data."""
    if backend == "ddscope":
        rounds = (body.get("ddscope") or {}).get("rounds")
        return [int(r["committed"]) for r in rounds] if isinstance(rounds, list) and rounds else None
    if backend == "vllm":  # --per-request-spec-decode-metrics detailed; +1 for the bonus token
        accepted = ((body.get("metrics") or {}).get("speculative_decoding") or {}).get("per_step_accepted")
        return [int(a) + 1 for a in accepted] if isinstance(accepted, list) and accepted else None
    return None
