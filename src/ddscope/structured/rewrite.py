"""Exact rewrites of a schema into keywords both backends read (`portable`): a `not` as the subschema it leaves
(`complement`), a oneOf as an anyOf, if/then/else as an anyOf, property dependencies as anyOfs. Each rewritten
schema accepts exactly the instances the original does; what cannot be written so stays, for the backends to
refuse."""
from __future__ import annotations

import json
from typing import Any

from ddscope.structured.drafts import NARROWED, is_narrowed, marked
from ddscope.structured.exclusive import exclusive
from ddscope.structured.formats import enforced_format
from ddscope.structured.merge import inlined
from ddscope.structured.schema import (asserted, fixed_values, names_refused, rebuild, refs_alone, resources,
                                       subschemas, types, value_key)
from ddscope.structured.strings import TYPES, not_pattern, not_values

MAX_ONE_OF = 8  # branches of a oneOf written as each with the others' complements
DEPENDENCIES = ("dependencies", "dependentRequired", "dependentSchemas")
OBJECT_KEYS = {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties", "propertyNames", "dependencies", "dependentRequired", "dependentSchemas"}


def portable(schema: Any, narrowing: bool = True) -> Any:
    """`schema` in keywords both backends read, where they can be written: each `not` as the subschema it leaves
    (`complement`), each oneOf as an anyOf (`_one_of_out`), each if/then/else as an anyOf (`_conditions_out`),
    each property dependency (`dependencies`, `dependentRequired`, `dependentSchemas`) as an anyOf of the property
    left out or present with what it brings. A keyword the document's draft ignores (`dependencies` after draft 7,
    `if` before it) is applied too: it only narrows what is served, and it says what the author meant. What cannot
    be written stays, for the backends to refuse, and so does a document with `unevaluated*` (which reads what the
    rewrites would add). Under drafts 4 to 7, a $ref's siblings, which they ignore, are left out. `narrowing`: a
    `not` or oneOf that cannot be written whole is written as a part of it (`complement`'s `narrow`), served
    narrower than the schema, never looser."""
    text = json.dumps(schema)
    if '"unevaluatedProperties"' in text or '"unevaluatedItems"' in text:
        return schema
    local, draft = not resources(schema), str(schema.get("$schema", "")) if isinstance(schema, dict) else ""
    alone, given = refs_alone(schema), marked(schema)

    def one(node: dict[str, Any], original: dict[str, Any]) -> Any:
        if alone and isinstance(node.get("$ref"), str):  # drafts 4-7 ignore a $ref's siblings (guidance refuses
            node = {k: v for k, v in node.items() if k in ("$ref", "definitions", "$defs")}  # them on a loop)
        node = _dependencies_out(_conditions_out(_names_out(enforced_format(node, draft), draft)))
        node = _one_of_out(node, original.get("oneOf"), schema, local, narrowing)
        other = complement(node["not"]) if "not" in node else None
        if other is None and "not" in node and narrowing:
            other = _narrowed(node["not"])
        if other is None:
            return _unnarrowed(node, original)
        rest = _unnarrowed({k: v for k, v in node.items() if k != "not"}, original)
        if not asserted(rest):
            return other if not isinstance(other, dict) else {**rest, **other}
        return {**rest, "allOf": [*(rest.get("allOf") or []), other]}
    out = rebuild(given, one, originals=True)
    return {**out, "$schema": schema["$schema"]} if isinstance(out, dict) and "$schema" in schema else out


def _unnarrowed(node: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
    """`node` with each `not`, oneOf and if/then/else left unwritten as it was written, where a rewrite narrowed a
    part inside: kept, they read that part the other way round, so narrower there would be looser."""
    kept = [("not",), ("oneOf",), ("if", "then", "else")]
    back = [k for keys in kept if keys[0] in node and any(_holds_narrowed(node.get(k)) for k in keys) for k in keys]
    return {**node, **{k: original[k] for k in back if k in original}}


def _holds_narrowed(node: Any) -> bool:
    found = node if isinstance(node, list) else [node]
    return any(is_narrowed(n) for x in found for n, _ in subschemas(x))


def _names_out(node: dict[str, Any], draft: str) -> dict[str, Any]:
    """`node` with its propertyNames applied to the properties it names (one whose name fails is left out:
    xgrammar checks only the others' names), and gone where nothing else is left to check: a closed object, or an
    open one whose names need only a pattern (then a patternProperty, beside no other property)."""
    names, props = node.get("propertyNames"), node.get("properties") or {}
    failing = names_refused(node, draft)
    if failing is None:
        return node
    if failing:
        node = {**node, "properties": {**props, **{k: False for k in failing}}}
    extra, rest = node.get("additionalProperties", True), {k: v for k, v in node.items() if k != "propertyNames"}
    if names is True or names == {} or extra is False and not node.get("patternProperties"):
        return rest
    if isinstance(names, dict) and asserted(names) <= {"pattern", "type"} and types(names) <= {"string"} and \
            isinstance(names.get("pattern"), str) and extra in (True, {}) and "patternProperties" not in node:
        return {**rest, "patternProperties": {names["pattern"]: {}}, "additionalProperties": False}
    return node


def _conditions_out(node: dict[str, Any]) -> dict[str, Any]:
    """`node` with its if/then/else, and those of its allOf's branches, as anyOfs: the condition with `then`, or
    its complement with `else`. The condition's complement reads `node`'s properties for the values a property
    may hold (a const among an enum's), where it can be written."""
    found = [node] + [b for b in node.get("allOf") or () if isinstance(b, dict) and "if" in b]
    if not any("if" in n for n in found):
        return node
    rest = {k: v for k, v in node.items() if k not in ("if", "then", "else", "allOf")}
    branches = []
    for n in found[1:] if "if" not in node else found:
        other = complement(n["if"], node)
        if other is None:
            return node
        either = {"anyOf": [{"allOf": [n["if"], n.get("then", {})]}, {"allOf": [other, n.get("else", {})]}]}
        beside = {k: v for k, v in n.items() if k not in ("if", "then", "else")} if n is not node else {}
        branches.append({"allOf": [beside, either]} if beside else either)
    kept = [b for b in node.get("allOf") or () if not (isinstance(b, dict) and "if" in b)]
    return {**rest, "allOf": kept + branches}


def _one_of_out(node: dict[str, Any], written: Any, root: Any, local: bool, narrowing: bool) -> dict[str, Any]:
    """`node` with its oneOf as an anyOf: as it is where no instance can match two branches (`exclusive`, proved
    on the branches as `written`, before a rewrite narrowed any), else each branch with the complements of the
    others (exactly one of them), where those can be written, or else with parts of them (`complement`'s
    `narrow`: what is served is narrower than the oneOf, never looser)."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or not branches:
        return node
    rest = {k: v for k, v in node.items() if k != "oneOf"}
    proof = written if isinstance(written, list) and len(written) == len(branches) else branches
    objects = sum(isinstance(b, dict) and not types(b) and bool(asserted(b)) and asserted(b) <= OBJECT_KEYS
                  for b in proof) > 1  # a non-object matches two branches: the oneOf takes only objects
    if objects:
        branches, proof = ([_as_object(inlined(b, root, local)) for b in found] for found in (branches, proof))
    if len(branches) == 1 or exclusive(proof, root, local, {"object"} if objects else types(node)):
        either: list[Any] = branches
    else:
        if len(branches) > MAX_ONE_OF:
            return node
        others = []
        for b in branches:
            other = complement(inlined(b, root, local))
            if other is None and narrowing:
                other = _narrowed(inlined(b, root, local))
            if other is None:
                return node
            others.append(other)
        either = [{"allOf": [b, *(c for j, c in enumerate(others) if j != i)]} for i, b in enumerate(branches)]
    if "anyOf" in rest:
        return {**rest, "allOf": [*(rest.get("allOf") or []), {"anyOf": either}]}
    return {**rest, "anyOf": either}


def _narrowed(node: Any) -> Any:
    """A part of `node`'s complement, marked `NARROWED`; None where it is nothing (every instance refused)."""
    other = complement(node, narrow=True)
    return None if other is False else {**other, "$comment": NARROWED} if isinstance(other, dict) else other


def _as_object(branch: Any) -> Any:
    """`branch`, an object's only."""
    if branch is True or branch is False:
        return {"type": "object"} if branch else False
    if not isinstance(branch, dict) or "$ref" in branch:  # followed as it stands
        return {"allOf": [{"type": "object"}, branch]}
    return {**branch, "type": "object"} if not types(branch) or "object" in types(branch) else False


def _dependencies_out(node: dict[str, Any]) -> dict[str, Any]:
    """`node` with its property dependencies as allOf branches: each an anyOf of the property left out, or present
    with the properties it requires or the subschema it brings (exact: both pass what is no object)."""
    found = [(k, node[k]) for k in DEPENDENCIES if isinstance(node.get(k), dict)]
    if not found:
        return node
    branches = []
    for _, entries in found:
        for name, need in entries.items():
            need = [need] if isinstance(need, str) else need  # draft 3: one property's name
            present: Any = {"required": [name, *need]} if isinstance(need, list) else \
                {"allOf": [{"required": [name]}, need]}
            branches.append({"anyOf": [{"properties": {name: False}}, present]})
    rest = {k: v for k, v in node.items() if k not in dict(found)}
    return {**rest, "allOf": [*(rest.get("allOf") or []), *branches]}


def complement(node: Any, within: Any = None, narrow: bool = False) -> Any:
    """A subschema matching exactly what `node` does not, or None where none is written here: of an empty one
    (false), of a type, of required properties and the schemas of present ones (an object that lacks one, or
    holds one its schema refuses, or is no object), of an anyOf (all of the complements) or an allOf (any of
    them), of values that are strings, true, false or null. `within`: a subschema the instance also matches (its
    enum or const), so that values can be complemented among its own. `narrow`: where the whole cannot be
    written, a part of it (never None): an object's other keywords, and what cannot be written, left out."""
    if node is True or node is False:
        return not node
    if not isinstance(node, dict) or any(is_narrowed(n) for n, _ in subschemas(node)):
        return False if narrow else None  # the complement of a narrowed part would be looser than the schema
    keys = asserted(node)
    if not keys:
        return False
    if keys <= {"type"} and not ("integer" in types(node) and "number" not in types(node)):  # no type: non-integers
        left = [t for t in TYPES if t not in types(node)]
        return {"type": left} if left else False
    for key, dual in (("anyOf", "allOf"), ("allOf", "anyOf")):  # De Morgan
        if keys <= {key} and isinstance(node[key], list) and node[key]:
            parts = [complement(b, within, narrow) for b in node[key]]
            return None if any(p is None for p in parts) else {dual: parts}
    if keys <= ({"type"} | OBJECT_KEYS if narrow else {"type", "required", "properties"}) and \
            types(node) <= {"object"}:
        return _not_object(node, within, narrow)
    if narrow and keys <= {"type", "items", "minItems", "maxItems", "uniqueItems"} and types(node) <= {"array"} and \
            isinstance(node.get("items"), dict):  # a part: arrays of one item or more, each one `items` refuses
        inner = complement(node["items"], narrow=True)
        parts = ([{"type": [t for t in TYPES if t != "array"]}] if types(node) else []) + \
            ([{"type": "array", "minItems": 1, "items": inner}] if inner is not False else [])
        return {"anyOf": parts} if parts else False
    if narrow and keys <= {"type", "pattern"} and "pattern" in keys and types(node) <= {"string"}:
        strings = not_pattern(node["pattern"])
        if strings is None:
            return False
        others = [{"type": [t for t in TYPES if t != "string"]}] if types(node) else []  # untyped: they match
        return {"anyOf": [*others, strings]} if others else strings
    values = fixed_values(node) if keys in ({"enum"}, {"const"}) else None
    among = fixed_values(within) if isinstance(within, dict) and not is_narrowed(within) else None
    if values is not None and among is not None:  # the others of `within`'s
        shut = {value_key(v) for v in values}
        left = [v for v in among if value_key(v) not in shut]
        return {"enum": left} if left else False
    if values is not None and all(v is None or isinstance(v, bool) or isinstance(v, str) and not v.endswith("\n")
                                  for v in values):  # Python's `$` takes "a\n" as "a": jsonschema would differ
        return not_values(values)
    return False if narrow else None


def _not_object(node: dict[str, Any], within: Any, narrow: bool) -> Any:
    """Not (an object holding every required property, each present one as its schema says)."""
    props, known = node.get("properties") or {}, (within if isinstance(within, dict) else {}).get("properties") or {}
    required = node.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list):
        return False if narrow else None
    branches: list[Any] = [{"type": [t for t in TYPES if t != "object"]}] if types(node) else []  # untyped: they match
    branches += [{"type": "object", "properties": {name: False}} for name in required]
    for name, sub in props.items():
        other = complement(sub, known.get(name) if isinstance(known, dict) else None, narrow)
        if other is None:
            return None
        if other is not False:
            branches.append({"type": "object", "properties": {name: other}, "required": [name]})
    return {"anyOf": branches} if branches else False
