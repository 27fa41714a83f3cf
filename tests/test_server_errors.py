"""Malformed requests against a live `ddscope serve`: each gets its documented 4xx in the OpenAI error
shape, and the server answers a valid request right after it."""
from __future__ import annotations

import json

import httpx
import pytest

from ddscope.server.launch import serve_in_background

MAX_BODY = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def client(tiny_engine):
    with serve_in_background(engine=tiny_engine) as url, httpx.Client(base_url=url, timeout=30) as c:
        yield c


def completion(**fields):
    return ("POST", "/v1/completions", {"json": {"prompt": "Hello", "max_tokens": 4, **fields}})


def chat(**fields):
    return ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 4, **fields}})


def raw(path, content, headers=None):
    return ("POST", path, {"content": content, "headers": {"content-type": "application/json", **(headers or {})}})


def oversized_chunks():
    # A chunked body (no Content-Length), so only the check while reading can catch it.
    chunk = b" " * (1 << 20)
    for _ in range(MAX_BODY // len(chunk) + 2):
        yield chunk


# (case id, request, expected status, expected `param` or None)
CASES = [
    ("not-json", raw("/v1/completions", b"{nope"), 400, None),
    ("json-array", raw("/v1/completions", b"[1, 2]"), 400, None),
    ("deeply-nested", raw("/v1/completions", b"[" * 100_000), 400, None),
    ("nan-temperature", raw("/v1/completions", b'{"prompt": "x", "temperature": NaN}'), 400, "temperature"),
    ("lone-surrogate-prompt", raw("/v1/completions", b'{"prompt": "\\ud800x"}'), 400, "prompt"),
    ("missing-prompt", ("POST", "/v1/completions", {"json": {"max_tokens": 4}}), 400, "prompt"),
    ("empty-prompt", completion(prompt=""), 400, "prompt"),
    ("empty-token-list", completion(prompt=[]), 400, "prompt"),
    ("batched-prompts-streamed", completion(prompt=["a", "b"], stream=True), 400, None),
    ("batched-prompts-over-cap", completion(prompt=["a"] * 65), 400, "prompt"),
    ("batch-with-bad-token-list", completion(prompt=["a", [1, "b"]]), 400, "prompt"),
    ("prompt-number", completion(prompt=5), 400, "prompt"),
    ("bool-token-id", completion(prompt=[True, 3]), 400, "prompt"),
    ("token-id-over-vocab", completion(prompt=[1, 10**6]), 400, "prompt"),
    ("negative-token-id", completion(prompt=[1, -1]), 400, "prompt"),
    ("max-tokens-string", completion(max_tokens="16"), 400, "max_tokens"),
    ("max-tokens-float", completion(max_tokens=1.5), 400, "max_tokens"),
    ("max-tokens-zero", completion(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", completion(max_tokens=-3), 400, "max_tokens"),
    ("max-tokens-huge", completion(max_tokens=10**9), 400, "max_tokens"),
    ("prompt-plus-max-tokens-over-context", completion(prompt=[5] * 2040, max_tokens=16), 400, "max_tokens"),
    ("prompt-fills-context", completion(prompt=[5] * 2048, max_tokens=1), 400, "prompt"),
    ("min-tokens-over-max", completion(min_tokens=10), 400, "min_tokens"),
    ("temperature-negative", completion(temperature=-0.5), 400, "temperature"),
    ("temperature-string", completion(temperature="hot"), 400, "temperature"),
    ("top-p-zero", completion(top_p=0), 400, "top_p"),
    ("top-p-over-one", completion(top_p=1.5), 400, "top_p"),
    ("top-k-below-minus-one", completion(top_k=-2), 400, "top_k"),
    ("top-k-float", completion(top_k=2.5), 400, "top_k"),
    ("seed-negative", completion(seed=-1), 400, "seed"),
    ("stop-number", completion(stop=5), 400, "stop"),
    ("stop-empty-string", completion(stop=[""]), 400, "stop"),
    ("stop-too-many", completion(stop=[str(i) for i in range(17)]), 400, "stop"),
    ("stop-too-long", completion(stop=["x" * 257]), 400, "stop"),
    ("stop-token-ids-over-vocab", completion(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    ("logit-bias-over-100", completion(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit-bias-key-not-id", completion(logit_bias={"hello": 1}), 400, "logit_bias"),
    ("logit-bias-over-vocab", completion(logit_bias={"1000000": 1}), 400, "logit_bias"),
    ("logit-bias-superscript-key", completion(logit_bias={"\u00b2": 1}), 400, "logit_bias"),
    ("logit-bias-arabic-digit-key", completion(logit_bias={"\u0661": 1}), 400, "logit_bias"),
    ("logit-bias-5000-digit-key", completion(logit_bias={"9" * 5000: 1}), 400, "logit_bias"),
    ("chat-tool-call-without-function", chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]),
     400, "messages"),
    ("stream-options-unknown", completion(stream=True, stream_options={"continuous_usage_stats": True}), 400,
     "stream_options"),
    ("min-p-over-one", completion(min_p=1.5), 400, "min_p"),
    ("prompt-over-char-cap", completion(prompt="x" * (32 * 2048 + 1)), 400, "prompt"),
    ("stream-string", completion(stream="yes"), 400, "stream"),
    ("stream-options-without-stream", completion(stream_options={"include_usage": True}), 400, None),
    ("ignore-eos-string", completion(ignore_eos="true"), 400, "ignore_eos"),
    ("unknown-method", completion(method="beam"), 400, "method"),
    ("budget-zero", completion(budget=0), 400, "budget"),
    ("budget-string", completion(budget="lots"), 400, "budget"),
    ("budget-huge", completion(budget=10**6), 400, "budget"),
    ("n-two-greedy", completion(n=2, temperature=0), 400, None),
    ("n-over-cap", completion(n=17), 400, "n"),
    ("prompts-times-n-over-cap", completion(prompt=["a"] * 8, n=9), 400, None),
    ("logprobs-over-20", completion(logprobs=21), 400, "logprobs"),
    ("chat-continue-and-generation-prompt", chat(continue_final_message=True), 400, None),
    ("chat-template-kwargs-tokenize", chat(chat_template_kwargs={"tokenize": True}), 400, None),
    ("chat-top-logprobs-without-logprobs", chat(top_logprobs=2), 400, None),
    ("response-format-schema-missing", completion(response_format={"type": "json_schema"}), 400, "response_format"),
    ("regex-unclosed", completion(structured_outputs={"regex": "(x"}), 400, "structured_outputs"),
    ("tools-auto-without-parser", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tool_choice"),
    ("functions", chat(functions=[{"name": "f"}]), 400, "functions"),
    ("function-call", chat(function_call="auto"), 400, "function_call"),
    ("presence-penalty-over-2", completion(presence_penalty=2.5), 400, "presence_penalty"),
    ("frequency-penalty-under-2", completion(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition-penalty-zero", completion(repetition_penalty=0.0), 400, "repetition_penalty"),
    ("best-of-below-n", completion(best_of=1, n=2), 400, None),
    ("best-of-streamed", completion(best_of=3, stream=True), 400, None),
    ("allowed-token-ids-empty", completion(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("allowed-token-ids-out-of-vocab", completion(allowed_token_ids=[10**7]), 400, "allowed_token_ids"),
    ("bad-words-empty-string", completion(bad_words=[""]), 400, None),
    ("prompt-logprobs-streamed", completion(prompt_logprobs=1, stream=True), 400, None),
    ("truncate-prompt-tokens-zero", completion(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens"),
    ("truncate-prompt-tokens-huge", completion(truncate_prompt_tokens=10**6), 400, "truncate_prompt_tokens"),
    ("cache-salt-slash", completion(cache_salt="a/b"), 400, "cache_salt"),
    ("suffix", completion(suffix="x"), 400, "suffix"),
    ("beam-search", completion(use_beam_search=True), 400, "use_beam_search"),
    ("unknown-field", completion(temprature=0.5), 400, "temprature"),
    ("tokenize-lone-surrogate", raw("/tokenize", b'{"prompt": "\\ud800x"}'), 400, "prompt"),
    ("chat-missing-messages", ("POST", "/v1/chat/completions", {"json": {"max_tokens": 4}}), 400, "messages"),
    ("chat-empty-messages", chat(messages=[]), 400, "messages"),
    ("chat-bad-role", chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    ("chat-image-part", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages"),
    ("chat-content-number", chat(messages=[{"role": "user", "content": 7}]), 400, "messages"),
    ("chat-max-completion-tokens-negative", chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
    ("unknown-model", completion(model="gpt-5"), 404, "model"),
    ("unknown-model-card", ("GET", "/v1/models/gpt-5", {}), 404, "model"),
    ("unknown-route", ("POST", "/v1/embeddings", {"json": {"input": "x"}}), 404, None),
    ("wrong-http-method", ("GET", "/v1/completions", {}), 405, None),
    ("body-over-limit", raw("/v1/completions", b" " * (MAX_BODY + 1)), 413, None),
    ("chunked-body-over-limit", raw("/v1/completions", oversized_chunks()), 413, None),
]


@pytest.mark.parametrize("method,path,kwargs,status,param", [(*c[1], c[2], c[3]) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_malformed_request_gets_openai_error(client, method, path, kwargs, status, param):
    r = client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    # The server keeps serving.
    ok = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 1


def test_table_is_large_enough():
    assert len(CASES) >= 25


def test_validation_errors_never_leak_fastapi_shape(client):
    r = client.post("/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400
    assert "detail" not in r.json()
    assert json.loads(r.text)["error"]["code"] == "invalid_parameter"


def test_ignored_fields_and_neutral_values_of_refused_ones_are_accepted(client):
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "user": "u1", "metadata": {"k": "v"},
            "store": False, "n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
            "response_format": {"type": "text"}, "logit_bias": {}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    plain = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
