"""Prometheus metrics, in a registry owned by one app (so several servers can live in one process).

Names are given without `_total`: prometheus_client appends it to counters, so the exposed
names are exactly those in docs/server.md. The `_created` series are switched off, as in vLLM.
"""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()

PHASES = ("draft", "tree", "verify", "commit")
STATUSES = ("finished", "cancelled", "error", "timeout")

COMMIT_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64, 128)
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """All `ddscope:*` metrics. Everything carries the `model_name` label but `rejected_requests`, which can
    come before any model has loaded."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.verify_steps = Counter("ddscope:verify_steps", "Target verify steps.", m, registry=r)
        self.committed_tokens = Counter(
            "ddscope:committed_tokens", "Tokens committed by verify steps (bonus included, the prefill's token not).",
            m, registry=r)
        self.draft_nodes = Counter("ddscope:draft_nodes_verified",
                                   "Draft-tree nodes verified by the target (root excluded).", m, registry=r)
        self.prompt_tokens = Counter("ddscope:prompt_tokens", "Prompt tokens of requests that reached the engine.", m,
                                     registry=r)
        self.cached_prompt_tokens = Counter("ddscope:cached_prompt_tokens",
                                            "Prompt tokens served from the prefix cache, not prefilled.", m, registry=r)
        self.generation_tokens = Counter("ddscope:generation_tokens", "Completion tokens generated.", m,
                                         registry=r)
        self.requests = Counter("ddscope:requests", "Requests that reached the engine queue, by outcome.",
                                m + ["status"], registry=r)
        self.commit_length = Histogram("ddscope:commit_length", "Tokens committed per verify step.", m,
                                       buckets=COMMIT_BUCKETS, registry=r)
        self.step_phase = Histogram("ddscope:step_phase_seconds", "Seconds per batched engine step that verified, by "
                                    "phase.",
                                    m + ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.ttft = Histogram("ddscope:time_to_first_token_seconds", "Arrival to the first token (the prefill's).", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("ddscope:e2e_request_latency_seconds", "Arrival to finish, finished requests.", m,
                             buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge("ddscope:num_requests_running", "Requests in the engine's running batch.", m, registry=r)
        self.waiting = Gauge("ddscope:num_requests_waiting", "Requests waiting to join the batch (queued or "
                             "preempted).", m, registry=r)
        self.batch_size = Histogram("ddscope:batch_size", "Sequences in each engine step (decoding or prefilling).",
                                    m, buckets=BATCH_BUCKETS, registry=r)
        self.kv_usage = Gauge("ddscope:kv_cache_usage_perc", "Share of the KV cache's blocks in use (0 to 1), as "
                              "vLLM's vllm:kv_cache_usage_perc.", m, registry=r)
        self.engine_steps = Counter("ddscope:engine_steps", "Batched engine steps (one target forward each).", m,
                                    registry=r)
        # With requests_total, every generation request sent is counted exactly once.
        self.rejected = Counter("ddscope:rejected_requests", "Generation requests answered with an error before "
                                "they reached the engine queue, by HTTP status.", ["status"], registry=r)

    def bind(self, model_name: str) -> ModelMetrics:
        return ModelMetrics(self, model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """The children for one model_name, created eagerly so that every series shows from 0."""

    def __init__(self, m: ServerMetrics, model_name: str):
        self.verify_steps = m.verify_steps.labels(model_name)
        self.committed_tokens = m.committed_tokens.labels(model_name)
        self.draft_nodes = m.draft_nodes.labels(model_name)
        self.prompt_tokens = m.prompt_tokens.labels(model_name)
        self.cached_prompt_tokens = m.cached_prompt_tokens.labels(model_name)
        self.generation_tokens = m.generation_tokens.labels(model_name)
        self.requests = {s: m.requests.labels(model_name, s) for s in STATUSES}
        self.commit_length = m.commit_length.labels(model_name)
        self.step_phase = {p: m.step_phase.labels(model_name, p) for p in PHASES}
        self.ttft = m.ttft.labels(model_name)
        self.e2e = m.e2e.labels(model_name)
        self.running = m.running.labels(model_name)
        self.waiting = m.waiting.labels(model_name)
        self.batch_size = m.batch_size.labels(model_name)
        self.kv_usage = m.kv_usage.labels(model_name)
        self.engine_steps = m.engine_steps.labels(model_name)
