"""`ddscope serve` against live servers on 127.0.0.1 with a tiny random pair: the OpenAI client,
telemetry, /metrics, cancellation, back-pressure, timeouts, shutdown, logs and the CLI."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.engine import Engine
from ddscope.server import cli
from ddscope.server.app import attach_engine, create_app
from ddscope.server.launch import serve_in_background
from ddscope.util.process import free_port
from support.pool_check import assert_pool_empty

COUNTERS = ("verify_steps", "committed_tokens", "draft_nodes_verified", "prompt_tokens", "generation_tokens")


@pytest.fixture(scope="module")
def served(tiny_engine):
    """The engine behind `server`: the tiny target with a drafter it accepts (avg_commit well above 1)."""
    return oracle_engine(tiny_engine)


@pytest.fixture(scope="module")
def server(served):
    with serve_in_background(engine=served, log_interval=0.2) as url:
        yield url


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server}/v1/models").json()["data"][0]["id"]


class PacedEngine:
    """The real engine, slowed to `delay` seconds per engine step, counting the steps it ran."""

    def __init__(self, engine: Engine, delay: float):
        self.engine, self.delay, self.steps = engine, delay, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        time.sleep(self.delay)
        self.steps += 1
        return self.engine.step()


@pytest.fixture(scope="module")
def paced(tiny_pair):
    """A paced engine behind a server with a 2-slot queue and a 3 s request timeout."""
    engine = PacedEngine(Engine.load(*tiny_pair, max_num_seqs=1), delay=0.02)  # one at a time: the others wait
    with serve_in_background(engine=engine, max_queue=2, request_timeout=3.0, shutdown_timeout=0.5) as url:
        yield engine, url


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    return scrape_text(httpx.get(f"{url}/metrics").text)


def scrape_text(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, labels but model_name): value}"""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def check_extension(ext: dict, usage: dict) -> None:
    assert usage["completion_tokens"] == ext["completion_tokens"] == ext["committed_tokens"] + 1  # + the prefill's
    assert ext["prompt_tokens"] == usage["prompt_tokens"]
    steps = ext["verify_steps"]
    assert ext["avg_commit"] == (pytest.approx(ext["committed_tokens"] / steps) if steps else 0.0)
    hist = {int(k): v for k, v in ext["commit_histogram"].items()}
    assert sum(hist.values()) == ext["verify_steps"]
    assert sum(k * v for k, v in hist.items()) == ext["committed_tokens"]
    assert set(ext["phase_ms"]) == {"draft", "tree", "verify", "commit"}
    assert ext["mean_step_ms"] == (pytest.approx(1000 * ext["decode_s"] / steps) if steps else 0.0)
    for key in ("prefill_ms", "decode_s", "decode_tok_per_s", "queue_ms", "ttft_ms", "nodes_verified"):
        assert ext[key] >= 0
    assert "rounds" not in ext


# --- the OpenAI client, unchanged ---------------------------------------------------------------

def test_openai_completion(oai, model):
    r = oai.completions.create(model=model, prompt="Hello, how are", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == model
    assert r.choices[0].finish_reason in ("length", "stop")
    assert isinstance(r.choices[0].text, str)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ext = r.model_extra["ddscope"]
    check_extension(ext, r.usage.model_dump())
    assert ext["method"] == "ddtree" and ext["budget"] == "auto"  # DEFAULT_BUDGET


def test_openai_chat(oai, model):
    r = oai.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "hi"}],
                                    max_tokens=8, temperature=0, extra_body={"method": "dflash"})
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    ext = r.model_extra["ddscope"]
    check_extension(ext, r.usage.model_dump())
    assert ext["method"] == "dflash"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_openai_streaming_with_usage_matches_non_streaming(oai, model, chat):
    kw = {"model": model, "max_tokens": 20, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if chat:
        create, kw["messages"] = oai.chat.completions.create, [{"role": "user", "content": "Tell me a story"}]
    else:
        create, kw["prompt"] = oai.completions.create, "The quick brown fox"
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
    whole = create(**kw)

    texts = [(c.choices[0].delta.content or "") if chat else c.choices[0].text for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    full = whole.choices[0].message.content if chat else whole.choices[0].text
    assert "".join(texts) == full
    assert finishes == ["length"]
    last = chunks[-1]  # the usage chunk: no choices, usage and the extension
    assert last.choices == [] and last.usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    assert all("ddscope" not in (c.model_extra or {}) for c in chunks[:-1])
    check_extension(last.model_extra["ddscope"], last.usage.model_dump())
    assert last.model_extra["ddscope"]["committed_tokens"] == whole.model_extra["ddscope"]["committed_tokens"]


def test_stream_without_usage_puts_extension_on_finish_chunk(server):
    with httpx.stream("POST", f"{server}/v1/completions", timeout=30,
                      json={"prompt": "Hi", "max_tokens": 6, "stream": True, "ignore_eos": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["matched_stop"] is None
    assert final["ddscope"]["completion_tokens"] == 6 and "usage" not in final


def completion(server: str, body: dict) -> tuple[dict, str]:
    """The non-streamed response, and the streamed text of the same request."""
    whole = httpx.post(f"{server}/v1/completions", json=body, timeout=30).json()
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    final = next(c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"])
    assert (final["finish_reason"], final["matched_stop"]) == (whole["choices"][0]["finish_reason"],
                                                                whole["choices"][0]["matched_stop"])
    assert chunks[-1]["ddscope"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    return whole, "".join(c["choices"][0]["text"] for c in chunks)


def test_stop_strings_end_every_method_where_ar_ends(server):
    """Stops ending mid-round, taken from ar's text: text, finish_reason, matched_stop and usage, streamed
    or not, equal ar's."""
    body = {"prompt": "for i in range(10):", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{server}/v1/completions", json={**body, "method": "ar"}, timeout=30).json()
    full = full["choices"][0]["text"]
    stops = [s for i in range(4, 40, 6) if "\ufffd" not in (s := full[i:i + 2]) and full.find(s) == i]
    assert len(stops) >= 3
    committed = steps = 0
    for stop in stops:
        ar, ar_text = completion(server, {**body, "method": "ar", "stop": [stop]})
        assert ar["choices"][0]["text"] == ar_text == full[:full.index(stop)]
        assert (ar["choices"][0]["finish_reason"], ar["choices"][0]["matched_stop"]) == ("stop", stop)
        for method, budget in (("dflash", None), ("ddtree", 8), ("ddtree", "auto")):
            r, text = completion(server, {**body, "method": method, "budget": budget, "stop": [stop]})
            assert text == r["choices"][0]["text"] == ar_text
            assert r["choices"][0] | {"text": None} == ar["choices"][0] | {"text": None}
            assert r["usage"] == ar["usage"], f"{stop!r}: {method} {budget}"
            committed += r["ddscope"]["committed_tokens"]
            steps += r["ddscope"]["verify_steps"]
    assert committed / steps > 1.5


# --- telemetry ----------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_extension_is_consistent_for_every_method(server, method):
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 24, "temperature": 0.8, "seed": 1, "method": method,
            "budget": 8, "ignore_eos": True, "return_rounds": True}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=30).json()
    ext = r["ddscope"]
    rounds = ext.pop("rounds")
    check_extension(ext, r["usage"])
    assert ext["method"] == method and r["usage"]["prompt_tokens"] == 5
    assert len(rounds) == ext["verify_steps"]
    assert sum(x["committed"] for x in rounds) == ext["committed_tokens"]
    assert sum(x["nodes"] for x in rounds) == ext["nodes_verified"]
    if method == "ar":
        assert ext["avg_commit"] == 1.0 and ext["nodes_verified"] == 0
    if method == "ddtree":
        # budget 8 caps the drafter's tree; a lookup branch comes on top
        from ddscope.speculative.lookup import LOOKUP_MAX
        assert all(x["nodes"] <= 8 + LOOKUP_MAX for x in rounds)


@pytest.mark.parametrize("stream", [False, True])
def test_one_token_request_has_no_verify_step(server, stream):
    """max_tokens 1: the prefill's token alone; no verify step, and nothing divides by zero."""
    body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0, "ignore_eos": True, "return_rounds": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    before = scrape(server)
    if stream:
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        ext, usage = chunks[-1]["ddscope"], chunks[-1]["usage"]
    else:
        r = httpx.post(f"{server}/v1/completions", json=body, timeout=30).json()
        text, ext, usage = r["choices"][0]["text"], r["ddscope"], r["usage"]
    after = scrape(server)
    assert ext.pop("rounds") == [] and usage["completion_tokens"] == 1 and isinstance(text, str)
    check_extension(ext, usage)
    assert (ext["verify_steps"], ext["committed_tokens"], ext["avg_commit"], ext["decode_tok_per_s"]) == (0, 0, 0, 0)
    assert moved(before, after, "ddscope:verify_steps_total") == 0
    assert moved(before, after, "ddscope:commit_length_count") == 0
    assert moved(before, after, "ddscope:generation_tokens_total") == 1
    assert moved(before, after, "ddscope:time_to_first_token_seconds_count") == 1


def test_metrics_move_by_exactly_one_request(server, model):
    metrics = httpx.get(f"{server}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    families = {f.name for f in text_string_to_metric_families(metrics.text)}
    expected = {f"ddscope:{c}" for c in COUNTERS} | {
        "ddscope:requests", "ddscope:commit_length", "ddscope:step_phase_seconds",
        "ddscope:time_to_first_token_seconds", "ddscope:e2e_request_latency_seconds",
        "ddscope:num_requests_running", "ddscope:num_requests_waiting", "ddscope:batch_size",
        "ddscope:kv_cache_usage_perc", "ddscope:engine_steps"}
    assert expected <= families
    assert f'ddscope:verify_steps_total{{model_name="{model}"}}' in metrics.text
    assert "_created" not in metrics.text

    before = scrape(server)
    r = httpx.post(f"{server}/v1/completions", timeout=30,
                   json={"prompt": "Hello there", "max_tokens": 30, "ignore_eos": True, "temperature": 0}).json()
    after = scrape(server)
    ext, usage = r["ddscope"], r["usage"]
    assert moved(before, after, "ddscope:verify_steps_total") == ext["verify_steps"]
    assert moved(before, after, "ddscope:committed_tokens_total") == ext["committed_tokens"]
    assert moved(before, after, "ddscope:committed_tokens_total") / moved(
        before, after, "ddscope:verify_steps_total") == pytest.approx(ext["avg_commit"])
    assert moved(before, after, "ddscope:draft_nodes_verified_total") == ext["nodes_verified"]
    assert moved(before, after, "ddscope:prompt_tokens_total") == usage["prompt_tokens"]
    assert moved(before, after, "ddscope:generation_tokens_total") == usage["completion_tokens"] == 30
    assert moved(before, after, "ddscope:requests_total", status="finished") == 1
    for status in ("cancelled", "error", "timeout"):
        assert moved(before, after, "ddscope:requests_total", status=status) == 0
    assert moved(before, after, "ddscope:commit_length_count") == ext["verify_steps"]
    assert moved(before, after, "ddscope:commit_length_sum") == ext["committed_tokens"]
    for phase, ms in ext["phase_ms"].items():
        assert moved(before, after, "ddscope:step_phase_seconds_count", phase=phase) == ext["verify_steps"]
        assert moved(before, after, "ddscope:step_phase_seconds_sum", phase=phase) == pytest.approx(ms / 1000)
    assert moved(before, after, "ddscope:time_to_first_token_seconds_count") == 1
    assert moved(before, after, "ddscope:e2e_request_latency_seconds_count") == 1
    # alone on the server: one step for its prefill, one for each verify round, each a batch of one
    assert moved(before, after, "ddscope:engine_steps_total") == ext["verify_steps"] + 1
    assert moved(before, after, "ddscope:batch_size_sum") == moved(before, after, "ddscope:batch_size_count")
    assert after[("ddscope:num_requests_running", ())] == 0
    assert after[("ddscope:num_requests_waiting", ())] == 0


def test_load_64_requests_at_concurrency_8(server):
    async def run() -> list[dict]:
        limit = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=server, timeout=httpx.Timeout(60.0)) as client:
            async def one(i: int) -> dict:
                body = {"max_tokens": 4 + i % 13, "temperature": (i % 3) * 0.5, "seed": i,
                        "method": ("ar", "dflash", "ddtree")[i % 3], "ignore_eos": True}
                async with limit:
                    if i % 2:
                        r = await client.post("/v1/chat/completions", json={
                            **body, "messages": [{"role": "user", "content": f"question {i}"}]})
                    else:
                        r = await client.post("/v1/completions", json={**body, "prompt": f"prompt number {i}"})
                assert r.status_code == 200, r.text
                return r.json()
            return await asyncio.gather(*(one(i) for i in range(64)))

    before = scrape(server)
    results = asyncio.run(run())
    after = scrape(server)
    assert len(results) == 64
    total = lambda key: sum(r["ddscope"][key] for r in results)
    assert moved(before, after, "ddscope:requests_total", status="finished") == 64
    assert moved(before, after, "ddscope:requests_total", status="error") == 0
    assert moved(before, after, "ddscope:verify_steps_total") == total("verify_steps")
    assert moved(before, after, "ddscope:committed_tokens_total") == total("committed_tokens")
    assert moved(before, after, "ddscope:draft_nodes_verified_total") == total("nodes_verified")
    assert moved(before, after, "ddscope:prompt_tokens_total") == sum(r["usage"]["prompt_tokens"] for r in results)
    assert moved(before, after, "ddscope:generation_tokens_total") == sum(
        r["usage"]["completion_tokens"] for r in results)
    assert moved(before, after, "ddscope:e2e_request_latency_seconds_count") == 64
    assert after[("ddscope:num_requests_waiting", ())] == 0
    steps = moved(before, after, "ddscope:batch_size_count")
    assert moved(before, after, "ddscope:batch_size_sum") / steps > 2  # they were decoded together
    assert moved(before, after, "ddscope:engine_steps_total") == steps < total("verify_steps")


def mixed_requests(server: str) -> list[dict]:
    """24 requests over every method and budget, greedy and seeded sampling, with and without stop strings
    (taken from the greedy text, so that some do stop), on completions and chat."""
    ar = httpx.post(f"{server}/v1/completions", json={"prompt": "The quick", "max_tokens": 30, "temperature": 0,
                                                      "ignore_eos": True, "method": "ar"}, timeout=30).json()
    text = ar["choices"][0]["text"]
    stops = [s for i in (5, 12) if "\ufffd" not in (s := text[i:i + 2])] or ["zz"]
    methods = [("ar", None), ("dflash", None), ("ddtree", 1), ("ddtree", 8), ("ddtree", 32), ("ddtree", "auto")]
    requests = []
    for i in range(24):
        method, budget = methods[i % 6]
        body = {"max_tokens": 16 + i % 3 * 4, "temperature": (0.0, 0.7, 1.3)[i // 6 % 3] if i < 18 else 0.9,
                "method": method, "budget": budget, "ignore_eos": True, "seed": 100 + i // 6}
        if i % 4 == 1:
            body["stop"] = stops
        if i >= 18:
            body["top_k"], body["top_p"] = 20, 0.9
        if i % 5 == 2:
            body["messages"] = [{"role": "user", "content": "The quick"}]
        else:
            body["prompt"] = "The quick"
        requests.append(body)
    return requests


def test_concurrent_responses_equal_isolated_runs(server):
    """At concurrency 8, every greedy response equals the same request run alone, and every seeded sampled
    one too (the engine promises it: docs/engine-api.md, Sampling); seeded responses also agree across methods."""
    requests = mixed_requests(server)

    async def run_all() -> list[dict]:
        limit = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=server, timeout=httpx.Timeout(60.0)) as client:
            async def one(body: dict) -> dict:
                async with limit:
                    r = await client.post("/v1/chat/completions" if "messages" in body else "/v1/completions",
                                          json=body)
                assert r.status_code == 200, r.text
                return r.json()
            return await asyncio.wait_for(asyncio.gather(*(one(b) for b in requests)), timeout=120)

    def answer(r: dict) -> tuple:
        c = r["choices"][0]
        return c.get("text", (c.get("message") or {}).get("content")), c["finish_reason"], c["matched_stop"], \
            r["usage"]["completion_tokens"]

    concurrent = asyncio.run(run_all())
    alone = [httpx.post(f"{server}/v1/{'chat/' if 'messages' in b else ''}completions", json=b, timeout=30).json()
             for b in requests]
    for body, a, b in zip(requests, concurrent, alone):
        assert answer(a) == answer(b), body
    by_sampler = {}
    for body, r in zip(requests, concurrent):
        key = tuple(sorted((k, str(v)) for k, v in body.items() if k not in ("method", "budget")))
        by_sampler.setdefault(key, set()).add(answer(r))
    assert all(len(answers) == 1 for answers in by_sampler.values())
    drafted = [(b["temperature"], r["ddscope"]) for b, r in zip(requests, concurrent) if b["method"] != "ar"]
    greedy = [x for t, x in drafted if t == 0]
    assert sum(x["committed_tokens"] for x in greedy) > 1.5 * sum(x["verify_steps"] for x in greedy)
    assert sum(x["committed_tokens"] - x["verify_steps"] for t, x in drafted if t > 0) > 0  # sampled drafts accepted


# --- endpoints and logs -------------------------------------------------------------------------

def test_models_and_health(server, model):
    assert httpx.get(f"{server}/health").status_code == 200
    models = httpx.get(f"{server}/v1/models").json()
    card = models["data"][0]
    assert models == {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "root": card["root"],
                                                  "owned_by": "ddscope", "max_model_len": 2048, "dtype": "float32"}]}
    assert (Path(card["root"]) / "config.json").is_file()  # the bench's floor reads the model from it
    assert httpx.get(f"{server}/v1/models/{model}").json()["id"] == model


def test_health_is_503_until_the_engine_is_attached(tiny_pair):
    app = create_app()
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        assert client.get("/metrics").status_code == 200
        attach_engine(app, Engine.load(*tiny_pair))
        assert client.get("/health").json() == {"status": "ok"}
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_request_and_decode_log_lines(server, caplog):
    with caplog.at_level(logging.INFO, logger="ddscope.server"):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": "log me", "max_tokens": 5, "ignore_eos": True},
                       timeout=30).json()
        assert wait_for(lambda: any(m.startswith("decode ") for m in caplog.messages), timeout=5)
    line = next(m for m in caplog.messages if f"id={r['id']}" in m)
    fields = dict(kv.split("=", 1) for kv in line.split()[1:])
    assert fields["status"] == "finished" and fields["completion_tokens"] == "5"
    assert {"verify_steps", "avg_commit", "tok_s", "prompt_tokens", "e2e_ms"} <= set(fields)
    decode = next(m for m in caplog.messages if m.startswith("decode "))
    assert "avg_commit=" in decode and "gen_tok_s=" in decode


def test_cli_registers_serve():
    parser = argparse.ArgumentParser(prog="ddscope")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--budget", "auto", "--port", "0", "--max-queue", "4"])
    assert args.func is cli._run and args.budget == "auto" and args.max_queue == 4
    assert args.host == "127.0.0.1" and args.method is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--budget", "0"])


# --- cancellation, back-pressure, timeouts, shutdown (paced engine) -----------------------------

LONG = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "method": "ar"}


def test_streaming_disconnect_cancels_the_generation(paced):
    """That it ends, however fast this machine runs the paced engine; how many steps a cancel costs is
    tests/test_server_worker.py's, counted in steps."""
    engine, url = paced
    before, steps0 = scrape(url), engine.steps
    with httpx.Client(timeout=10) as client, client.stream("POST", f"{url}/v1/completions",
                                                           json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
    assert wait_for(lambda: moved(before, scrape(url), "ddscope:requests_total", status="cancelled") == 1, 60)
    after = scrape(url)
    assert engine.steps - steps0 < LONG["max_tokens"]
    assert moved(before, after, "ddscope:verify_steps_total") == engine.steps - steps0 - 1  # 1: the prefill's token
    assert moved(before, after, "ddscope:requests_total", status="finished") == 0
    assert after[("ddscope:num_requests_running", ())] == 0
    assert_pool_empty(engine)


def test_non_streaming_disconnect_cancels_the_generation(paced):
    engine, url = paced
    before, steps0 = scrape(url), engine.steps

    async def disconnect_once_generating() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            request = asyncio.create_task(client.post("/v1/completions", json=LONG))
            assert await asyncio.to_thread(wait_for, lambda: engine.steps > steps0, 60)
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(disconnect_once_generating())
    assert wait_for(lambda: moved(before, scrape(url), "ddscope:requests_total", status="cancelled") == 1, 60)
    assert engine.steps - steps0 < LONG["max_tokens"]
    assert moved(before, scrape(url), "ddscope:requests_total", status="finished") == 0
    assert_pool_empty(engine)


def test_full_queue_answers_503_with_retry_after(paced):
    _, url = paced
    before = scrape(url)

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            async def gauge(name: str) -> float:
                return scrape_text((await client.get("/metrics")).text)[(name, ())]

            async def until(name: str, value: float) -> None:
                for _ in range(250):
                    if await gauge(name) == value:
                        return
                    await asyncio.sleep(0.02)
                raise AssertionError(f"{name} never reached {value}")

            hold = [asyncio.create_task(client.post("/v1/completions", json=LONG))]
            await until("ddscope:num_requests_running", 1)
            hold += [asyncio.create_task(client.post("/v1/completions", json=LONG)) for _ in range(2)]
            await until("ddscope:num_requests_waiting", 2)
            rejected = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            for task in hold:  # disconnect all three
                task.cancel()
            await asyncio.gather(*hold, return_exceptions=True)
            return rejected

    r = asyncio.run(run())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "server_error"
    assert wait_for(lambda: moved(before, scrape(url), "ddscope:requests_total", status="cancelled") == 3)
    after = scrape(url)
    assert after[("ddscope:num_requests_waiting", ())] == 0 and after[("ddscope:num_requests_running", ())] == 0
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert_pool_empty(paced[0])


def test_request_timeout_running_streamed_and_queued(paced):
    _, url = paced
    before = scrape(url)
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=10) as r:
            lines.extend(line for line in r.iter_lines() if line)

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert wait_for(lambda: scrape(url)[("ddscope:num_requests_running", ())] == 1)
    queued = httpx.post(f"{url}/v1/completions", json=LONG, timeout=10)  # waits behind the stream
    streamer.join(10)

    assert queued.status_code == 408
    assert queued.json()["error"]["type"] == "timeout_error" and queued.json()["error"]["code"] == "timeout"
    assert lines[-1] == "data: [DONE]" and '"timeout_error"' in lines[-2]
    assert wait_for(lambda: moved(before, scrape(url), "ddscope:requests_total", status="timeout") == 2)
    assert_pool_empty(paced[0])


def test_shutdown_cancels_in_flight_work(tiny_pair):
    engine = PacedEngine(Engine.load(*tiny_pair), delay=0.02)
    got_first = threading.Event()
    outcome: list[BaseException | None] = []

    def stream(url: str) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=10) as r:
                for _ in r.iter_lines():
                    got_first.set()
            outcome.append(None)
        except httpx.HTTPError as e:
            outcome.append(e)

    with serve_in_background(engine=engine, shutdown_timeout=0.2) as url:  # how soon: test_server_worker.py
        client = threading.Thread(target=stream, args=(url,))
        client.start()
        assert got_first.wait(60)
    client.join(60)
    assert outcome and not client.is_alive()
    stopped_at = engine.steps
    time.sleep(0.2)
    assert engine.steps == stopped_at < LONG["max_tokens"]
    assert_pool_empty(engine)


# --- the CLI process ----------------------------------------------------------------------------

CLI = "import sys, argparse; from ddscope.server import cli; p = argparse.ArgumentParser(); " \
      "cli.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"


def run_cli(*args: str) -> subprocess.Popen:
    # One torch thread: the tiny model is fastest so, and CI's two cores are not oversubscribed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", CLI, "serve", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_cli_serves_then_stops_on_sigint(tiny_pair):
    port = free_port()
    proc = run_cli("--target", str(tiny_pair[0]), "--drafter", str(tiny_pair[1]), "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.TransportError:
                return False
        assert wait_for(healthy, timeout=60)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["ddscope"]["budget"] == "auto"  # serve's default
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "request id=cmpl-" in out and "ready" in out


def test_cli_exits_nonzero_when_the_model_cannot_load(tmp_path):
    proc = run_cli("--target", str(tmp_path / "missing"), "--port", str(free_port()))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "cannot serve" in out and "missing" in out
