"""Prometheus metrics, in a registry owned by one app (so several servers can live in one process).

Names are given without `_total`: prometheus_client appends it to counters, so the exposed
names are exactly those in docs/server.md. The `_created` series are switched off, as in vLLM.

Beside the `ddscope:` series, the ones that users' tools read under vLLM's names (AIPerf's live row, vLLM's
Grafana dashboard, KEDA, the Gateway API inference extension), with vLLM 0.32's types, labels (`model_name`,
`engine`) and buckets (vllm/v1/metrics/loggers.py:499-1011, buckets.py, v1/spec_decode/metrics.py:203-270).
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
# vLLM 0.32's defaults (vllm/v1/metrics/buckets.py)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
VLLM = ["model_name", "engine"]


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
        self.grammar_masks = Counter("ddscope:grammar_masks", "Structured outputs: token masks the grammar filled "
                                     "(draft-tree growth and verify).", m, registry=r)
        self.grammar_seconds = Counter("ddscope:grammar_seconds", "Structured outputs: seconds in the grammar's "
                                       "matcher and masking (within the tree and commit phases).", m, registry=r)
        self.engine_steps = Counter("ddscope:engine_steps", "Batched engine steps (one target forward each).", m,
                                    registry=r)
        self.vllm = VllmSeries(r)
        # With requests_total, every generation request sent is counted exactly once.
        self.rejected = Counter("ddscope:rejected_requests", "Generation requests answered with an error before "
                                "they reached the engine queue, by HTTP status.", ["status"], registry=r)

    def bind(self, model_name: str) -> ModelMetrics:
        return ModelMetrics(self, model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VllmSeries:
    """vLLM's names and semantics, for one model on engine "0". Trees in vLLM's terms: a draft is an engine step
    of a sequence (drafted or not, so 1 + accepted / drafts is ddscope's avg_commit), its draft tokens are the
    tree's nodes, its accepted tokens those committed beyond the bonus one, at positions 0.. along the path."""

    def __init__(self, r: CollectorRegistry):
        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, VLLM + list(extra), registry=r)

        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", VLLM,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", VLLM,
                             registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", VLLM,
                              registry=r)
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", ("position",))
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              VLLM, buckets=VLLM_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             VLLM, buckets=VLLM_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             VLLM, buckets=VLLM_E2E_BUCKETS, registry=r)
        # vLLM observes it at finish as the last token's time less the first's (v1/metrics/stats.py:601 in 0.32):
        # over the drafts, a run's decode time a step (what AIPerf's server-metrics export lets a reader divide)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase "
                                     "for request.", VLLM, buckets=VLLM_E2E_BUCKETS, registry=r)


class Fanout:
    """One reading into several series (a ddscope: child and its vllm: twin)."""

    def __init__(self, *children: object):
        self.children = children

    def inc(self, amount: float = 1) -> None:
        for c in self.children:
            c.inc(amount)

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class ModelMetrics:
    """The children for one model_name, created eagerly so that every series shows from 0 (vLLM's accepted tokens
    per position as each position is first reached)."""

    def __init__(self, m: ServerMetrics, model_name: str):
        v, on = m.vllm, (model_name, "0")
        self.verify_steps = Fanout(m.verify_steps.labels(model_name), v.drafts.labels(*on))
        self.committed_tokens = m.committed_tokens.labels(model_name)
        self.draft_nodes = Fanout(m.draft_nodes.labels(model_name), v.draft_tokens.labels(*on))
        self.accepted_tokens = v.accepted.labels(*on)
        self.accepted_per_pos = lambda position: v.accepted_per_pos.labels(*on, str(position))
        self.prompt_tokens = Fanout(m.prompt_tokens.labels(model_name), v.prompt_tokens.labels(*on),
                                    v.prefix_queries.labels(*on))
        self.cached_prompt_tokens = Fanout(m.cached_prompt_tokens.labels(model_name), v.prefix_hits.labels(*on))
        self.generation_tokens = Fanout(m.generation_tokens.labels(model_name), v.generation_tokens.labels(*on))
        self.preemptions = v.preemptions.labels(*on)
        self.itl = v.itl.labels(*on)
        self.requests = {s: m.requests.labels(model_name, s) for s in STATUSES}
        self.commit_length = m.commit_length.labels(model_name)
        self.step_phase = {p: m.step_phase.labels(model_name, p) for p in PHASES}
        self.ttft = Fanout(m.ttft.labels(model_name), v.ttft.labels(*on))
        self.e2e = Fanout(m.e2e.labels(model_name), v.e2e.labels(*on))
        self.decode_time = v.decode_time.labels(*on)
        self.running = Fanout(m.running.labels(model_name), v.running.labels(*on))
        self.waiting = Fanout(m.waiting.labels(model_name), v.waiting.labels(*on))
        self.batch_size = m.batch_size.labels(model_name)
        self.kv_usage = Fanout(m.kv_usage.labels(model_name), v.kv_usage.labels(*on))
        self.engine_steps = m.engine_steps.labels(model_name)
        self.grammar_masks = m.grammar_masks.labels(model_name)
        self.grammar_seconds = m.grammar_seconds.labels(model_name)
