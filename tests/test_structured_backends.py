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
from ddscope.structured.exclusive import exclusive
from ddscope.structured.rewrite import portable
from ddscope.structured.schema import MAX_NESTING, combined_beside, loose_values, resources, subschemas
from ddscope.structured.xgrammar_backend import prepared, schema_gaps

FIXTURES = Path(__file__).parent / "fixtures" / "schemas"
CODE = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}},
        "required": ["code"], "additionalProperties": False}
ONE_OF = {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}},
          "required": ["n"]}
OVERLAPPING = {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer", "minimum": 0},
                                                                {"type": "number", "maximum": 9}]}}, "required": ["n"]}


@pytest.fixture(scope="module")
def demo():
    return Engine.load()


def json_c(schema: object) -> Constraint:
    return Constraint("json", json.dumps(schema), any_whitespace=False)


def takes(demo: Engine, matcher: object, text: str) -> bool:
    """Whether the matcher accepts every token of `text` (left as it was)."""
    ids = demo.tokenizer.encode(text, add_special_tokens=False)
    taken = 0
    for t in ids:
        if not matcher.accept(t):
            break
        taken += 1
    matcher.rollback(taken)
    return taken == len(ids)


def test_pattern_with_a_length_is_enforced_by_guidance_or_refused_by_name(demo):
    with pytest.raises(ConstraintError, match=re.escape("maxLength at $.properties.code")):
        demo.grammars.compile(json_c(CODE), "xgrammar")
    compiled = demo.grammars.compile(json_c(CODE), "auto")
    assert compiled.backend == "guidance"
    m = compiled.matcher()
    ids = demo.tokenizer.encode('{"code":"abcd"', add_special_tokens=False)
    assert not all(m.accept(t) for t in ids)  # the fourth letter is refused


def test_a_ref_beside_other_keywords_is_a_gap_for_xgrammar_but_where_the_draft_ignores_them(demo):
    """xgrammar follows a $ref and drops what stands beside it: azure-pipelines' `"enum": [...]` beside `"$ref":
    "#/definitions/string"` let any string through. Drafts after 7 apply both, so that is a gap (guidance applies
    both); draft 7 ignores a $ref's siblings, as xgrammar does."""
    schema = {"type": "object", "properties": {"m": {"$ref": "#/$defs/s", "enum": ["a", "b"]}}, "required": ["m"],
              "$defs": {"s": {"type": "string"}}}
    with pytest.raises(ConstraintError, match=re.escape("$ref at $.properties.m beside other keywords")):
        demo.grammars.compile(json_c(schema), "xgrammar")
    m = demo.grammars.compile(json_c(schema), "auto").matcher()
    assert takes(demo, m, '{"m":"a"}') and not takes(demo, m, '{"m":"c"')
    seven = demo.grammars.compile(json_c({**schema, "$schema": "http://json-schema.org/draft-07/schema#"}),
                                  "xgrammar").matcher()
    assert takes(demo, seven, '{"m":"c"}')


def test_a_ref_inside_a_resource_of_its_own_is_a_gap_for_xgrammar(demo):
    """Inside a subschema with its own `$id`, `#/$defs/x` is that resource's x (a string here); xgrammar reads it
    against the document's root (an integer) and served 1. An `$id` that is a plain fragment is an anchor, not a
    resource."""
    inner = {"$id": "https://example.com/inner", "$defs": {"x": {"type": "string"}}, "type": "object",
             "properties": {"v": {"$ref": "#/$defs/x"}}, "required": ["v"]}
    schema = {"$defs": {"x": {"type": "integer"}}, "type": "object", "properties": {"in": inner}, "required": ["in"]}
    with pytest.raises(ConstraintError, match=re.escape("$ref at $.properties.in.properties.v inside a resource")):
        demo.grammars.compile(json_c(schema), "xgrammar")
    m = demo.grammars.compile(json_c(schema), "auto").matcher()
    assert takes(demo, m, '{"in":{"v":"a"}}') and not takes(demo, m, '{"in":{"v":1')
    anchored = {**schema, "properties": {"in": {**inner, "$id": "#inner"}}}
    assert demo.grammars.compile(json_c(anchored), "xgrammar").backend == "xgrammar"


def test_a_one_of_whose_branches_may_overlap_is_refused_by_name(demo):
    """1 to 9 match both branches: xgrammar would read the oneOf as anyOf, and llguidance cannot tell them apart."""
    with pytest.raises(ConstraintError, match=re.escape("oneOf at $.properties.n is read as anyOf")):
        demo.grammars.compile(json_c(OVERLAPPING), "xgrammar")
    with pytest.raises(ConstraintError, match=re.escape("oneOf at $.properties.n")):
        demo.grammars.compile(json_c(OVERLAPPING), "auto")


def test_a_one_of_of_exclusive_branches_compiles_under_both_backends_and_holds(demo):
    """Branches no instance can match twice (apart types here) make oneOf anyOf exactly: xgrammar enforces it."""
    assert demo.grammars.compile(json_c(ONE_OF), "guidance").backend == "guidance"
    m = demo.grammars.compile(json_c(ONE_OF), "xgrammar").matcher()
    assert takes(demo, m, '{"n":12}') and takes(demo, m, '{"n":"abcd"}')
    assert not takes(demo, m, '{"n":"abcde"') and not takes(demo, m, '{"n":true')


@pytest.mark.parametrize("values, kept", [
    ({"type": "array", "items": {"type": "string"}, "enum": ["a", "b"]}, None),  # BFCL's extract_parameters_v1
    ({"type": "string", "enum": ["a", 1]}, '"a"'),
    ({"type": "integer", "const": 1.5}, None),
    ({"type": "integer", "enum": [1, 5], "minimum": 3}, "5"),
    ({"allOf": [{"type": "string"}], "enum": ["a", 1]}, '"a"'),
])
def test_values_the_rest_of_their_schema_refuses_are_never_served(demo, values, kept):
    """xgrammar takes a const's or an enum's values and drops every keyword beside them (its type, a minimum): it
    is given the values the rest allows instead, and where none is, the refusal names where nothing matches."""
    schema = {"type": "object", "properties": {"m": values}, "required": ["m"]}
    if kept is None:
        for backend in ("xgrammar", "auto"):
            with pytest.raises(ConstraintError, match=re.escape("nothing matches $.properties.m")):
                demo.grammars.compile(json_c(schema), backend)
        return
    for backend in ("xgrammar", "guidance"):
        m = demo.grammars.compile(json_c(schema), backend).matcher()
        assert takes(demo, m, f'{{"m":{kept}}}') and not takes(demo, m, '{"m":1}')


@pytest.mark.parametrize("branches, apart", [
    ([{"type": "string", "pattern": "^a"}, {"enum": ["b", "c"]}], True),  # github-workflows' secrets
    ([{"type": "string", "pattern": "^a"}, {"enum": ["b", "ab"]}], False),
    ([{"type": "integer"}, {"type": "string"}], True),
    ([{"type": "integer"}, {"type": "number"}], False),  # 1 is both
    ([{"type": ["string", "null"]}, {"type": "null"}], False),
    ([{"type": "string"}, {"minLength": 2}], False),  # a branch without a type allows every type
    ([{"const": "a"}, {"enum": ["b", "c"]}], True),
    ([{"enum": [1, "x"]}, {"const": 1.0}], False),  # 1 and 1.0 are one JSON number
    ([{"const": True}, {"const": 1}], True),
    ([{"type": "object", "required": ["kind"], "properties": {"kind": {"const": "a"}}},
      {"type": "object", "required": ["kind", "x"], "properties": {"kind": {"enum": ["b"]}}}], True),
    ([{"type": "object", "properties": {"kind": {"const": "a"}}},  # required by neither: {} matches both
      {"type": "object", "properties": {"kind": {"const": "b"}}}], False),
    ([{"type": "object", "properties": {"kind": {"const": "a"}}},  # required by one: present, it tells them apart
      {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "b"}}}], True),
    ([{"required": ["kind"], "properties": {"kind": {"const": "a"}}},  # not objects only: "s" matches both
      {"required": ["kind"], "properties": {"kind": {"const": "b"}}}], False),
    ([{"type": "object"}, {"const": False}], True),  # codecov's `comment`: a block, or false
    ([{"type": "integer"}, {"enum": [2.0, "x"]}], False),
    ([{"anyOf": [{"type": "object"}, {"type": "array"}]}, {"type": "string"}], True),
    ([{"anyOf": [{"type": "object"}, {"minLength": 1}]}, {"type": "string"}], False),
    ([{"allOf": [{"$ref": "#/$defs/s"}, {"minLength": 1}]}, {"type": "number"}], True),
    ([{"type": "object", "properties": {"task": {}}, "required": ["task"], "additionalProperties": False},
      {"type": "object", "properties": {"defer": {}}, "required": ["defer"]}], True),  # `defer` is not A's
    ([{"type": "object", "properties": {"task": {}}, "required": ["task"]},  # open: {task, defer} matches both
      {"type": "object", "properties": {"defer": {}}, "required": ["defer"]}], False),
    ([{"type": "object", "required": ["defer"], "properties": {"defer": {"$ref": "#/$defs/s"}}},  # taskfile's
      {"type": "object", "required": ["defer"], "properties": {"defer": {"type": "object"}}}], True),
    ([{"enum": [[1]]}, {"enum": [[1.0]]}], False),  # inside arrays and objects too
    ([{"const": {"a": 1}}, {"const": {"a": 1.0}}], False),
    ([{"const": 0}, {"const": -0.0}], False),
    ([{"const": 10 ** 400}, {"const": 1}], True),
    ([{"allOf": [{"type": ["number", "string"]}, {"type": ["integer", "string"]}]}, {"type": "integer"}], False),
    ([{"$ref": "#/$defs/a%20b"}, {"type": "string"}], False),  # the pointer's percent-escapes decoded: "a b"
    ([{"type": "object", "required": [["a"]]}, {"type": "object", "required": [["a"]]}], False),  # malformed
    ([{"type": "object", "properties": [], "required": ["a"], "additionalProperties": False},
      {"type": "object", "required": ["b"]}], False),
    ([{"$ref": "#/$defs/s"}, {"$ref": "#/$defs/n"}], True),
    ([{"$ref": "#/$defs/s"}, {"$ref": "https://example.com/n.json"}], False),
    ([{"$ref": "#/$defs/loop"}, {"type": "string"}], False),
])
def test_one_of_branches_read_as_exclusive_only_where_no_instance_can_match_two(branches, apart):
    root = {"$defs": {"s": {"type": "string"}, "n": {"type": "number"}, "loop": {"$ref": "#/$defs/loop"},
                      "a b": {"type": "string"}, "a%20b": {"type": "integer"}}}
    assert exclusive(branches, root, not resources(root)) is apart


def test_refs_in_a_document_with_resources_of_its_own_are_not_read():
    """Below an `$id`, `#/...` points into that resource, not the root: no branch behind such a $ref is read."""
    inner = {"$id": "https://example.com/inner", "$defs": {"x": {"type": "string"}},
             "oneOf": [{"$ref": "#/$defs/x"}, {"type": "integer"}]}
    root = {"$defs": {"x": {"type": "string"}}, "properties": {"in": inner}}
    assert resources(root) == ["$.properties.in"] and not exclusive(inner["oneOf"], root, False)
    alone = {"$defs": {"x": {"type": "string"}}}
    assert not resources(alone) and exclusive(inner["oneOf"], alone, True)


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


def coverage_bench():
    """benchmarks/structured/schema_coverage.py, imported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("schema_coverage", Path(__file__).parents[1] / "benchmarks" /
                                                  "structured" / "schema_coverage.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bfcl_parameters_become_the_json_schema_its_openai_handlers_send(tmp_path):
    """BFCL writes Python-ish types (`dict`, `float`, `tuple`, none at all); the corpus holds what its OpenAI
    handlers send instead, which compiles and validates as JSON Schema."""
    import jsonschema

    bench = coverage_bench()
    params = {"type": "dict", "required": ["point", "scale"], "properties": {
        "point": {"type": "tuple", "items": {"type": "float"}, "description": "x, y"},
        "scale": {"type": "float", "description": "a factor"},
        "meta": {"type": "dict", "properties": {"tag": {"description": "no type"}, "n": {"type": "long"}}}}}
    schema = bench.openai_parameters(params)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["type"] == "object" and schema["properties"]["point"] == {
        "type": "array", "items": {"type": "number", "format": "float"}, "description": "x, y"}
    assert schema["properties"]["scale"] == {"type": "number", "format": "float", "description": "a factor"}
    assert schema["properties"]["meta"]["properties"] == {"tag": {"type": "string", "description": "no type"},
                                                          "n": {"type": "integer"}}
    assert params["type"] == "dict"  # the record itself untouched
    jsonschema.validate({"point": [1.5, 2], "scale": 0.5, "meta": {"tag": "a"}}, schema)
    engine = Engine.load()
    assert bench.compile_one(engine, schema, "auto")[0] is not None


def test_the_coverage_benchmark_runs_on_the_fixture_corpus():
    bench = coverage_bench()
    rows = bench.main([str(FIXTURES), "--backends", "xgrammar,auto", "--sample", "2", "--max-tokens", "64"])
    by = {(r["backend"], Path(r["schema"]).stem): r for r in rows}
    assert not by["xgrammar", "pattern_maxlength"]["compiled"] and by["auto", "pattern_maxlength"]["by"] == "guidance"
    assert not by["auto", "external_ref"]["compiled"] and "$.properties.target" in by["auto", "external_ref"]["refused"]
    assert by["xgrammar", "additional_properties_named"]["compiled"]
    sampled = [r for r in rows if "finished" in r]
    assert sampled and all(r["valid"] for r in sampled if r["finished"])


EQUIVALENT = [  # (schema, instances): what xgrammar is given must accept exactly what the schema does
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "anyOf": [{"required": ["b"]}, {"properties": {"c": {"type": "string"}}}]},
     [{"a": 1}, {"a": 1, "b": 2}, {"a": 1, "c": 2}, {"a": 1, "c": "x"}, {"c": "x"}, 5]),
    ({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 0}]}, [7, -1, 3, "s", 2.5]),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False},
                {"properties": {"b": {"type": "integer"}}}]}, [{"a": "x"}, {"b": 1}, {}, {"a": "x", "c": 1}, []]),
    ({"type": "string", "enum": ["ab", "b", 1], "pattern": "^a"}, ["ab", "b", 1, "a"]),
    ({"type": "array", "anyOf": [{"type": "object"}]}, [[], {}, 1]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "oneOf": [{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": 2}}, "required": ["k"]}]},
     [{"a": 1, "k": 1}, {"k": 1}, {"a": 1, "k": 3}, {"a": "x", "k": 2}, {"a": 1}]),
    ({"anyOf": [{"type": "object", "properties": {"t": {"enum": ["x"], "pattern": "^y"}}, "required": ["t"]},
                {"type": "string"}]}, [{"t": "x"}, "s", {}]),
]


@pytest.mark.parametrize("schema, instances", EQUIVALENT)
def test_what_xgrammar_is_given_means_what_the_schema_does_and_asserts_nothing_beside_a_combinator(schema, instances):
    """xgrammar reads a combinator alone and a const's or enum's values alone: the schema it is given has the
    keywords beside them written into them, and must accept exactly the instances the schema does."""
    import jsonschema

    given = prepared(schema)
    for instance in instances:
        assert jsonschema.Draft202012Validator(given).is_valid(instance) == \
            jsonschema.Draft202012Validator(schema).is_valid(instance), (instance, given)
    assert not [path for node, path in subschemas(given) if combined_beside(node) or loose_values(node)]


def test_keywords_beside_a_combinator_are_enforced_by_xgrammar(demo):
    schema = {"type": "object", "properties": {"n": {"type": "string", "anyOf": [{"minLength": 2}, {"maxLength": 0}]}},
              "required": ["n"]}
    m = demo.grammars.compile(json_c(schema), "xgrammar").matcher()
    assert takes(demo, m, '{"n":"ab"}') and takes(demo, m, '{"n":""}')
    assert not takes(demo, m, '{"n":5') and not takes(demo, m, '{"n":"a"}')


INSTANCES = [None, True, False, 0, 1, 2.5, "", "a", "ab", "abc", "b", "x.y", "xzy", "a\n", [], [1], {}, {"a": 1},
             {"b": 1}, {"a": 1, "b": 2}, {"a": "x"}, {"a": "x", "b": 1}, {"a": 2, "b": 1}, {"a": 2}]
NEGATIONS = [
    {"type": "object", "properties": {"a": {"not": {}}}},  # bitbucket's forbidden property
    {"not": {"required": ["a"]}},  # circle-ci's
    {"not": {"type": "object", "required": ["a", "b"]}},  # github-workflows': not both
    {"type": "object", "not": {"properties": {"a": {}}, "required": ["a"]}},  # dependabot's
    {"not": {"type": "string"}},
    {"not": {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}},
    {"not": {"enum": [None]}},
    {"not": {"const": True}},
    {"not": {"type": "object", "properties": {"a": {"type": "string"}}}},
    {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},  # exactly one of them
    {"oneOf": [{"type": "string"}, {"type": ["string", "null"]}]},  # a string matches two: only null passes
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "dependencies": {"a": ["b"]}},
    {"type": "object", "dependentSchemas": {"a": {"properties": {"b": {"type": "string"}}}}},
    {"type": "object", "properties": {"a": {"enum": [1, 2, "x"]}, "b": {}},  # github-issue-forms' conditions
     "allOf": [{"if": {"properties": {"a": {"const": "x"}}}, "then": {"required": ["b"]}},
               {"if": {"properties": {"a": {"const": 1}}, "required": ["a"]}, "else": {"properties": {"b": False}}}]},
    {"if": {"type": "string"}, "then": {"const": "a"}, "else": {"type": "object", "required": ["a"]}},
    {"type": "string", "not": {"enum": ["a", "ab", "x.y", ""]}},  # Snowplow's: any string but these
    {"not": {"enum": ["a", None, True]}},
]


@pytest.mark.parametrize("schema", NEGATIONS)
def test_not_one_of_conditions_and_dependencies_are_written_in_keywords_both_backends_read(schema):
    import jsonschema

    given = portable(schema)
    assert not {"not", "oneOf", "dependencies", "dependentSchemas", "if"} & {k for n, _ in subschemas(given) for k in n}
    for instance in INSTANCES:
        read = jsonschema.validators.validator_for(schema)  # dependencies: drafts up to 7 (later ones ignore it)
        assert read(given).is_valid(instance) == read(schema).is_valid(instance), (instance, given)


@pytest.mark.parametrize("schema", [{"not": {"type": "integer"}}, {"not": {"enum": [1, 2]}},
                                    {"not": {"pattern": "^a"}}])  # an integer's or a pattern's complement: no type
def test_a_not_no_subschema_can_write_is_refused_by_name(demo, schema):
    assert portable(schema) == schema
    with pytest.raises(ConstraintError, match=re.escape("not at $")):
        demo.grammars.compile(json_c({"type": "object", "properties": {"m": schema}}))


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_forbidden_property_is_left_out_by_both_backends(demo, backend):
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"not": {}}}, "required": ["a"]}
    m = demo.grammars.compile(json_c(schema), backend).matcher()
    assert takes(demo, m, '{"a":"x"}') and not takes(demo, m, '{"a":"x","b"')


def test_a_string_none_of_some_values_is_enforced_by_both_backends(demo):
    schema = json.loads((FIXTURES / "Snowplow" / "not.json").read_text())
    for backend in ("xgrammar", "guidance"):
        m = demo.grammars.compile(json_c(schema), backend).matcher()
        assert not takes(demo, m, '{"kind":"internal"}')
        assert takes(demo, m, '{"kind":"internals"}') and takes(demo, m, '{"kind":"intern"}')


LOOSE_IF_MERGED = [  # (schema, instances): merged naively, each let an instance through that the schema refuses
    ({"type": "object", "allOf": [{"patternProperties": {"^x": {}}}, {"additionalProperties": False}]},
     [{"x": 1}, {}, {"y": 1}]),
    ({"type": "array", "allOf": [{"prefixItems": [{"type": "string"}]}, {"items": {"type": "integer"}}]},
     [["a"], [1], []]),
    ({"const": 1, "enum": [1, 2], "type": "integer"}, [1, 2]),
    ({"components": {"A": {"$ref": "#/components/B", "minimum": 5}, "B": {"type": "integer"}},
      "allOf": [{"$ref": "#/components/A"}, {"maximum": 10}]}, [1, 7, 11]),
    ({"type": "array", "allOf": [{"contains": {"type": "string"}}, {"contains": {"type": "string"}, "minContains": 0}]},
     [[1], ["a"]]),
]


@pytest.mark.parametrize("schema, instances", LOOSE_IF_MERGED)
def test_what_xgrammar_is_given_never_takes_more_than_the_schema(schema, instances):
    """A merge that cannot be written exactly is left undone, and the node stays a gap."""
    import jsonschema

    given = prepared(portable(schema))
    if schema_gaps(given):
        return
    for instance in instances:
        assert jsonschema.Draft202012Validator(given).is_valid(instance) <= \
            jsonschema.Draft202012Validator(schema).is_valid(instance), (instance, given)


def test_odd_but_valid_schemas_are_rewritten_without_a_crash_and_draft_4_values_are_not_read_as_later():
    assert portable({"properties": {"a": True}, "if": {"properties": {"a": {"required": ["b"]}}},
                     "then": {"required": ["a"]}})
    assert prepared({"anyOf": [{"type": "object", "properties": {}, "required": [["x"]]}]})
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#"}
    assert not exclusive([{"type": "integer"}, {"enum": [1.0]}], draft4, True)
    assert not exclusive([{"const": 1}, {"const": 2}], draft4, True)  # draft 4 has no const: both match anything


def test_property_names_apply_to_the_properties_named_beside_them(demo):
    """xgrammar checks propertyNames only on properties the schema does not name: a named one whose name fails is
    left out, and a closed object, or an open one whose names need only a pattern, no longer needs the keyword."""
    import jsonschema

    schema = {"type": "object", "properties": {"ab": {"type": "integer"}, "AB": {"type": "integer"}},
              "propertyNames": {"pattern": "^[a-z]+$"}}
    given = portable(schema)
    assert "propertyNames" not in json.dumps(given)
    for instance in [{}, {"ab": 1}, {"AB": 1}, {"abc": 1}, {"Zz": 2}, 1]:
        assert jsonschema.Draft202012Validator(given).is_valid(instance) == \
            jsonschema.Draft202012Validator(schema).is_valid(instance), instance
    for backend in ("xgrammar", "guidance"):
        m = demo.grammars.compile(json_c(schema), backend).matcher()
        assert takes(demo, m, '{"ab":1}') and not takes(demo, m, '{"AB":1}')
