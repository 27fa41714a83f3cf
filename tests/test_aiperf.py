"""AIPerf 0.13 (NVIDIA's load tool, a real client nobody here wrote) against `ddscope serve`: it reads ddscope's
acceptance through vLLM's per-request record, and `ddscope bench analyze` reads its run back."""
from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddscope.bench.running.server import serve_process
from ddscope.bench.running.workloads import load_workload
from ddscope.cli import main
from ddscope.engine.limits import DEMO_DIR
from support.aiperf_peer import INSTALL_TIMEOUT_S, profile, write_prompts

pytestmark = pytest.mark.timeout(INSTALL_TIMEOUT_S + 900)


def counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_aiperf_reads_ddscopes_acceptance_and_ddscope_reads_aiperfs_run(tmp_path, capsys):
    """Held-out HumanEval prompts (the demo drafter trained on other code), c=4, 12 requests, streamed, T=0."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", list(load_workload("code").prompts[150:162]))
    with serve_process(["--per-request-spec-decode-metrics", "detailed"], tmp_path / "serve.log") as url:
        before = counters(url)
        run = profile(url, "target", DEMO_DIR / "target", tmp_path / "run", prompts=prompts, requests=12,
                      concurrency=4, max_tokens=64)
        after = counters(url)
    steps = after["ddscope:verify_steps_total"] - before["ddscope:verify_steps_total"]
    committed = after["ddscope:committed_tokens_total"] - before["ddscope:committed_tokens_total"]
    summary = json.loads((run / "profile_export_aiperf.json").read_text())
    assert summary["total_spec_decode_steps"]["avg"] == steps  # every engine step, exactly
    assert summary["spec_decode_token_weighted_acceptance_length"]["avg"] == pytest.approx(committed / steps,
                                                                                         rel=0.005)
    assert committed / steps > 1.5  # the drafts were accepted
    assert "Spec Decode" in (run / "profile_export_console.txt").read_text()
    records = [json.loads(line) for line in (run / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == 12 and all(r["spec_decode_acceptance"] for r in records)  # none dropped as invalid

    assert main(["bench", "analyze", str(run), "--json"]) == 0
    analysis = json.loads(capsys.readouterr().out)
    (point,) = analysis["points"]
    per_request = sorted((r["metrics"]["usage_completion_tokens"]["value"] - 1) /
                         r["spec_decode_acceptance"]["num_spec_steps"] for r in records)
    assert per_request[0] <= point["avg_commit"] <= per_request[-1] and point["n"] == 12
    assert point["server_avg_commit"] == pytest.approx(point["avg_commit"])  # ddscope counts as delivered
    assert point["step_ms"] > 0 and point["tok_per_s"] > 0

    # streamed, each chunk is one step: AIPerf's chunk gaps and the per-step record make a trace
    assert main(["bench", "analyze", str(run), "--as-trace", "--json"]) == 0
    trace = json.loads(capsys.readouterr().out)["workloads"]["aiperf"]
    assert not trace["approximate"], trace["reasons"]
    assert trace["steps"] == steps and trace["avg_commit"] == pytest.approx(committed / steps)


def test_a_run_without_per_request_records_reads_the_servers_counters(tmp_path, capsys):
    """`--per-request-spec-decode-metrics none`: AIPerf has no spec record per request, but it scraped the server's
    /metrics over its profiling phase (on by default in 0.13); `analyze` reads the run's avg_commit and step time
    from those counters, and they equal what the server's own counters say, read here apart from AIPerf."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", list(load_workload("code").prompts[162:170]))
    with serve_process(["--per-request-spec-decode-metrics", "none"], tmp_path / "serve.log") as url:
        before = counters(url)
        run = profile(url, "target", DEMO_DIR / "target", tmp_path / "run", prompts=prompts, requests=8,
                      concurrency=2, max_tokens=48)
        after = counters(url)
    records = [json.loads(line) for line in (run / "profile_export.jsonl").read_text().splitlines()]
    assert not any(r.get("spec_decode_acceptance") for r in records)
    delta = {k: after[k] - before.get(k, 0.0) for k in ("vllm:spec_decode_num_drafts_total",
                                                        "vllm:request_decode_time_seconds_sum",
                                                        "ddscope:committed_tokens_total")}
    steps = delta["vllm:spec_decode_num_drafts_total"]
    assert main(["bench", "analyze", str(run), "--json"]) == 0
    analysis = json.loads(capsys.readouterr().out)
    (point,) = analysis["points"]
    assert point["avg_commit"] == pytest.approx(delta["ddscope:committed_tokens_total"] / steps, rel=0.015)
    assert point["step_ms"] == pytest.approx(1e3 * delta["vllm:request_decode_time_seconds_sum"] / steps, rel=0.05)
    assert point["avg_commit"] > 1.5
