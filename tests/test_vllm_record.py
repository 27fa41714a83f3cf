"""vLLM 0.32's per-request record (`metrics.speculative_decoding`, and the timing fields), as ddscope's server
gives it: where vLLM puts it, at each level, and holding AIPerf's invariants (aiperf 0.13,
common/models/spec_decode_models.py:103-175), with trees that were really accepted (the oracle)."""
from __future__ import annotations

import json

import httpx
import pytest

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.server.launch import serve_in_background

BODY = {"prompt": "def add(a, b):", "max_tokens": 40, "temperature": 0, "ignore_eos": True}


def holds_aiperfs_invariants(spec: dict) -> None:
    hist = spec["acceptance_histogram"]
    assert len(hist) == spec["num_spec_tokens"] + 1 and all(type(c) is int and c >= 0 for c in hist)
    assert sum(hist) == spec["num_spec_steps"]
    assert sum(j * c for j, c in enumerate(hist)) == spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
    if "per_step_accepted" in spec:
        assert len(spec["per_step_accepted"]) == len(spec["per_step_drafted"]) == spec["num_spec_steps"]
        assert sum(spec["per_step_accepted"]) == spec["num_accepted_draft_tokens"]
        assert sum(spec["per_step_drafted"]) == spec["num_draft_tokens"]
        assert all(a <= d for a, d in zip(spec["per_step_accepted"], spec["per_step_drafted"]))


@pytest.fixture(scope="module")
def servers(tiny_engine):
    oracle = oracle_engine(tiny_engine)
    with serve_in_background(engine=oracle, method="ddtree", budget=16) as summary, \
            serve_in_background(engine=oracle_engine(tiny_engine), method="ddtree", budget=16,
                                spec_decode_metrics="detailed", per_request_metrics=True) as detailed, \
            serve_in_background(engine=oracle_engine(tiny_engine), spec_decode_metrics="none") as none:
        yield {"summary": summary, "detailed": detailed, "none": none}


def post(url: str, **extra) -> dict:
    resp = httpx.post(f"{url}/v1/completions", json={**BODY, **extra}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def streamed(url: str, **extra) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True, **extra}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("method", ["ddtree", "dflash", "ar"])
def test_the_summary_is_ddscopes_own_acceptance(servers, method):
    body = post(servers["summary"], method=method)
    spec, ext = body["metrics"]["speculative_decoding"], body["ddscope"]
    holds_aiperfs_invariants(spec)
    assert "per_step_accepted" not in spec and "time_to_first_token_ms" not in body["metrics"]
    assert spec["num_spec_steps"] == ext["verify_steps"]
    assert spec["mean_acceptance_length"] == pytest.approx(ext["avg_commit"])  # delivered, exactly
    assert spec["num_draft_tokens"] == ext["nodes_verified"]
    if method != "ar":
        assert ext["avg_commit"] > 1.5 and spec["draft_acceptance_rate"] > 0  # the trees were accepted
    else:
        assert spec["num_draft_tokens"] == 0 and spec["acceptance_histogram"][0] == spec["num_spec_steps"]


def test_detailed_gives_the_steps_and_the_timing(servers):
    body = post(servers["detailed"], return_rounds=True)
    spec, rounds = body["metrics"]["speculative_decoding"], body["ddscope"]["rounds"]
    holds_aiperfs_invariants(spec)
    assert spec["per_step_accepted"] == [r["committed"] - 1 for r in rounds]
    assert spec["per_step_drafted"] == [r["nodes"] for r in rounds]
    timing = body["metrics"]
    for key in ("time_to_first_token_ms", "queue_time_ms", "generation_time_ms", "mean_itl_ms", "tokens_per_second"):
        assert timing[key] >= 0, key
    assert timing["mean_itl_ms"] == pytest.approx(timing["generation_time_ms"] / 39)


def test_a_stream_carries_it_on_the_usage_chunk_only(servers):
    chunks = streamed(servers["summary"], stream_options={"include_usage": True})
    carrying = [c for c in chunks if "metrics" in c]
    assert len(carrying) == 1 and carrying[0] is chunks[-1] and carrying[0]["choices"] == []
    holds_aiperfs_invariants(carrying[0]["metrics"]["speculative_decoding"])
    assert not any("metrics" in c for c in streamed(servers["summary"]))  # no usage chunk: nowhere, as vLLM


def test_none_and_batches_carry_none(servers):
    assert "metrics" not in post(servers["none"])
    batch = post(servers["summary"], prompt=["def add(a, b):", "The quick brown fox"])
    assert "metrics" not in batch and len(batch["choices"]) == 2


VLLM_SERIES = {  # name (as prometheus_client parses it) -> type; docs/server.md's table
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter", "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram"}


def scrape(url: str) -> dict[str, tuple[str, dict[str, float]]]:
    """name -> (type, {sample name: value summed over label sets})."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        values: dict[str, float] = {}
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
        out[family.name] = (family.type, values)
    return out


def test_vllms_series_equal_ddscopes_own_counters(servers):
    url = servers["summary"]
    for prompt in ("def add(a, b):", "The quick brown fox", "def add(a, b):"):  # the last one hits the prefix cache
        post(url, prompt=prompt * 20)
    m = scrape(url)
    for name, kind in VLLM_SERIES.items():
        assert m[name][0] == kind, name

    def total(name: str, sample: str | None = None) -> float:
        return m[name][1][sample or name + ("_total" if m[name][0] == "counter" else "")]

    assert total("vllm:generation_tokens") == total("ddscope:generation_tokens")
    assert total("vllm:prompt_tokens") == total("ddscope:prompt_tokens") == total("vllm:prefix_cache_queries")
    assert total("vllm:prefix_cache_hits") == total("ddscope:cached_prompt_tokens") > 0
    assert total("vllm:spec_decode_num_drafts") == total("ddscope:verify_steps")
    assert total("vllm:spec_decode_num_draft_tokens") == total("ddscope:draft_nodes_verified")
    accepted = total("ddscope:committed_tokens") - total("ddscope:verify_steps")
    assert total("vllm:spec_decode_num_accepted_tokens") == accepted > 0
    assert total("vllm:spec_decode_num_accepted_tokens_per_pos") == accepted  # each accepted token at one position
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert total(f"vllm:{hist}", f"vllm:{hist}_count") == total(f"ddscope:{hist}", f"ddscope:{hist}_count") >= 3
    assert total("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == \
        total("ddscope:verify_steps")
