"""Agents' requests through `ddscope serve` on the demo pair: every structured-outputs spelling (OpenAI's, vLLM's,
the older guided_*), tool calls (required, named; streamed too; the formats themselves in test_tool_parsers.py) with the openai SDK, bad constraints
refused without harm, and the surface a team exposes (keys, names, /version, /ping, usage for n > 1)."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from ddscope.engine import Engine
from ddscope.structured.constraint import Constraint
from ddscope.engine.limits import MAX_WHITESPACE
from ddscope.server.constraints import StructuredOutputsConfig
from ddscope.server.launch import serve_in_background
from ddscope.server.state import Surface

KEY = "sk-test-key"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "pattern": "[A-Z][a-z]{1,11}"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


class Person(BaseModel):
    name: str = Field(pattern="[A-Z][a-z]{1,9}")
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def demo():
    return Engine.load()


@pytest.fixture(scope="module")
def server(demo):
    surface = Surface(api_keys=(KEY, "second-key"), served_model_names=("Qwen/Qwen3-8B", "demo"),
                      structured_outputs=StructuredOutputsConfig("xgrammar", disable_any_whitespace=True),
                      tool_parser="hermes")
    with serve_in_background(engine=demo, budget=32, surface=surface) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


SPELLINGS = [  # (request fields, the constraint the engine is asked for)
    ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, Constraint("choice", '["yes", "no", "maybe"]')),
    ({"guided_choice": ["yes", "no", "maybe"]}, Constraint("choice", '["yes", "no", "maybe"]')),
    ({"structured_outputs": {"regex": "[a-z]{3,6}-[0-9]{2}"}}, Constraint("regex", "[a-z]{3,6}-[0-9]{2}")),
    ({"guided_regex": "[a-z]{3,6}-[0-9]{2}"}, Constraint("regex", "[a-z]{3,6}-[0-9]{2}")),
    ({"structured_outputs": {"grammar": 'root ::= "def " [a-z]{1,8} "(" [a-z]? ")"'}},
     Constraint("grammar", 'root ::= "def " [a-z]{1,8} "(" [a-z]? ")"')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                 "schema": Person.model_json_schema()}}},
     Constraint("json", json.dumps(Person.model_json_schema(), sort_keys=False), any_whitespace=False)),
    ({"guided_json": Person.model_json_schema()}, Constraint("json", json.dumps(Person.model_json_schema()),
                                                             any_whitespace=False)),
]


@pytest.mark.parametrize("fields,constraint", SPELLINGS, ids=lambda x: next(iter(x)) if isinstance(x, dict) else "")
def test_every_spelling_constrains_as_the_engine_does_under_every_method(client, demo, fields, constraint):
    """The served text equals the engine's own `ar` under the constraint the fields name, for ar, dflash and
    ddtree alike, and it matches the constraint."""
    prompt = "def fib(n):"
    want = demo.generate(prompt, max_new_tokens=48, method="ar", constraint=constraint, temperature=0)
    assert want.finish_reason == "stop"
    accepted = 0
    for method in ("ar", "dflash", "ddtree"):
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=48, temperature=0,
                                      extra_body={**fields, "method": method})
        assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop", method
        accepted += r.model_extra["ddscope"]["committed_tokens"] - r.model_extra["ddscope"]["verify_steps"]
        assert r.model_extra["ddscope"]["grammar_masks"] > 0
    assert accepted > 0


def test_the_sdk_parses_a_pydantic_model(client):
    r = client.chat.completions.parse(model="Qwen/Qwen3-8B", messages=[{"role": "user", "content": "A person?"}],
                                      response_format=Person, temperature=0, max_tokens=40)
    assert r.model == "Qwen/Qwen3-8B" and r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Person)
    assert " " not in r.choices[0].message.content  # the server's disable_any_whitespace


def test_a_streamed_constraint_concatenates_to_the_whole(client):
    body = dict(model="demo", prompt="x = ", max_tokens=40, temperature=0,
                extra_body={"structured_outputs": {"json": {"type": "object", "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]}}})
    whole = client.completions.create(**body).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices]
    assert "".join(parts) == whole and 0 <= json.loads(whole)["a"] <= 99


def test_tools_required_named_and_a_round_trip(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    # one call: under hermes' own format the demo model would call on until max_tokens (its EOS never wins)
    r = client.chat.completions.create(model="demo", messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert len(call.id) >= 9 and call.type == "function"
        assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments),
                                                                                dict)
    named = client.chat.completions.create(model="demo", messages=msgs, tools=[WEATHER, TIME], temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=120)
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert re.fullmatch("[A-Z][a-z]{1,11}", json.loads(call.function.arguments)["city"])
    follow = msgs + [named.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = client.chat.completions.create(model="demo", messages=follow, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=16)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_a_streamed_named_tool_sends_its_name_once_and_arguments_that_concatenate(client):
    kw = dict(model="demo", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    deltas = [tc for c in client.chat.completions.create(**kw, stream=True) if c.choices
              for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments


def test_auto_without_a_parser_is_refused_as_vllm_refuses_it(demo):
    with serve_in_background(engine=demo, budget=8) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "tools": [WEATHER], "max_tokens": 4})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]


BAD = [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"json": '{"type": "object"'}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}, "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "x\u0000"}, "guided_regex"),
]


def test_malformed_constraints_are_400s_that_leave_the_server_whole(server, client, demo):
    rss = _rss()
    headers = {"Authorization": f"Bearer {KEY}"}
    for fields, param in BAD:
        r = httpx.post(server + "/v1/completions", headers=headers, timeout=60,
                       json={"prompt": "hi", "max_tokens": 4, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
    assert httpx.get(server + "/health").status_code == 200
    assert _rss() < rss + 64 * 2**20
    good = client.completions.create(model="demo", prompt="def f", max_tokens=12, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "[a-z]{2,5}"}})
    assert good.choices[0].text == demo.generate("def f", max_new_tokens=12, temperature=0,
                                                 constraint=Constraint("regex", "[a-z]{2,5}")).text


def _rss() -> int:
    """This process's resident bytes (the server runs on its threads)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_keys_names_and_the_open_endpoints(server):
    r = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(server + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    models = httpx.get(server + "/v1/models", headers={"Authorization": "Bearer second-key"}).json()
    assert [m["id"] for m in models["data"]] == ["Qwen/Qwen3-8B", "demo"]
    for path in ("/health", "/ping", "/version", "/metrics"):
        assert httpx.get(server + path).status_code == 200, path
    assert httpx.post(server + "/ping").status_code == 200
    assert httpx.get(server + "/version").json()["version"]
    assert "ddscope:grammar_masks_total" in httpx.get(server + "/metrics").text


def test_n_choices_count_the_prompt_once(client):
    one = client.completions.create(model="demo", prompt="def add(a, b):", max_tokens=4, temperature=0.8, seed=1)
    four = client.completions.create(model="demo", prompt="def add(a, b):", max_tokens=4, temperature=0.8, seed=1,
                                     n=4)
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    assert four.usage.completion_tokens == sum(1 for _ in four.choices) * 4


def test_a_request_chat_template_is_used(client, demo):
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"chat_template": "{{ messages[0]['content'] }} says:",
                                                   "return_token_ids": True}, temperature=0)
    assert r.model_extra["prompt_token_ids"] == demo.tokenizer.encode("hi says:", add_special_tokens=False)


TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<fn="], "at_least_one": True, "stop_after_first": True,
    "tags": [{"begin": "<fn=add>", "content": {"type": "regex", "pattern": "[0-9]{1,2}"}, "end": "</fn>"}]}}
LEGACY_TAG = {"type": "structural_tag", "triggers": ["<fn="], "structures": [
    {"begin": "<fn=add>", "schema": {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]},
     "end": "</fn>"}]}


def test_structural_tags_in_both_formats_and_n_choices_under_one_constraint(client, demo):
    r = client.completions.create(model="demo", prompt="def add(a, b):", max_tokens=30, temperature=0,
                                  extra_body={"response_format": TAG})
    assert re.fullmatch(r"<fn=add>[0-9]{1,2}</fn>", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == demo.generate("def add(a, b):", max_new_tokens=30, temperature=0, method="ar",
                                              constraint=Constraint("structural_tag", json.dumps(TAG))).text
    legacy = client.completions.create(model="demo", prompt="x = add(", max_tokens=40, temperature=0,
                                       extra_body={"structured_outputs": {"structural_tag": json.dumps(LEGACY_TAG)}})
    text = legacy.choices[0].text
    assert "<fn=" not in text or re.search(r"<fn=add>\s*\{\s*\"a\"\s*:\s*[12]\s*\}\s*</fn>", text), text
    many = client.completions.create(model="demo", prompt="Pick:", max_tokens=8, temperature=1.0, seed=3, n=4,
                                     extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert len(many.choices) == 4 and all(c.text in ("red", "green", "blue") for c in many.choices)


class Weather(BaseModel):
    """WEATHER's parameters, held as the grammar holds them (no properties beyond those named)."""
    model_config = {"extra": "forbid"}
    city: str = Field(pattern="^[A-Z][a-z]{1,11}$")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_response_format_beside_a_forced_tool_is_a_call_under_the_tools_parameters(client, tool_choice):
    """openai-agents sends both for an agent with an output_type: the forced call is this turn, as vLLM answers."""
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       tools=[WEATHER], tool_choice=tool_choice, temperature=0, max_tokens=120,
                                       parallel_tool_calls=False,  # the demo model would call on under hermes
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "strict": True, "schema": Person.model_json_schema()}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    Weather.model_validate_json(call.function.arguments)


@pytest.fixture(scope="module")
def default_client(demo):
    """A server at its defaults: no structured-outputs config, so JSON's free whitespace is only bounded."""
    with serve_in_background(engine=demo, budget=32, surface=Surface(served_model_names=("demo",))) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_json_finishes_at_the_servers_defaults(default_client):
    """The demo target fills free whitespace with newlines: without the default bound this runs to max_tokens (the
    SDK's LengthFinishReasonError)."""
    r = default_client.chat.completions.parse(model="demo", messages=[{"role": "user", "content": "A person?"}],
                                              response_format=Person, temperature=0, max_tokens=400)
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Person)
    stretches = re.findall(r"\s+", r.choices[0].message.content)
    assert stretches and max(map(len, stretches)) <= MAX_WHITESPACE
    named = default_client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER], temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=400)
    assert named.choices[0].finish_reason == "tool_calls"
    Weather.model_validate_json(named.choices[0].message.tool_calls[0].function.arguments)


def test_the_default_bound_admits_pretty_printed_json(demo):
    """A newline and 20 spaces: json.dumps(indent=2) to depth 10 fits, one more character of whitespace does not."""
    import xgrammar as xgr

    deep: object = 1
    for level in range(10):  # objects and arrays, ten deep
        deep = {"a": deep, "b": "c d"} if level % 2 else [deep, 2]
    text = json.dumps(deep, indent=2)
    assert max(map(len, re.findall(r"\s+", text))) == MAX_WHITESPACE
    assert StructuredOutputsConfig().max_whitespace == MAX_WHITESPACE
    for kind, spec in (("json_object", ""), ("json", json.dumps({"type": "object"}))):
        grammar = demo.grammars.compile(Constraint(kind, spec, max_whitespace=MAX_WHITESPACE)).grammar
        assert xgr.GrammarMatcher(grammar).accept_string(text), kind
        assert not xgr.GrammarMatcher(grammar).accept_string("{" + " " * (MAX_WHITESPACE + 1) + "}"), kind
    assert StructuredOutputsConfig.parse('{"max_whitespace_cnt": null}').max_whitespace is None
    assert StructuredOutputsConfig.parse('{"max_whitespace_cnt": 4}').max_whitespace == 4
    with pytest.raises(ValueError, match="max_whitespace_cnt"):
        StructuredOutputsConfig.parse('{"max_whitespace_cnt": 0}')
