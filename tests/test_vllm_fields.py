"""vLLM's request fields over HTTP, as vLLM 0.32 answers them (shapes cited in docs/server.md): n and best_of as
sequences of the batch, return_token_ids, prompt_logprobs, truncate_prompt_tokens, the rendering flags, the
chat template's switches and echo, cache_salt. Outputs under ddtree equal the engine's `ar` (the oracle drafter
is really accepted)."""
from __future__ import annotations

import json

import httpx
import pytest

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.server.launch import serve_in_background

PROMPT = "def add(a, b):"
CHAT = [{"role": "user", "content": "Hello, how are"}]


@pytest.fixture(scope="module")
def oracle(tiny_engine):
    return oracle_engine(tiny_engine)


@pytest.fixture(scope="module")
def url(oracle):
    with serve_in_background(engine=oracle) as base:
        yield base


def post(url: str, path: str, **body) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, **body) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_n_choices_are_seeded_children_equal_to_ar(url, oracle):
    body = dict(prompt=PROMPT, max_tokens=12, temperature=0.9, seed=40, n=3, ignore_eos=True, return_token_ids=True)
    out = post(url, "/v1/completions", **body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for i, choice in enumerate(out["choices"]):  # child i is seeded seed + i, as vLLM's parallel sampling
        want = oracle.generate(PROMPT, max_new_tokens=12, method="ar", temperature=0.9, seed=40 + i, ignore_eos=True)
        assert choice["token_ids"] == want.token_ids and choice["text"] == want.text
    assert out["usage"]["completion_tokens"] == 36 and len(out["ddscope"]) == 3
    assert any(r["avg_commit"] > 1.2 for r in out["ddscope"])  # drafts were accepted
    chunks = stream(url, "/v1/completions", **body)
    assert all(len(c["choices"]) <= 1 for c in chunks)  # one choice a chunk (vLLM's shape)
    texts = {i: "" for i in range(3)}
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] += choice["text"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in out["choices"]]
    assert "ddscope" in chunks[-1]


def test_best_of_returns_the_likeliest_per_token(url, oracle):
    body = dict(prompt=PROMPT, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    runs = [oracle.generate(PROMPT, max_new_tokens=10, method="ar", temperature=1.0, seed=7 + i, ignore_eos=True,
                            logprobs=0) for i in range(4)]
    best = max(runs, key=lambda g: sum(lp.logprob for lp in g.logprobs) / len(g.logprobs))
    out = post(url, "/v1/completions", best_of=4, **body)
    assert len(out["choices"]) == 1 and out["choices"][0]["text"] == best.text
    assert out["choices"][0]["logprobs"] is None  # ranked by log-probs, not asked for: none returned


def test_return_token_ids_completions_and_chat(url, oracle):
    out = post(url, "/v1/completions", prompt=PROMPT, max_tokens=8, temperature=0, return_token_ids=True)
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == oracle.encode(PROMPT)
    assert choice["token_ids"] == oracle.generate(PROMPT, max_new_tokens=8, method="ar").token_ids
    echoed = post(url, "/v1/completions", prompt=PROMPT, max_tokens=8, temperature=0, return_token_ids=True,
                  echo=True)["choices"][0]
    assert echoed["text"] == choice["text"]  # vLLM: with token ids, the echoed prompt's text is ""
    chat = post(url, "/v1/chat/completions", messages=CHAT, max_tokens=8, temperature=0, return_token_ids=True)
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    chunks = stream(url, "/v1/chat/completions", messages=CHAT, max_tokens=8, temperature=0, return_token_ids=True)
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == \
        chat["choices"][0]["token_ids"]


def test_prompt_logprobs_in_vllms_shape(url, oracle):
    ids = oracle.encode(PROMPT)
    out = post(url, "/v1/completions", prompt=PROMPT, max_tokens=4, temperature=0, prompt_logprobs=2)
    plp = out["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for token, entry in zip(ids[1:], plp[1:]):
        first = next(iter(entry))
        assert first == str(token) and entry[first]["rank"] >= 1 and entry[first]["decoded_token"] is not None
        assert {1, 2} <= {v["rank"] for v in entry.values()} and len(entry) in (2, 3)
    chat = post(url, "/v1/chat/completions", messages=CHAT, max_tokens=4, temperature=0, prompt_logprobs=0)
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_truncate_prompt_tokens_keeps_the_last(url, oracle):
    ids = oracle.encode("The quick brown fox jumps over the lazy dog.")
    cut = post(url, "/v1/completions", prompt=ids, max_tokens=6, temperature=0, truncate_prompt_tokens=4)
    tail = post(url, "/v1/completions", prompt=ids[-4:], max_tokens=6, temperature=0)
    assert cut["usage"]["prompt_tokens"] == 4 and cut["choices"][0]["text"] == tail["choices"][0]["text"]


def test_rendering_flags(url, oracle):
    special = oracle.tokenizer.convert_tokens_to_ids("<|im_start|>")
    plain = oracle.tokenizer.encode("fox", add_special_tokens=False)
    body = dict(prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True, allowed_token_ids=[special, *plain])
    skipped = post(url, "/v1/completions", **body)["choices"][0]["text"]
    kept = post(url, "/v1/completions", skip_special_tokens=False, **body)["choices"][0]["text"]
    assert "<|im_start|>" in kept and "<|im_start|>" not in skipped
    base = post(url, "/v1/completions", prompt=PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    stop = base[3:6]
    cut = post(url, "/v1/completions", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])["choices"][0]
    held = post(url, "/v1/completions", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                include_stop_str_in_output=True)["choices"][0]
    assert cut["text"] == base[:base.index(stop)] and held["text"] == base[:base.index(stop) + len(stop)]
    assert post(url, "/v1/completions", prompt=PROMPT, max_tokens=4, temperature=0, add_special_tokens=False,
                spaces_between_special_tokens=False)["usage"]["prompt_tokens"] == len(oracle.encode(PROMPT))


def test_chat_template_switches_and_echo(url):
    def prompt_tokens(**kw) -> int:
        return post(url, "/v1/chat/completions", messages=CHAT, max_tokens=2, temperature=0, **kw)["usage"][
            "prompt_tokens"]
    base = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > base  # the template saw it
    assert prompt_tokens(add_generation_prompt=False) < base
    partial = CHAT + [{"role": "assistant", "content": "I am"}]
    out = post(url, "/v1/chat/completions", messages=partial, max_tokens=4, temperature=0,
               add_generation_prompt=False, continue_final_message=True, echo=True)
    assert out["choices"][0]["message"]["content"].startswith("I am")
    chunks = stream(url, "/v1/chat/completions", messages=partial, max_tokens=4, temperature=0,
                    add_generation_prompt=False, continue_final_message=True, echo=True)
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text == out["choices"][0]["message"]["content"]
    no_echo = post(url, "/v1/chat/completions", messages=CHAT, max_tokens=4, temperature=0, echo=True)
    assert not no_echo["choices"][0]["message"]["content"].startswith(CHAT[-1]["content"])  # last role is user


def test_cache_salt_keeps_tenants_apart(url, oracle):
    ids = [10 + (13 * i) % 290 for i in range(200)]
    def cached(**kw) -> int:
        return post(url, "/v1/completions", prompt=ids, max_tokens=2, temperature=0, **kw)["usage"][
            "prompt_tokens_details"]["cached_tokens"]
    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0  # unsalted requests share nothing with salted ones


def test_priority_orders_admission(oracle):
    from pathlib import Path

    from ddscope.engine import Engine
    engine = Engine(oracle.target, oracle.drafter, oracle.tokenizer, Path(oracle.source), max_model_len=oracle.max_model_len,
                    max_num_seqs=1)
    seqs = [engine.sequence(PROMPT, method="ar", max_new_tokens=2, ignore_eos=True, priority=p) for p in (5, -1, 0)]
    order = []
    for s in seqs:
        engine.add(s)
    while engine.busy:
        engine.step()
        order += [s.priority for s in engine.scheduler.running if s.priority not in order]
    assert order == [-1, 0, 5]
