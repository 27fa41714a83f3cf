"""The OpenAI fields that change the output, honoured under every method: logprobs (and echo's prompt
logprobs) from the target's own verify distribution, stop_token_ids, logit_bias and min_p applied at every
tree node. Drafters here are really accepted (the oracle), so every check runs through accepted trees."""
from __future__ import annotations

import itertools
import json

import httpx
import pytest
import torch

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.server.launch import serve_in_background
from support.tolerance import assert_same_logprobs

METHODS = ("ar", "dflash", "ddtree")
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def oracle(tiny_engine):
    return oracle_engine(tiny_engine)


def reference_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: the raw log-softmax of a plain causal forward over `ids`, with no cache tricks."""
    cache = engine.target.new_cache(len(ids) + 1)
    out = engine.target(torch.tensor(ids), torch.arange(len(ids)), cache)
    return out.logits.float().log_softmax(-1)


def run(engine, method: str, **kw):
    return engine.generate(PROMPT, max_new_tokens=24, method=method, ignore_eos=True, **kw)


def assert_drafts_accepted(out) -> None:
    assert out.stats.to_dict()["avg_commit"] > 1.5  # trees were accepted: the test means something


def test_logprobs_are_the_targets_own_and_equal_under_every_method(oracle):
    outs = {m: run(oracle, m, logprobs=3) for m in METHODS}
    for m in ("dflash", "ddtree"):
        assert_drafts_accepted(outs[m])
        assert outs[m].token_ids == outs["ar"].token_ids
    prompt = oracle.encode(PROMPT)
    ref = reference_logprobs(oracle, prompt + outs["ar"].token_ids)
    for m, out in outs.items():
        assert len(out.logprobs) == len(out.token_ids)
        for k, (token, (lp, top, _)) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + k]
            assert lp == pytest.approx(row[token].item(), abs=1e-4), (m, k)
            assert [i for i, _ in top] == row.topk(3).indices.tolist()
            assert [v for _, v in top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("repeat", [1, 120])  # 120: over 512 tokens, scored in chunks
def test_prompt_logprobs_score_every_prompt_token_under_its_prefix(oracle, repeat):
    prompt = oracle.encode(PROMPT) * repeat
    out = oracle.generate(prompt, max_new_tokens=24, method="ddtree", ignore_eos=True, logprobs=0,
                          prompt_logprobs=2)
    ref = reference_logprobs(oracle, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        lp, top, rank = out.prompt_logprobs[i]
        assert rank == int((ref[i - 1] >= ref[i - 1, prompt[i]]).sum())
        assert lp == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        assert len(top) == 2
    assert out.token_ids == oracle.generate(prompt, max_new_tokens=24, method="ar", ignore_eos=True).token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logit_bias_and_min_p_are_the_targets_law_under_every_method(oracle, temperature):
    base = run(oracle, "ar", temperature=0).token_ids
    bias = {base[3]: -100.0, 17: 8.0}  # ban a token the target chose, favour another
    kw = dict(temperature=temperature, seed=5, logit_bias=bias, min_p=0.05 if temperature else 0.0)
    outs = {m: run(oracle, m, **kw) for m in METHODS}
    assert base[3] not in outs["ar"].token_ids and outs["ar"].token_ids != base
    for m in ("dflash", "ddtree"):
        assert outs[m].token_ids == outs["ar"].token_ids, m  # one law, whatever the tree
    assert sum(r.committed for r in outs["ddtree"].stats.rounds) > len(outs["ddtree"].stats.rounds)


def test_min_p_keeps_only_tokens_near_the_likeliest(oracle):
    out = run(oracle, "ddtree", temperature=1.0, seed=2, min_p=0.3)
    prompt = oracle.encode(PROMPT)
    probs = reference_logprobs(oracle, prompt + out.token_ids).exp()
    for k, token in enumerate(out.token_ids):
        row = probs[len(prompt) - 1 + k]
        assert row[token] >= 0.3 * row.max() - 1e-6


def test_stop_token_ids_end_every_method_at_the_same_token(oracle):
    base = run(oracle, "ar").token_ids
    stop = base[6]
    first = base.index(stop)
    for m in METHODS:
        out = oracle.generate(PROMPT, max_new_tokens=24, method=m, stop_token_ids=[stop])
        assert out.token_ids == base[:first + 1] and out.finish_reason == "stop", m
    late = oracle.generate(PROMPT, max_new_tokens=24, method="ddtree", stop_token_ids=[stop], min_tokens=first + 2)
    assert stop not in late.token_ids[:first + 2]  # masked below min_tokens, as EOS is


# --- the server's OpenAI shapes ----------------------------------------------------------------

@pytest.fixture(scope="module")
def server(oracle):
    with serve_in_background(engine=oracle) as url:
        yield url


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_logprobs_and_echo(server, oracle):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2}
    plain = post(server, "/v1/completions", body)["choices"][0]
    lp = plain["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    # Each token's own decode (a random target splits UTF-8 characters, so they need not join to the text).
    assert lp["text_offset"] == list(itertools.accumulate((len(t) for t in lp["tokens"][:-1]), initial=0))
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == value and value == max(top.values())  # greedy: the chosen one is the likeliest

    echo = post(server, "/v1/completions", {**body, "echo": True})["choices"][0]
    n_prompt = len(oracle.encode(PROMPT))
    assert echo["text"] == PROMPT + plain["text"]
    elp = echo["logprobs"]
    assert elp["token_logprobs"][0] is None and elp["top_logprobs"][0] is None
    assert_same_logprobs(elp["token_logprobs"][n_prompt:], lp["token_logprobs"], oracle.target.cfg.geometry,
                         n_prompt + 8, oracle.vocab_size)
    assert elp["text_offset"][n_prompt] == len(PROMPT)


def test_chat_logprobs(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    choice = post(server, "/v1/chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 6
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert entry["bytes"] == list(entry["token"].encode())


def test_streamed_logprobs_equal_the_whole_answers(server, oracle):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1, "echo": True}
    whole = post(server, "/v1/completions", body)["choices"][0]
    tokens, values, text = [], [], ""
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                values += choice["logprobs"]["token_logprobs"]
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
    assert_same_logprobs(values, whole["logprobs"]["token_logprobs"], oracle.target.cfg.geometry,
                         oracle.max_model_len, oracle.vocab_size)


def test_batched_prompts_answer_one_choice_each_as_alone(server):
    prompts = [PROMPT, "The quick brown fox"]
    batch = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})
    alone = [post(server, "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0}) for p in prompts]
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["text"] for c in batch["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert batch["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    assert isinstance(batch["ddscope"], list) and len(batch["ddscope"]) == 2


def test_max_completion_tokens_is_honoured_on_completions_too(server):
    body = {"prompt": PROMPT, "max_completion_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert post(server, "/v1/completions", body)["usage"]["completion_tokens"] == 3


# --- what real clients send: nulls for defaults, replies echoed back into the history ------------------------

def _nulls(model, *keep: str) -> dict:
    """Every optional field of the request model, and every refused or ignored one, as an explicit null."""
    from ddscope.server.schemas import IGNORED, REFUSED

    optional = [name for name, f in model.model_fields.items() if not f.is_required()]
    return {name: None for name in [*optional, *REFUSED, *IGNORED] if name not in keep}


def test_an_explicit_null_is_the_default_for_every_optional_field(server):
    from ddscope.server.schemas import ChatCompletionRequest, CompletionRequest

    for path, model, body in (("/v1/completions", CompletionRequest, {"prompt": PROMPT}),
                              ("/v1/chat/completions", ChatCompletionRequest,
                               {"messages": [{"role": "user", "content": "hi", "name": None, "tool_calls": None,
                                              "tool_call_id": None}]})):
        plain = post(server, path, {**body, "max_tokens": 6, "temperature": 0})
        nulls = post(server, path, {**_nulls(model, "max_tokens", "temperature"), **body, "max_tokens": 6,
                                    "temperature": 0})
        assert nulls["choices"] == plain["choices"], path
        post(server, path, {**_nulls(model, "max_tokens"), **body, "max_tokens": 2})  # sampled at the defaults
    nested = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": None},
              "structured_outputs": {"choice": ["yes", "no"], "json": None, "regex": None,
                                     "disable_any_whitespace": None, "whitespace_pattern": None}}
    with httpx.stream("POST", f"{server}/v1/completions", json=nested, timeout=60) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) in ("yes", "no")
    assert all(c.get("usage") is None for c in chunks)  # include_usage: null is false


def echoed_reply(**fields) -> dict:
    """An assistant message as agents append it: `resp.choices[0].message.model_dump()` (openai SDK 2.x), with
    vLLM's reasoning fields and litellm's provider_specific_fields."""
    from openai.types.chat import ChatCompletionMessage

    message = ChatCompletionMessage(role="assistant", content="It is 4.", refusal=None, annotations=[], audio=None,
                                    function_call=None, tool_calls=[], **fields).model_dump()
    return {**message, "reasoning": None, "reasoning_content": None, "provider_specific_fields": {"cached": False}}


def test_a_reply_echoed_back_into_the_history_is_accepted_as_it_was_said(server):
    history = [{"role": "user", "content": "2 + 2?"}, echoed_reply(), {"role": "user", "content": "And 3 + 3?"}]
    said = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "And 3 + 3?"}]
    body = {"max_tokens": 4, "temperature": 0, "return_token_ids": True}
    echoed = post(server, "/v1/chat/completions", {**body, "messages": history})
    assert echoed["prompt_token_ids"] == post(server, "/v1/chat/completions", {**body, "messages": said})[
        "prompt_token_ids"]
    refused = {**echoed_reply(), "content": None, "refusal": "I cannot help with that."}
    said_refusal = post(server, "/v1/chat/completions", {**body, "messages": [said[0], refused, said[2]]})
    assert said_refusal["prompt_token_ids"] == post(server, "/v1/chat/completions", {**body, "messages": [
        said[0], {"role": "assistant", "content": "I cannot help with that."}, said[2]]})["prompt_token_ids"]


def test_reasoning_in_the_history_is_rendered_where_the_template_has_a_place(server, oracle):
    template = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                "</think>{% endif %}{{ m.content }}\n{% endfor %}")
    for name in ("reasoning_content", "reasoning"):
        history = [{"role": "user", "content": "2 + 2?"}, {**echoed_reply(), name: "add them"},
                   {"role": "user", "content": "ok"}]
        r = post(server, "/v1/chat/completions", {"messages": history, "max_tokens": 2, "temperature": 0,
                                                  "chat_template": template, "return_token_ids": True})
        want = "user:2 + 2?\nassistant:<think>add them</think>It is 4.\nuser:ok\n"
        assert r["prompt_token_ids"] == oracle.tokenizer.encode(want, add_special_tokens=False), name


def test_audio_output_is_refused_by_name_and_text_modalities_are_served(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{server}/v1/chat/completions", json={**chat, "modalities": ["text", "audio"],
                                                          "audio": {"voice": "alloy", "format": "wav"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "audio", r.text
    assert r.json()["error"]["code"] == "unsupported_parameter"
    r = httpx.post(f"{server}/v1/chat/completions", json={**chat, "modalities": ["audio"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "modalities", r.text
    text_only = post(server, "/v1/chat/completions", {**chat, "modalities": ["text"], "audio": None})
    assert text_only["choices"] == post(server, "/v1/chat/completions", chat)["choices"]
