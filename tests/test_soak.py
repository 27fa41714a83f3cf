"""A bounded soak of `ddscope serve` on 127.0.0.1: 208 requests at concurrency 16, mixing greedy, seeded
sampled and streamed requests of every method, streams the client drops midway, and malformed requests.
Every valid answer equals the same request run alone, every malformed one gets a 4xx in the OpenAI
error shape, /health stays 200, memory stays bounded, and /metrics accounts for every request sent."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from test_server import scrape

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.server.launch import serve_in_background
from support.runs import TINY_PROMPTS

CONCURRENCY, REQUESTS = 16, 208
DEADLINE_S = 240  # the whole soak, its isolated reruns aside
MALFORMED = [
    {"prompt": "x", "temperature": -1},
    {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}},
    {"prompt": "x", "stop": ["y" * 300]},
    {"prompt": [1, 10**7]},
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "tempreature": 0.5},
    {"prompt": "x", "presence_penalty": 3.0},
    {"messages": "hi"},
]


def request(i: int, rng: random.Random) -> tuple[str, dict]:
    """(kind, body) of the i-th request: kind is greedy, sampled, stream, dropped or malformed."""
    kind = rng.choice(["greedy", "greedy", "sampled", "stream", "dropped", "malformed"])
    if kind == "malformed":
        return kind, MALFORMED[i % len(MALFORMED)]
    body = {"prompt": f"{rng.choice(TINY_PROMPTS)} {i}", "max_tokens": rng.randint(4, 40),
            "method": rng.choice(["ar", "dflash", "ddtree"]), "temperature": 0}
    if kind == "sampled":
        body |= {"temperature": 0.8, "seed": i, "top_p": 0.9}
    if rng.random() < 0.2:
        body["stop"] = [" the"]
    if kind in ("stream", "dropped"):
        body |= {"stream": True, "max_tokens": 60 if kind == "dropped" else body["max_tokens"]}
    return kind, body


async def send(client: httpx.AsyncClient, kind: str, body: dict) -> dict:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body.get("stream"):
        r = await client.post(path, json=body)
        return {"status": r.status_code, "body": r.json()}
    text, finish = "", None
    async with client.stream("POST", path, json=body) as r:
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            events += 1
            if kind == "dropped" and events == 2:
                return {"status": r.status_code, "dropped": True}  # leaving the block closes the connection
    return {"status": r.status_code, "body": {"choices": [{"text": text, "finish_reason": finish}]}}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def same_answer(a: dict, b: dict) -> bool:
    (ca,), (cb,) = a["choices"], b["choices"]
    return ca["text"] == cb["text"] and ca["finish_reason"] == cb["finish_reason"]


@pytest.mark.slow
@pytest.mark.timeout(2 * DEADLINE_S)
def test_soak_concurrency_16(tiny_engine):
    rng = random.Random(0)
    plan = [request(i, rng) for i in range(REQUESTS)]
    with serve_in_background(engine=oracle_engine(tiny_engine), log_interval=1.0) as url:
        before = scrape(url)

        async def soak() -> tuple[list[dict], list[int], list[float]]:
            gate = asyncio.Semaphore(CONCURRENCY)
            health: list[int] = []
            rss: list[float] = []
            async with httpx.AsyncClient(base_url=url, timeout=60,
                                         limits=httpx.Limits(max_connections=CONCURRENCY + 2)) as client:
                async def one(i: int, kind: str, body: dict) -> dict:
                    async with gate:
                        result = await send(client, kind, body)
                    if i % 16 == 0:
                        health.append((await client.get("/health")).status_code)
                        rss.append(rss_mb())
                    return result
                results = await asyncio.wait_for(
                    asyncio.gather(*(one(i, k, b) for i, (k, b) in enumerate(plan))), DEADLINE_S)
            return results, health, rss

        results, health, rss = asyncio.run(soak())
        assert health and set(health) == {200}
        assert max(rss) - rss[1] < 200  # after the first requests have warmed the process up

        valid = 0
        with httpx.Client(base_url=url, timeout=60) as client:
            for (kind, body), result in zip(plan, results):
                if kind == "malformed":
                    assert 400 <= result["status"] < 500, result
                    assert set(result["body"]["error"]) == {"message", "type", "param", "code"}
                    continue
                assert result["status"] == 200, result
                if kind == "dropped":
                    continue
                alone = client.post("/v1/completions", json={**body, "stream": False}).json()
                assert same_answer(result["body"], alone), (body, result, alone)
                valid += 1
        assert valid > REQUESTS // 2
        assert httpx.get(f"{url}/health").status_code == 200
        after = scrape(url)
    sent = REQUESTS + valid  # the soak, then each valid one again alone
    counted = sum(after.get(k, 0) - before.get(k, 0) for k in after
                  if k[0] in ("ddscope:requests_total", "ddscope:rejected_requests_total"))
    assert counted == sent
    malformed = sum(kind == "malformed" for kind, _ in plan)
    rejected = sum(after.get(k, 0) - before.get(k, 0) for k in after if k[0] == "ddscope:rejected_requests_total")
    assert rejected == malformed
