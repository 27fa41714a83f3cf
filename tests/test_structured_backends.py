"""Honest constraints: every schema keyword is enforced by the backend that compiles it or refused with its
keyword and path; xgrammar and llguidance behind one interface, chosen by `--structured-outputs-config`'s
backend (`auto` falls back per schema); the compiled grammar travels with the request to the engine."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from ddscope.engine import Engine
from ddscope.server.constraints import StructuredOutputsConfig
from ddscope.server.launch import serve_in_background
from ddscope.server.state import Surface
from ddscope.structured.compiler import Grammars
from ddscope.structured.constraint import Constraint, ConstraintError
from ddscope.structured.schema import MAX_NESTING

FIXTURES = Path(__file__).parent / "fixtures" / "schemas"
CODE = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}},
        "required": ["code"], "additionalProperties": False}
ONE_OF = {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}},
          "required": ["n"]}


@pytest.fixture(scope="module")
def demo():
    return Engine.load()


def json_c(schema: object) -> Constraint:
    return Constraint("json", json.dumps(schema), any_whitespace=False)


def test_pattern_with_a_length_is_enforced_by_guidance_or_refused_by_name(demo):
    with pytest.raises(ConstraintError, match=re.escape("maxLength at $.properties.code")):
        demo.grammars.compile(json_c(CODE), "xgrammar")
    compiled = demo.grammars.compile(json_c(CODE), "auto")
    assert compiled.backend == "guidance"
    m = compiled.matcher()
    ids = demo.tokenizer.encode('{"code":"abcd"', add_special_tokens=False)
    assert not all(m.accept(t) for t in ids)  # the fourth letter is refused


def test_one_of_is_refused_by_xgrammar_and_enforced_by_guidance(demo):
    with pytest.raises(ConstraintError, match=re.escape("oneOf at $.properties.n is read as anyOf")):
        demo.grammars.compile(json_c(ONE_OF), "xgrammar")
    assert demo.grammars.compile(json_c(ONE_OF), "guidance").backend == "guidance"


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "guidance"])
def test_an_external_ref_is_refused_with_its_path(demo, backend):
    schema = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    with pytest.raises(ConstraintError, match=re.escape("$ref at $.properties.a")):
        demo.grammars.compile(json_c(schema), backend)


def test_keywords_nobody_enforces_are_refused_by_name_under_auto(demo):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(ConstraintError, match=re.escape("uniqueItems at $.properties.tags")):
        demo.grammars.compile(json_c(schema))


def test_a_property_named_additional_properties_compiles(demo):
    schema = json.loads((FIXTURES / "Snowplow" / "additional_properties_named.json").read_text())
    compiled = demo.grammars.compile(json_c(schema), "xgrammar")
    out = demo.generate("An id:", max_new_tokens=32, constraint=compiled, method="ar")
    assert "additionalProperties" not in json.loads(out.text)
    assert demo.grammars.compile(json_c(schema), "guidance")


def _nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for i in range(levels):
        schema = {"type": "array", "items": schema} if i % 2 else {"type": "object", "properties": {"x": schema}}
    return schema


def test_the_nesting_limit_counts_the_output_s_levels(demo):
    assert demo.grammars.compile(json_c(_nested(MAX_NESTING)), "xgrammar")
    with pytest.raises(ConstraintError, match=f"nest objects and arrays {MAX_NESTING + 1} levels deep; at most "
                                              f"{MAX_NESTING}"):
        demo.grammars.compile(json_c(_nested(MAX_NESTING + 1)))


def test_greedy_ddtree_equals_ar_under_guidance_with_drafts_accepted(demo):
    committed = steps = 0
    for prompt in ("A record:", "def f(x):", "Hello"):
        for schema in (CODE, ONE_OF):
            compiled = demo.grammars.compile(json_c(schema), "guidance")
            ref = demo.generate(prompt, max_new_tokens=48, method="ar", constraint=compiled)
            for budget in (8, 32):
                out = demo.generate(prompt, max_new_tokens=48, method="ddtree", budget=budget, constraint=compiled)
                assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
                committed, steps = committed + out.stats.committed_tokens, steps + out.stats.verify_steps
    assert committed / steps > 1.5


def test_a_guidance_matcher_rolls_back_across_its_stop(demo):
    """A stop taken where the grammar cannot go on is one token, as xgrammar counts it."""
    m = demo.grammars.compile(Constraint("choice", '["Hello world"]'), "guidance").matcher()
    ids = demo.tokenizer.encode("Hello world", add_special_tokens=False)
    assert all(m.accept(t) for t in ids) and not m.is_terminated()
    eos = next(iter(demo.eos_ids))
    assert m.accept(eos) and m.is_terminated() and not m.accept(ids[0])
    m.rollback(1)
    assert not m.is_terminated() and m.accept(eos)
    m.rollback(2)
    assert m.accept(ids[-1])


def test_the_engine_never_compiles_a_compiled_request(demo, monkeypatch):
    compiled = demo.grammars.compile(json_c(CODE))
    monkeypatch.setattr(Grammars, "compile", lambda *a, **k: pytest.fail("compiled on the engine's thread"))
    assert demo.generate("x", max_new_tokens=8, constraint=compiled).token_ids


@pytest.mark.parametrize("backend,status,by", [("xgrammar", 400, "maxLength"), ("guidance", 200, None),
                                               ("auto", 200, None)])
def test_the_backend_is_chosen_by_the_structured_outputs_config(demo, backend, status, by):
    config = StructuredOutputsConfig.parse(json.dumps({"backend": backend, "disable_any_whitespace": True}))
    with serve_in_background(engine=demo, budget=8, surface=Surface(structured_outputs=config)) as url:
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": "A code:", "max_tokens": 24, "temperature": 0, "structured_outputs": {"json": CODE}})
    assert r.status_code == status, r.text
    if by:
        error = r.json()["error"]
        assert error["param"] == "structured_outputs" and "maxLength at $.properties.code" in error["message"]
    else:
        code = json.loads(r.json()["choices"][0]["text"])["code"]
        assert re.fullmatch("[a-z]{0,3}", code)
    with pytest.raises(ValueError, match="one of auto, xgrammar, guidance"):
        StructuredOutputsConfig.parse('{"backend": "outlines"}')


def test_the_coverage_benchmark_runs_on_the_fixture_corpus():
    import importlib.util

    spec = importlib.util.spec_from_file_location("schema_coverage", Path(__file__).parents[1] / "benchmarks" /
                                                  "structured" / "schema_coverage.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main([str(FIXTURES), "--backends", "xgrammar,auto", "--sample", "2", "--max-tokens", "64"])
    by = {(r["backend"], Path(r["schema"]).stem): r for r in rows}
    assert not by["xgrammar", "pattern_maxlength"]["compiled"] and by["auto", "pattern_maxlength"]["by"] == "guidance"
    assert not by["auto", "external_ref"]["compiled"] and "$.properties.target" in by["auto", "external_ref"]["refused"]
    assert by["xgrammar", "additional_properties_named"]["compiled"]
    sampled = [r for r in rows if "finished" in r]
    assert sampled and all(r["valid"] for r in sampled if r["finished"])
