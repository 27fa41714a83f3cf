"""Acceptance sources: what each server can tell about tokens committed per verify step.

Every number the bench reports as acceptance comes from one `AcceptanceSource`, recorded with its
definition. Per backend the sources are tried in one order: exact per request, exact counter
difference, the server's own log lines, then approximations. When a server gives nothing the sweep
reports tok/s only: acceptance is never invented. Gauges are never differenced.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class AcceptanceSource:
    name: str
    kind: str             # per_request | counter_delta | log | windowed_gauge | lifetime | none
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
    # Every source is normalised to include the bonus token, the convention of all four engines.
    return AcceptanceSource(name, kind, True, approximate, definition)


NONE = AcceptanceSource("none", "none", False, False, "the server reports no acceptance: tok/s only")
LOG = _src("server_log", "log",
           "steps-weighted mean of the server's own acceptance log lines whose time (and the interval "
           "the line averages over) lies inside the request's wall-clock window; lines that straddle two "
           "requests are dropped and counted; no line in a window gives null")
SOURCES = {s.name: s for s in (
    _src("ddscope.response", "per_request",
         "response extension ddscope.avg_commit = committed_tokens / verify_steps = (completion_tokens - 1) "
         "/ verify_steps: the first token is the prefill's"),
    _src("ddscope.counters", "counter_delta",
         "delta ddscope:committed_tokens_total / delta ddscope:verify_steps_total around the request"),
    _src("sglang.sglext", "per_request",
         "usage.completion_tokens / sglext.spec_tokens_details.spec_verify_ct (return_spec_tokens_details)"),
    _src("sglang.meta_info", "per_request",
         "usage.completion_tokens / choices[0].meta_info.spec_verify_ct (chat, return_meta_info)"),
    _src("sglang.generate", "per_request",
         "meta_info.completion_tokens / meta_info.spec_verify_ct on the native /generate route"),
    _src("sglang.counters", "counter_delta",
         "delta sglang:generation_tokens_total / delta sglang:spec_verify_calls_total around the request "
         "(--enable-metrics)"),
    _src("sglang.gauge", "windowed_gauge",
         "gauge sglang:spec_accept_length read after the request: an average over the server's last "
         "log window, possibly including other traffic; never differenced", approximate=True),
    _src("sglang.server_info", "lifetime",
         "/server_info (else /get_server_info) internal_states[].avg_spec_accept_length: averaged over "
         "the server's whole lifetime, not this request", approximate=True),
    _src("vllm.response", "per_request",
         "metrics.speculative_decoding.mean_acceptance_length = 1 + num_accepted_draft_tokens / "
         "num_spec_steps (--per-request-spec-decode-metrics)"),
    _src("vllm.counters", "counter_delta",
         "1 + delta vllm:spec_decode_num_accepted_tokens_total / delta vllm:spec_decode_num_drafts_total"),
    _src("llamacpp.counters", "counter_delta",
         "1 + delta llamacpp:spec_decode_num_accepted_tokens_total / delta "
         "llamacpp:spec_decode_num_drafts_total (verify steps; --metrics)"),
    _src("llamacpp.timings", "per_request",
         "timings.predicted_n / (predicted_n - draft_n_accepted): llama.cpp gives no verify-step "
         "count, so steps are approximated as predicted_n - draft_n_accepted (reads low: the "
         "prompt's token and undrafted last steps count as steps)", approximate=True),
    _src("llamacpp.legacy_counters", "counter_delta",
         "delta llamacpp:tokens_predicted_total / (delta tokens_predicted_total - delta "
         "tokens_drafted_accepted_total): steps approximated as in timings", approximate=True),
    LOG,
)}

# Per backend, the order in which sources are considered: exact per request, exact counter
# difference, the server log (only with --server-log/--log-cmd), then approximations.
ORDER: dict[str, list[str]] = {
    "ddscope": ["ddscope.response", "ddscope.counters", "server_log"],
    "sglang": ["sglang.sglext", "sglang.meta_info", "sglang.generate", "sglang.counters", "server_log",
               "sglang.gauge", "sglang.server_info"],
    "vllm": ["vllm.response", "vllm.counters", "server_log"],
    "llamacpp": ["llamacpp.counters", "server_log", "llamacpp.timings", "llamacpp.legacy_counters"],
    "openai": ["server_log"],
}
