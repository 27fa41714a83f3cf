"""Shapes real schemas take (JSONSchemaBench's GitHub, SchemaStore, Snowplow and Washington Post subsets) that were
refused and now compile, each exactly or narrower, never looser: oneOfs proved apart in more ways, untyped object
branches, `not` of an allOf, oneOfs served narrower, dependencies whatever the draft, and formats."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddscope.engine import Engine
from ddscope.structured.constraint import Constraint, ConstraintError
from ddscope.structured.drafts import NARROWED
from ddscope.structured.exclusive import exclusive
from ddscope.structured.formats import AS_PATTERN, enforced_format
from ddscope.structured.rewrite import portable
from ddscope.structured.schema import resources, subschemas
from ddscope.structured.unique import enforced

DRAFT4 = "http://json-schema.org/draft-04/schema#"
INSTANCES = [None, True, 0, 1, 2.5, "", "a", "x1", [], [1], {}, {"a": "x"}, {"a": "y"}, {"b": 1}, {"a": "x", "b": 1},
             {"a": "y", "b": 1}, {"site": {}}, {"app": {}}, {"site": {}, "app": {}}, {"c": 1}, {"a": 1, "c": 2}]


@pytest.fixture(scope="module")
def demo():
    return Engine.load()


def reads(schema: object) -> jsonschema.protocols.Validator:
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)


@pytest.mark.parametrize("branches, root, within, apart", [
    ([{"minimum": 0, "maximum": 1}, {"minimum": 2}], {}, {"integer"}, True),  # zcodeformat's: the node's type
    ([{"minimum": 0, "maximum": 1}, {"minimum": 2}], {}, None, False),  # untyped: "a" matches both
    ([{"type": "number", "maximum": 1}, {"type": "number", "minimum": 1}], {}, None, False),  # 1 is in both
    ([{"type": "number", "maximum": 1}, {"type": "number", "exclusiveMinimum": 1}], {}, None, True),
    ([{"type": "number", "maximum": 1, "exclusiveMaximum": True}, {"type": "number", "minimum": 1}],
     {"$schema": DRAFT4}, None, True),  # draft 4's boolean exclusiveMaximum
    ([{"type": "string", "pattern": "^Abs$"}, {"type": "string", "pattern": "^Add$"}], {}, None, True),
    ([{"type": "string", "pattern": "^Abs$"}, {"type": "string", "pattern": "^Ab"}], {}, None, False),
    ([{"type": "object", "additionalProperties": False, "properties": {"type": {"type": "string", "pattern": "^A$"}},
       "required": ["type"]},
      {"type": "object", "additionalProperties": False, "properties": {"type": {"type": "string", "pattern": "^B$"}}}],
     {}, None, True),  # a discriminator one requires and the other names
    ([{"type": "object", "anyOf": [{"required": ["a", "b"]}, {"required": ["c", "d"]}]},
      {"type": "object", "maxProperties": 1}], {}, None, True),  # composer's repositories: each branch too big
    ([{"type": "object", "anyOf": [{"required": ["a", "b"]}, {"required": ["c"]}]},
      {"type": "object", "maxProperties": 1}], {}, None, False),
    ([{"$ref": "#/definitions/s"}, {"type": "null"}], {"$schema": DRAFT4, "definitions": {"s": {"type": "string"}}},
     None, True),  # draft 4 reads types as later drafts do
    ([{"type": "integer"}, {"enum": [1.0]}], {"$schema": DRAFT4}, None, False),  # 1 is an integer and 1.0
])
def test_more_one_of_branches_are_proved_apart_and_no_overlap_is(branches, root, within, apart):
    assert exclusive(branches, root, not resources(root), within) is apart


@pytest.mark.parametrize("schema", [
    {"not": {"allOf": [{"required": ["site"]}, {"required": ["app"]}]}},  # openrtb's: not both
    {"type": "object", "not": {"allOf": [{"required": ["site"]}, {"properties": {"app": {"type": "string"}}}]}},
    {"oneOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]},  # no type: non-objects match both
               {"properties": {"b": {}}, "additionalProperties": False}]},
    {"oneOf": [{"properties": {"a": {}}}, {"required": ["b"]}, {"type": "string"}]},
    {"type": "integer", "oneOf": [{"maximum": 0}, {"minimum": 1}]},
    {"type": "string", "oneOf": [{"enum": [""]}, {"_format": "email"}]},  # an unknown keyword: a note, any string
    {"$schema": DRAFT4, "oneOf": [{"$ref": "#/definitions/s"}, {"type": "null"}],
     "definitions": {"s": {"type": "string", "const": "x"}}},  # draft 4 ignores const
])
def test_real_world_shapes_are_written_exactly(schema):
    given = portable(schema)
    assert not {"not", "oneOf"} & {k for n, _ in subschemas(given) for k in n}
    for instance in INSTANCES:
        assert reads(given).is_valid(instance) == reads(schema).is_valid(instance), (instance, given)


def test_a_one_of_whose_complements_cannot_be_written_is_served_narrower_never_looser(demo):
    schema = {"type": "object", "oneOf": [{"properties": {"a": {"type": "string", "pattern": "^x"}}, "required": ["a"]},
                                          {"required": ["b"]}]}  # tye's: open objects, each naming its own
    given = portable(schema)
    assert "oneOf" not in json.dumps(given)
    served = [i for i in INSTANCES if reads(given).is_valid(i)]
    assert all(reads(schema).is_valid(i) for i in served)
    assert {"a": "x"} in served and {"b": 1} in served and {"a": "y", "b": 1} not in served  # the narrowing
    assert not reads(given).is_valid({"a": "x", "b": 1}) and not reads(schema).is_valid({"a": "x", "b": 1})
    for backend in ("xgrammar", "guidance"):
        assert demo.grammars.compile(Constraint("json", json.dumps(schema), any_whitespace=False), backend)


@pytest.mark.parametrize("pattern", ["^[\\.\\,\\*\\\\\\-\\s\\{\\}\\(\\)]+$", "^[a-z]*$", "[0-9]", "^[A-Z]", "[ab]$"])
def test_a_not_of_a_one_class_pattern_is_served_narrower_never_looser(demo, pattern):
    schema = {"type": "string", "minLength": 1, "not": {"pattern": pattern}}  # a company officer's name (GitHub's)
    given = portable(schema)
    assert "not" not in json.dumps(given)
    words = ["", "a", "A", "..", ". a", "(-)", "x\n", "...\n", "\x1c", "ab", "b1", "Zz", "aB"]
    assert all(reads(schema).is_valid(w) for w in words if reads(given).is_valid(w))
    assert any(reads(given).is_valid(w) for w in words)
    compiled = demo.grammars.compile(Constraint("json", json.dumps({"type": "object", "properties": {"n": schema},
                                                                    "required": ["n"]}), any_whitespace=False))
    out = demo.generate("x", max_new_tokens=60, method="ddtree", constraint=compiled, temperature=0)
    if out.finish_reason == "stop":
        assert reads(schema).is_valid(json.loads(out.text)["n"])


def test_what_was_narrowed_is_never_complemented():
    twice = {"not": {"not": {"pattern": "^[a-z]+$"}}}  # the complement of a narrowed part would be looser
    assert "not" in portable(twice)
    one_of = {"type": "object", "oneOf": [{"properties": {"a": {"type": "string", "pattern": "^x"}},
                                           "required": ["a"]}, {"required": ["b"]}]}
    assert "not" in portable({"not": one_of})


def test_property_dependencies_are_applied_whatever_the_draft():
    schema = {"type": "object", "additionalProperties": False, "dependencies": {"cost": ["model"]},
              "properties": {"cost": {"type": "number"}, "model": {"enum": ["cpc", "cpm"]}}}  # Snowplow's, no $schema
    given = portable(schema)
    draft7 = jsonschema.Draft7Validator(schema)
    for instance in ({}, {"cost": 1}, {"cost": 1, "model": "cpc"}, {"model": "cpm"}):
        assert reads(given).is_valid(instance) == draft7.is_valid(instance)
        assert not reads(given).is_valid(instance) or reads(schema).is_valid(instance)  # only narrower


def test_formats_no_draft_defines_are_left_out_and_defined_ones_kept_or_written():
    assert enforced_format({"type": "string", "format": "ports"}, "") == {"type": "string"}
    assert enforced_format({"type": "number", "format": "float"}, "") == {"type": "number"}  # BFCL's
    assert enforced_format({"format": "date-time"}, "") == {"format": "date-time"}
    assert enforced_format({"format": "iri"}, "") == {"format": "uri", "$comment": NARROWED}  # never complemented
    assert enforced_format({"format": "host-name"}, "http://json-schema.org/draft-03/schema#") == \
        {"format": "host-name"}  # draft 3's own: refused by the backends, not dropped
    assert enforced_format({"format": "regex", "pattern": "^a"}, "") == \
        {"pattern": "^a", "allOf": [{"pattern": AS_PATTERN["regex"]}], "$comment": NARROWED}
    assert enforced_format({"format": "json-pointer"}, "") == \
        {"pattern": AS_PATTERN["json-pointer"], "$comment": NARROWED}


@pytest.mark.parametrize("name", sorted(AS_PATTERN))
def test_every_string_a_format_s_pattern_matches_has_that_format(name):
    check = jsonschema.FormatChecker()
    assert name in check.checkers  # checked independently, by jsonschema's format extras

    @settings(max_examples=300, suppress_health_check=list(HealthCheck), deadline=None, derandomize=True)
    @given(st.from_regex(AS_PATTERN[name], fullmatch=True))
    def holds(text: str) -> None:
        assert check.conforms(text, name), text
    holds()


def test_formats_are_served_valid_by_both_backends(demo):
    names = [*sorted(AS_PATTERN), "ports"]  # written as patterns, and one no draft defines
    schema = {"type": "object", "additionalProperties": False, "required": names,
              "properties": {n: {"type": "string", "format": n} for n in names}}
    for backend in ("xgrammar", "guidance"):
        compiled = demo.grammars.compile(Constraint("json", json.dumps(schema), any_whitespace=False), backend)
        out = demo.generate("Write one JSON value that follows the schema.\n", max_new_tokens=300,
                            method="ddtree", constraint=compiled, temperature=0)
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema, format_checker=jsonschema.FormatChecker())


def test_a_refusal_names_the_keyword_even_where_narrowing_left_nothing(demo):
    closed = {"type": "object", "required": ["kind"], "properties": {"kind": {"type": "string", "pattern": "^(a|b)"}}}
    schema = {"oneOf": [closed, closed]}  # every instance matches both: nothing to serve, exactly or narrower
    with pytest.raises(ConstraintError, match=re.escape("oneOf at $")):
        demo.grammars.compile(Constraint("json", json.dumps(schema), any_whitespace=False))


def test_a_recursive_ref_beside_keywords_its_draft_ignores_compiles_under_guidance(demo):
    node = {"type": "object", "properties": {"c": {"$ref": "#/definitions/n", "type": "object"}}}
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", **node, "definitions": {"n": node}}
    assert demo.grammars.compile(Constraint("json", json.dumps(schema), any_whitespace=False), "guidance")
    assert portable({**schema, "$schema": "https://json-schema.org/draft/2020-12/schema"})["properties"]["c"] == \
        {"$ref": "#/definitions/n", "type": "object"}  # later drafts apply a $ref's siblings: kept


def test_keywords_beside_a_loop_back_to_the_root_are_written_into_its_branches(demo):
    schema = {"$schema": "http://json-schema.org/draft-04/schema", "type": "object", "additionalProperties": {},
              "anyOf": [{"$ref": "#/definitions/list"}, {"$ref": "#/definitions/text"}],
              "definitions": {  # Washington Post's: "#" loops back to the root, beside its own keywords
                  "list": {"type": "object", "additionalProperties": False, "required": ["type"],
                           "properties": {"type": {"enum": ["list"]},
                                          "items": {"type": "array", "items": {"$ref": "#"}}}},
                  "text": {"type": "object", "additionalProperties": False, "required": ["type", "content"],
                           "properties": {"type": {"enum": ["text"]}, "content": {"type": "string"}}}}}
    compiled = demo.grammars.compile(Constraint("json", json.dumps(schema), any_whitespace=False))
    assert compiled.backend == "xgrammar"  # additionalProperties {} merged as true, into each branch
    out = demo.generate("x", max_new_tokens=80, method="ddtree", constraint=compiled, temperature=0)
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), schema)


D7 = "http://json-schema.org/draft-07/schema#"
NEVER_LOOSER = [  # (schema, an instance it refuses): a review's fuzzer found each served looser, now each is not
    ({"$schema": DRAFT4, "not": {"const": "a"}}, "b"),  # draft 4 has no const: not {} refuses all
    ({"not": {"const": "a\n"}}, "a\n"),  # Python's `$` reads "a\n" as "a"
    ({"not": {"type": "string", "pattern": "[\\n]"}}, "a\n"),
    ({"not": {"type": "string", "pattern": "^[\\s]+$"}}, "\n"),
    ({"not": {"type": "string", "pattern": "[\\s]$"}}, "x\n"),
    ({"oneOf": [{"not": {"pattern": "^[a]*$"}}, {"const": " "}]}, " "),  # apart only once narrowed
    ({"oneOf": [{"const": "abc"}, {"type": "string", "format": "json-pointer"}]}, "abc"),
    ({"not": {"format": "json-pointer"}}, "abc"),  # a format as a pattern is narrower: under not, looser
    ({"not": {"dependencies": {"a": ["b"]}}}, {"a": 1}),  # 2020-12 ignores dependencies
    ({"$schema": DRAFT4, "not": {"if": {"required": ["a"]}, "then": {"required": ["b"]}}}, {"a": 1}),
    ({"$schema": D7, "not": {"dependentRequired": {"a": ["b"]}}}, {"a": 1}),
    ({"$schema": DRAFT4, "not": {"propertyNames": {"pattern": "^a"}}}, {"b": 1}),
    ({"if": {"dependencies": {"kind": ["b"]}}, "then": {"type": "string"}, "not": {"type": "number"}}, {"kind": "a"}),
    ({"oneOf": [{"type": "number", "maximum": 0, "exclusiveMaximum": True}, {"type": "number", "minimum": 0}]}, 0),
    ({"$schema": DRAFT4, "oneOf": [{"type": "number", "exclusiveMinimum": 5}, {"type": "number", "maximum": 0}]}, -1),
    ({"$schema": DRAFT4, "oneOf": [{"enum": [1]}, {"not": {"type": "integer"}}]}, 1.0),  # 1.0: both, in draft 4
]


@pytest.mark.parametrize("schema, instance", NEVER_LOOSER)
def test_nothing_narrowed_is_read_the_other_way_round(schema, instance):
    assert not reads(schema).is_valid(instance)
    assert not reads(portable(schema)).is_valid(instance), portable(schema)


def test_keyed_arrays_of_two_branches_keep_both_keys():
    by = [{"type": "array", "uniqueItems": True, "items": {"type": "object", "additionalProperties": False,
                                                           "required": [k], "properties": {k: {"type": "string"}}}}
          for k in ("id", "name")]
    plan = enforced({"anyOf": by})[1]
    assert plan is not None and plan.rule(()).keys == {"id", "name"}


def test_a_one_of_of_arrays_overlapping_only_when_empty_is_served_without_the_empty_one(demo):
    schema = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "number"}},  # a Vega-Lite domain
                        {"type": "array", "items": {"type": "string"}}]}
    given = portable(schema)
    assert "oneOf" not in json.dumps(given)
    for instance in ("x", [1], ["a"], [], [1, "a"], None):
        assert not reads(given).is_valid(instance) or reads(schema).is_valid(instance), instance
    assert all(reads(given).is_valid(i) for i in ("x", [1, 2], ["a"]))
    assert demo.grammars.compile(Constraint("json", json.dumps({"type": "object", "properties": {"d": schema},
                                                                "required": ["d"]}), any_whitespace=False))
