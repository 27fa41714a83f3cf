"""uniqueItems enforced beside the backends (ddscope.structured.unique): a duplicate item is never finished, as
JSON compares values; a fixed set's array never reaches a place with nowhere to go; items a veto cannot steer
keep uniqueItems refused by name; the fill and the accept agree on every token of the vocabulary."""
from __future__ import annotations

import json
import re
from decimal import Decimal

import jsonschema
import pytest
import torch

from ddscope.engine import Engine
from ddscope.structured.constraint import Constraint, ConstraintError
from ddscope.structured.json_scan import Scan, Tokens, UniqueCompiled, Veto, scan
from ddscope.structured.schema import value_key
from ddscope.structured.unique import Plan, enforced

STRINGS = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
EVENTS = {"type": "array", "items": {"enum": ["push", "pull", "tag"]}, "uniqueItems": True, "minItems": 2}
NESTED = {"type": "object", "$defs": {"names": STRINGS},
          "properties": {"a": {"anyOf": [{"$ref": "#/$defs/names"}, {"type": "null"}]},
                         "b": {"type": "array", "items": {"type": "string"}}}, "required": ["a", "b"]}


@pytest.fixture(scope="module")
def demo():
    return Engine.load()


@pytest.fixture(params=["xgrammar", "guidance"])
def backend(request):
    return request.param


def compiled(demo: Engine, schema: object, backend: str = "auto") -> UniqueCompiled:
    return demo.grammars.compile(Constraint("json", json.dumps(schema), any_whitespace=False), backend)


def ids(demo: Engine, text: str) -> list[int]:
    return demo.tokenizer.encode(text, add_special_tokens=False)


def reads(demo: Engine, matcher: object, text: str) -> bool:
    """Whether the matcher takes `text` token by token (left as it was)."""
    taken = 0
    for t in ids(demo, text):
        if not matcher.accept(t):
            break
        taken += 1
    matcher.rollback(taken)
    return taken == len(ids(demo, text))


def fill_agrees_with_accept(demo: Engine, matcher: object) -> tuple[int, int]:
    """Every token the fill allows is accepted and every one it refuses is not: (allowed, refused by the scanner
    alone)."""
    bitmask = torch.full((1, (demo.vocab_size + 31) // 32), -1, dtype=torch.int32)
    matcher.fill(bitmask)
    allowed = 0
    inner = torch.full_like(bitmask, -1)
    matcher.inner.fill(inner)
    for t in range(demo.vocab_size):
        bit = bool(bitmask[0, t >> 5] >> (t & 31) & 1)
        took = matcher.accept(t)
        if took:
            matcher.rollback(1)
        assert bit == took, (t, demo.tokenizer.decode([t]), bit)
        allowed += bit
    refused = sum(bool(inner[0, t >> 5] >> (t & 31) & 1) for t in range(demo.vocab_size)) - allowed
    return allowed, refused


def test_a_repeated_string_is_never_finished_as_json_compares_strings(demo, backend):
    m = compiled(demo, STRINGS, backend).matcher()
    assert reads(demo, m, '["ab","a","abc"]')
    assert not reads(demo, m, '["ab","a","ab"')
    assert not reads(demo, m, '["ab","a\\u0062"')  # the same string, escaped (refused by guidance's grammar too)
    assert reads(demo, m, '["ab","ab ","a\\n"]') and not reads(demo, m, '["a\\n","a\\n"')


def test_the_fill_refuses_exactly_the_tokens_that_repeat_an_item(demo, backend):
    m = compiled(demo, STRINGS, backend).matcher()
    for t in ids(demo, '["a.","a'):
        assert m.accept(t)
    allowed, refused = fill_agrees_with_accept(demo, m)
    assert allowed > 100 and refused >= 2  # `."` and `.",` close "a." again
    closing = ids(demo, '."')
    assert len(closing) == 1 and not m.accept(closing[0])


def test_a_fixed_set_never_runs_out_of_values_to_go_to(demo, backend):
    m = compiled(demo, EVENTS, backend).matcher()
    assert reads(demo, m, '["tag","push"]')
    assert not reads(demo, m, '["tag","tag"')
    for t in ids(demo, '["push","pull","tag"'):
        assert m.accept(t)
    assert not m.accept(ids(demo, ",")[0])  # a comma would need a fourth value
    assert m.accept(ids(demo, "]")[0])
    m.rollback(1 + len(ids(demo, '["push","pull","tag"')))
    for t in ids(demo, '["push","'):
        assert m.accept(t)
    allowed, refused = fill_agrees_with_accept(demo, m)
    assert allowed >= 2 and refused >= 1  # "push" again refused as it starts; "pu" may still be "pull"


def test_numbers_repeat_as_json_compares_them_and_an_integer_never_strands_at_zero(demo, backend):
    schema = {"type": "array", "items": {"type": ["number", "boolean"]}, "uniqueItems": True}
    m = compiled(demo, schema, backend).matcher()
    assert reads(demo, m, '[1,1.5,10,true]') and not reads(demo, m, '[1,1.0]') and not reads(demo, m, '[1,1 ')
    assert not reads(demo, m, '[true,t')  # a literal's start that can only repeat one
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0}, "uniqueItems": True}
    ints = compiled(demo, schema, backend).matcher()
    assert reads(demo, ints, '[0,1,10]') and not reads(demo, ints, '[0,-1') and not reads(demo, ints, '[0,0')
    for tok in ids(demo, "[0,"):
        assert ints.accept(tok)
    allowed, refused = fill_agrees_with_accept(demo, ints)
    assert refused >= 1 and not ints.accept(ids(demo, "0")[0])  # 0 again has no way on


def test_greedy_outputs_keep_items_unique_and_the_tree_equals_ar(demo):
    c = compiled(demo, EVENTS)
    plain = demo.grammars.compile(Constraint("json", json.dumps({**EVENTS, "uniqueItems": False}),
                                             any_whitespace=False))
    repeated = demo.generate("x", max_new_tokens=40, method="ar", constraint=plain, temperature=0).text
    items = re.findall(r'"(\w+)"', repeated)
    assert len(set(items)) < len(items)  # unkept, the demo repeats an item
    ar = demo.generate("x", max_new_tokens=40, method="ar", constraint=c, temperature=0)
    tree = demo.generate("x", max_new_tokens=40, method="ddtree", constraint=c, temperature=0)
    assert ar.finish_reason == "stop" and tree.text == ar.text
    jsonschema.validate(json.loads(ar.text), EVENTS)
    assert any(r.drafted and r.committed > 1 for r in tree.stats.rounds)  # drafts were accepted


def test_a_unique_array_behind_a_ref_and_an_any_of_is_kept_and_others_are_not(demo, backend):
    m = compiled(demo, NESTED, backend).matcher()
    assert not reads(demo, m, '{"a":["x","x"')
    assert reads(demo, m, '{"a":["x","y"],"b":["x","x"]}')
    assert reads(demo, m, '{"a":null,"b":["x","x"]}')


OWNERS = {"type": "array", "uniqueItems": True, "minItems": 3,  # artifacthub's owners, cryproj's console_variables
          "items": {"type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"name": {"type": "string"}, "email": {"type": "string"}}}}


def test_objects_are_kept_unique_by_a_required_open_string_narrower_never_looser(demo, backend):
    m = compiled(demo, OWNERS, backend).matcher()
    assert isinstance(compiled(demo, OWNERS, backend), UniqueCompiled)
    assert reads(demo, m, '[{"name":"a"},{"name":"b","email":"x"},{"name":"ab","email":"x"}]')
    assert not reads(demo, m, '[{"name":"a","email":"x"},{"name":"a"')  # equal names: refused, however else
    assert not reads(demo, m, '[{"name":"a"},{"name":"\\u0061"')
    for t in ids(demo, '[{"name":"a."},{"name":"a'):
        assert m.accept(t)
    allowed, refused = fill_agrees_with_accept(demo, m)
    assert refused >= 1  # `."` closes "a." again


def test_keyed_objects_under_the_tree_equal_ar_with_drafts_accepted(demo):
    c = compiled(demo, OWNERS)
    ar = demo.generate("x", max_new_tokens=40, method="ar", constraint=c, temperature=0)
    tree = demo.generate("x", max_new_tokens=40, method="ddtree", constraint=c, temperature=0)
    assert tree.text == ar.text and tree.token_ids == ar.token_ids
    assert any(r.drafted and r.committed > 1 for r in tree.stats.rounds)  # drafts were accepted


def test_strings_whose_pattern_always_goes_on_are_kept_unique(demo, backend):
    names = {"type": "array", "uniqueItems": True, "items": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}}
    m = compiled(demo, names, backend).matcher()
    assert reads(demo, m, '["a","ab","b_1"]') and not reads(demo, m, '["a","ab","a"')


@pytest.mark.parametrize("items", [{"type": "object"}, {}, {"type": "string", "maxLength": 3},
                                   {"type": "string", "pattern": "^[a-z]{2}$"},  # may stop short of a new one
                                   {"type": "object", "properties": {"a": {"type": "string"}}},  # none required
                                   {"type": "object", "required": ["a"], "properties": {"a": {"enum": ["x", "y"]}}},
                                   {"type": "integer", "maximum": 9}, {"type": "number", "minimum": -5},
                                   {"anyOf": [{"type": "string"}, {"type": "array"}]}])
def test_items_a_veto_cannot_steer_keep_unique_items_refused_by_name(demo, items):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": items, "uniqueItems": True}}}
    with pytest.raises(ConstraintError, match=re.escape("uniqueItems at $.properties.tags")):
        compiled(demo, schema)


def test_unique_items_that_cannot_matter_compile_without_a_scanner(demo, backend):
    for schema in ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 1},
                   {"type": "array", "items": {"type": "integer"}, "uniqueItems": False}):
        assert not isinstance(compiled(demo, schema, backend), UniqueCompiled)
        assert "uniqueItems" not in json.dumps(enforced(schema)[0])


def test_the_rule_is_read_where_the_output_reaches_it():
    schema = {"type": "object", "properties": {"p": {"type": "array", "prefixItems": [EVENTS], "items": STRINGS}},
              "patternProperties": {"^x-": STRINGS}, "additionalProperties": {"type": "array"}}
    plan = Plan(schema)
    assert plan.rule(("p",)) is None
    assert set(plan.rule(("p", 0)).forms) == {'"push"', '"pull"', '"tag"'}
    assert plan.rule(("p", 3)).open == {"string"} and plan.rule(("x-a",)).open == {"string"}
    assert plan.rule(("other",)) is None
    mixed = Plan({"anyOf": [EVENTS, {"type": "array", "items": {"type": "integer"}}]}).rule(())
    assert mixed.open == {"string", "number", "literal"}  # the other branch's items need no partial checked


U = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}


def test_a_recursive_ref_to_the_root_is_followed_and_refs_the_plan_cannot_follow_keep_unique_items_refused(demo):
    m = compiled(demo, {"type": "object", "properties": {"u": U, "c": {"$ref": "#"}}}).matcher()
    assert reads(demo, m, '{"c":{"u":["x","y"]}}') and not reads(demo, m, '{"c":{"u":["x","x"')
    for schema in ({"$defs": {"u": U, "o": {"$id": "https://x.org/o", "items": {"$ref": "#/x"}}}, "type": "object",
                    "properties": {"a": {"$ref": "#/$defs/u"}}},
                   {"$defs": {"u": {**U, "$anchor": "uu"}}, "type": "object", "properties": {"a": {"$ref": "#uu"}}},
                   {"type": "array", "uniqueItems": True, "items": {"$ref": "#/$defs/x"},  # a loop in the items
                    "$defs": {"x": {"anyOf": [{"$ref": "#/$defs/x"}, {"type": "string"}]}}},
                   {"type": "array", "prefixItems": [{"enum": ["a", "b"]}, {"enum": ["a"]}],
                    "items": {"type": "string"}, "uniqueItems": True, "minItems": 2},  # limits outside its `items`
                   {"allOf": [U, {"items": {"maxLength": 1}}]}):
        with pytest.raises(ConstraintError, match="uniqueItems"):
            compiled(demo, schema)


def test_a_whitespace_pattern_beyond_json_whitespace_keeps_unique_items_refused(demo):
    loose = Constraint("json", json.dumps(U), whitespace=r"\s*")
    with pytest.raises(ConstraintError, match="whitespace_pattern"):
        demo.grammars.compile(loose)
    assert demo.grammars.compile(Constraint("json", json.dumps(U), whitespace=r"[ \n]*"))


def test_a_scalar_after_a_key_is_checked_as_an_item(demo, backend):
    schema = {"type": "object", "properties": {"k": {"type": "array", "items": {"type": "integer", "minimum": 0},
                                                     "uniqueItems": True}}}
    m = compiled(demo, schema, backend).matcher()
    assert not reads(demo, m, '{"k":[0,0') and reads(demo, m, '{"k":[0,1,10]}')
    for tok in ids(demo, '{"k":[0,'):
        assert m.accept(tok)
    fill_agrees_with_accept(demo, m)


def test_an_escaped_keyword_name_is_kept(demo):
    spec = '{"type": "array", "items": {"type": "string"}, "unique\\u0049tems": true}'
    m = demo.grammars.compile(Constraint("json", spec, any_whitespace=False)).matcher()
    assert not reads(demo, m, '["a","a"')


def test_partial_items_that_can_only_repeat_one_are_stuck():
    strings = Plan({}).item_rule({"items": {"enum": ["x\ny", "x\nz"]}})
    used = frozenset({value_key("x\ny")})
    assert strings.stuck(used, b'"x\\ny') and not strings.stuck(used, b'"x\\n') and not strings.stuck(used, b'"x\\')
    ints = Plan({}).item_rule({"items": {"anyOf": [{"type": "integer", "minimum": 0}, {"const": 1.5}]}})
    assert ints.stuck(frozenset({value_key(1.5)}), b"1.") and not ints.stuck(frozenset(), b"1.")
    numbers = Plan({}).item_rule({"items": {"type": "number", "minimum": 0}})
    assert numbers.stuck(frozenset({value_key(0)}), b"0e") and not numbers.stuck(frozenset({value_key(0)}), b"0.")
    tiny = Plan({}).item_rule({"items": {"enum": [1e-07, "z"]}})
    assert not tiny.stuck(frozenset({value_key("z")}), b"0.00000")  # guidance writes 1e-07 as 0.0000001


def test_numbers_are_compared_exactly_at_any_size():
    plan = Plan({"type": "array", "items": {"type": "number"}, "uniqueItems": True})
    assert value_key(Decimal("1e400")) != value_key(Decimal("2e400"))
    assert value_key(Decimal("1.0")) == value_key(1) == value_key(Decimal("1E0"))
    state = scan(Scan(), b"[" + b"1" * 4400 + b",", bytearray(), plan)  # past Python's int digit limit
    with pytest.raises(Veto):
        scan(state, b"1" * 4400 + b"]", bytearray(b"[" + b"1" * 4400 + b","), plan)
    assert Tokens([b"[0,0,", b"x"]).opening.tolist() == [True, False]  # one token may open a kept array and repeat
