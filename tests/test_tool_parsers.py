"""The tool-call formats of the families users serve (`--tool-call-parser`, vLLM's names): each reads one and two
calls whole and streamed (the name once, argument deltas that concatenate), keeps the content before a call, and
renders forced calls as a grammar in its own format that accepts a call and refuses a wrong one. Through `ddscope
serve` on the demo pair, `required` comes back a valid call in every format, and a tool named `required` is a name."""
from __future__ import annotations

import json
import random

import httpx
import pytest
import xgrammar as xgr

from ddscope.cli import build_parser
from ddscope.structured.constraint import Constraint
from ddscope.server.constraints import StructuredOutputsConfig
from ddscope.server.launch import serve_in_background
from ddscope.server.state import Surface
from ddscope.structured.tool_choice import Tool, ToolChoice
from ddscope.structured.tool_parsers import PARSERS, Whitespace, parser_for

WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                               "required": ["city", "days"]})
TIME = Tool("get_time", {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]})
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]


def _qwen3_coder(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


# Each format's text for a list of calls, as its family's template writes it (cited in each module's docstring).
WRITE = {
    "hermes": lambda calls: "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>'
                                      for n, a in calls),
    "llama3_json": lambda calls: "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a})
                                                             for n, a in calls),
    "mistral": lambda calls: "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls]),
    "qwen3_coder": lambda calls: "\n".join(_qwen3_coder(n, a) for n, a in calls),
    "kimi_k2": lambda calls: "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)) + "<|tool_calls_section_end|>",
    "deepseek_v31": lambda calls: "<｜tool▁calls▁begin｜>" + "".join(
        f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in calls)
        + "<｜tool▁calls▁end｜>",
}


def test_the_registry_is_the_six_formats_and_each_writes_its_own():
    assert set(PARSERS) == set(WRITE) == {"hermes", "llama3_json", "mistral", "qwen3_coder", "kimi_k2",
                                          "deepseek_v31"}


def _parser(name: str, choice: ToolChoice = ToolChoice("auto"), parallel: bool = True):
    return parser_for(name, [WEATHER, TIME], choice, parallel)


@pytest.mark.parametrize("name", sorted(WRITE))
@pytest.mark.parametrize("n", [1, 2])
def test_whole_output_gives_the_calls_and_the_content_before_them(name, n):
    content, calls = _parser(name).extract("Let me check. " + WRITE[name](CALLS[:n]))
    assert content == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS[:n]
    assert len({c.id for c in calls}) == n and all(c.id.startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.parametrize("name", sorted(WRITE))
def test_plain_text_and_a_cut_call_are_content(name):
    whole = WRITE[name](CALLS[:1])
    assert _parser(name).extract("No tools needed.") == ("No tools needed.", [])
    cut = "Sure. " + whole[:len(whole) * 2 // 3]
    assert _parser(name).extract(cut) == (cut, [])


@pytest.mark.parametrize("name", sorted(WRITE))
@pytest.mark.parametrize("seed", range(3))
def test_streamed_names_come_once_and_arguments_concatenate(name, seed):
    text = "Let me check. " + WRITE[name](CALLS)
    rng, stream, deltas, i = random.Random(seed), _parser(name).stream(), [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        deltas += stream.feed(text[i:i + k])
        i += k
    last, called = stream.finish()
    deltas += last
    assert called
    assert "".join(d.get("content", "") for d in deltas) == "Let me check. "
    names: dict[int, list[str]] = {}
    args: dict[int, str] = {}
    for tc in (tc for d in deltas for tc in d.get("tool_calls", [])):
        if "name" in tc.get("function", {}):
            names.setdefault(tc["index"], []).append(tc["function"]["name"])
        args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
    assert names == {0: ["get_weather"], 1: ["get_time"]}
    _, whole = _parser(name).extract(text)
    assert [args[0], args[1]] == [c.arguments for c in whole]
    assert [json.loads(args[i]) for i in (0, 1)] == [a for _, a in CALLS]


@pytest.fixture(scope="module")
def grammars(tiny_engine):
    return tiny_engine.grammars


def _accepts(grammars, tag: dict, text: str) -> bool:
    text = text.removeprefix("<|python_tag|>")  # Llama's forced calls are bare JSON, as its JSON template has them
    matcher = xgr.GrammarMatcher(grammars.compile(Constraint("structural_tag", json.dumps(tag))).grammar)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("name", sorted(WRITE))
def test_the_forced_grammar_is_the_format(grammars, name):
    def tag(choice: ToolChoice, parallel: bool = True) -> dict:
        return _parser(name, choice, parallel).grammar(Whitespace(bound=21))

    required, named = tag(ToolChoice("required")), tag(ToolChoice.named("get_time"))
    assert _accepts(grammars, required, WRITE[name](CALLS))
    assert _accepts(grammars, named, WRITE[name](CALLS[1:]))
    assert not _accepts(grammars, named, WRITE[name](CALLS[:1]))  # another tool than the one named
    assert not _accepts(grammars, required, WRITE[name]([("get_time", {"zone": "PST"})]))  # outside the schema
    assert not _accepts(grammars, required, WRITE[name]([("get_date", {"zone": "UTC"})]))  # no such tool
    assert not _accepts(grammars, tag(ToolChoice("required"), parallel=False), WRITE[name](CALLS))  # one only
    assert not _accepts(grammars, required, "Sure. " + WRITE[name](CALLS))  # a forced turn is calls only


def test_the_flag_takes_the_six_and_an_unknown_name_is_an_error_naming_them(capsys):
    for name in PARSERS:
        assert build_parser().parse_args(["serve", "--tool-call-parser", name]).tool_call_parser == name
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "--tool-call-parser" in err and "pythonic" in err
    assert all(n in err for n in PARSERS)


@pytest.fixture(scope="module")
def demo():
    from ddscope.engine import Engine
    return Engine.load()


CITY = {"type": "string", "pattern": "[A-Z][a-z]{1,11}"}  # bounded: the demo model never ends a free string
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    **WEATHER.parameters, "properties": {**WEATHER.parameters["properties"], "city": CITY}}}}
REQUIRED_TOOL = {"type": "function", "function": {"name": "required", "parameters": TIME.parameters}}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_format_serves_a_required_and_a_named_call(demo, name):
    surface = Surface(structured_outputs=StructuredOutputsConfig(disable_any_whitespace=True), tool_parser=name)
    with serve_in_background(engine=demo, budget=32, surface=surface) as url:
        def call(tool_choice, tools) -> dict:
            # one call: the demo model never chooses to stop calling where a format lets calls go on
            body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": tools,
                    "tool_choice": tool_choice, "parallel_tool_calls": False, "temperature": 0, "max_tokens": 300}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        choice = call("required", [WEATHER_TOOL])
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [tc] = choice["message"]["tool_calls"]
        args = json.loads(tc["function"]["arguments"])
        assert tc["function"]["name"] == "get_weather" and set(args) == {"city", "days"}
        assert isinstance(args["city"], str) and isinstance(args["days"], int)
        # a tool literally named "required", chosen by name, is that tool, not the mode
        choice = call({"type": "function", "function": {"name": "required"}}, [WEATHER_TOOL, REQUIRED_TOOL])
        [tc] = choice["message"]["tool_calls"]
        assert tc["function"]["name"] == "required"
        assert json.loads(tc["function"]["arguments"])["zone"] in ("UTC", "CET")
