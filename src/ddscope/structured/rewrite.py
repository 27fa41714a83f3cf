"""Exact rewrites of a schema into keywords a backend reads: what a subschema asserts beside its combinators
written into their branches (`distributed`, two subschemas as one: `merged`), a const or enum beside other
assertions as the values that pass them (`narrowed`), and where nothing can match (`impossible`). Each rewritten
schema accepts exactly the instances the original does; where one cannot be written so, the node stays as it was,
for the backend's gaps to name."""
from __future__ import annotations

import json
from typing import Any

from ddscope.structured.schema import (ASSERTIONS, canonical, combined_beside, exclusive, overlap, rebuild, resolved,
                                       resources, subschemas, types)

MINS = ("minimum", "minLength", "minItems", "minProperties")  # merged: the larger bound
MAXES = ("maximum", "maxLength", "maxItems", "maxProperties")
MAX_BRANCHES = 64  # two anyOfs merged: at most this many pairs
MAX_ONE_OF = 8  # branches of a oneOf written as each with the others' complements


def distributed(node: dict[str, Any], root: Any, local: bool, depth: int = 0) -> dict[str, Any]:
    """`node` with what it asserts beside its combinators written into them, where that can be written exactly:
    allOf's branches merged with the rest into one subschema, then the rest merged into each branch of its anyOf
    or oneOf. A backend that reads a combinator alone (xgrammar) then reads all of it; where a merge cannot be
    written (a $ref that leads on, patternProperties, differing values), `node` as it was."""
    for key in ("anyOf", "oneOf"):  # a branch nothing matches never matters (to oneOf's count either)
        if isinstance(node.get(key), list) and any(_never(b) for b in node[key]):
            node = {**node, key: [b for b in node[key] if not _never(b)]}
            if not node[key]:
                return False  # type: ignore[return-value]
    if depth > 8 or combined_beside(node) is None and not isinstance(node.get("allOf"), list):
        return node
    try:
        return _distributed(node, root, local, depth)
    except (TypeError, ValueError, AttributeError):  # bounds or lists that are not JSON Schema's: left as they are
        return node


def _distributed(node: dict[str, Any], root: Any, local: bool, depth: int) -> dict[str, Any]:
    rest = {k: v for k, v in node.items() if k != "allOf"}
    for branch in node.get("allOf") or ():
        rest = merged(rest, _inlined(branch, root, local))  # type: ignore[arg-type]
        if not isinstance(rest, dict):
            return node
    kinds = [k for k in ("anyOf", "oneOf") if isinstance(rest.get(k), list)]
    if len(kinds) > 1:
        return node
    if not kinds:
        return rest
    beside = {k: v for k, v in rest.items() if k != kinds[0]}
    asserted = {k: v for k, v in beside.items() if k in ASSERTIONS | {"type", "const", "enum"}}
    branches = [merged(asserted, _inlined(b, root, local)) for b in rest[kinds[0]]]
    if any(b is None for b in branches):
        return node
    notes = {k: v for k, v in beside.items() if k not in asserted}
    kept = [distributed(b, root, local, depth + 1) for b in branches if b is not False]  # type: ignore[arg-type]
    return {**notes, kinds[0]: kept} if kept else False  # type: ignore[return-value]


def impossible(schema: Any) -> str | None:
    """The path of a subschema nothing matches where the output must match it: the root, or a required property."""
    if schema is False:
        return "$"
    for node, path in subschemas(schema):
        props = node.get("properties")
        for name in node.get("required") or () if isinstance(props, dict) else ():
            if props.get(name) is False:
                return f"{path}.properties.{name}"
    return None


def narrowed(node: dict[str, Any], draft: Any) -> Any:
    """A const or enum beside other assertions as the values among them that pass the rest (exact: an instance is
    one of them); `false` where none does. Checked by jsonschema under the document's draft (`draft`: its
    `$schema`), formats included; as it was where the rest holds a $ref or does not read."""
    values = node.get("enum") if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else None
    rest = {k: v for k, v in node.items() if k in ASSERTIONS | {"type"}}
    if values is None or not rest or "$ref" in json.dumps(rest):
        return node
    import jsonschema

    try:
        check = jsonschema.validators.validator_for({"$schema": draft}, default=jsonschema.Draft202012Validator)(
            rest, format_checker=jsonschema.FormatChecker())
        kept = [v for v in values if check.is_valid(v)]
    except Exception:  # noqa: BLE001 - a rest jsonschema cannot read (a bad pattern): left for the backend's reading
        return node
    if not kept:
        return False
    return {**{k: v for k, v in node.items() if k not in rest and k not in ("const", "enum")}, "enum": kept}


def _never(node: Any) -> bool:
    """Nothing matches it: `false`, or an object that must hold a property nothing matches."""
    if not isinstance(node, dict):
        return node is False
    props = node.get("properties")
    return types(node) == {"object"} and isinstance(props, dict) and any(
        props.get(name) is False for name in node.get("required") or ())


def _inlined(branch: Any, root: Any, local: bool) -> Any:
    """A branch that is a $ref alone, as its target (one level: the $refs inside it still point where they did)."""
    if isinstance(branch, dict) and set(branch) == {"$ref"}:
        return resolved(branch, root, local) or branch
    return branch


def merged(a: Any, b: Any) -> Any:
    """One subschema that means allOf [a, b], where it can be written so; None where not."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict) or "$ref" in a or "$ref" in b:
        return None
    if ("patternProperties" in a or "patternProperties" in b) and ("properties" in a or "properties" in b):
        return None
    out = {**a, **b}
    for k, v in a.items():
        if k not in b or b[k] == v:
            out[k] = v
        elif k == "type":
            met = {x if x == y else "integer" for x in types(a) for y in types(b) if overlap(x, y)}
            if not met:
                return False  # no instance is of both types
            out[k] = sorted(met) if len(met) > 1 else met.pop()
        elif k == "required":
            out[k] = sorted(set(v) | set(b[k]))
        elif k in MINS or k in MAXES:
            out[k] = (max if k in MINS else min)(v, b[k])
        elif k == "anyOf" and isinstance(v, list) and isinstance(b[k], list) and len(v) * len(b[k]) <= MAX_BRANCHES:
            pairs = [merged(x, y) for x in v for y in b[k]]  # (x1 or x2) and (y1 or y2): each pair, one of them
            if any(p is None for p in pairs):
                return None
            out[k] = [p for p in pairs if p is not False] or [False]
        elif k in ("properties", "items", "additionalProperties"):
            if (m := _merged_map(k, v, b[k])) is None:
                return None
            out[k] = m
        elif k in ASSERTIONS:
            return None
    if _values(a) is not None and _values(b) is not None:  # both bound the values: those of both
        theirs = {value_key(v) for v in _values(b)}  # type: ignore[union-attr]
        both = [v for v in _values(a) if value_key(v) in theirs]  # type: ignore[union-attr]
        if not both:
            return False
        out = {k: v for k, v in out.items() if k != "const"} | {"enum": both}
    return _closed_over(a, b, out)


def _merged_map(key: str, v: Any, w: Any) -> Any:
    if key != "properties":
        return merged(v, w)
    out = {name: sub if name not in w else merged(sub, w[name]) for name, sub in v.items()}  # the first's order
    out.update({name: sub for name, sub in w.items() if name not in v})
    return None if any(sub is None for sub in out.values()) else out


def _closed_over(a: dict[str, Any], b: dict[str, Any], out: dict[str, Any]) -> dict[str, Any] | None:
    """`out` with the properties one side names and the other's additionalProperties refuses (false: left out;
    a schema: None, not merged)."""
    props = dict(out.get("properties") or {})
    for side, other in ((a, b), (b, a)):
        extra = side.get("additionalProperties", True)
        for name in set(other.get("properties") or {}) - set(side.get("properties") or {}):
            if extra is False:
                props[name] = False
            elif extra is not True:
                return None
    if props:
        out["properties"] = props
    return out


TYPES = ("array", "boolean", "null", "number", "object", "string")
NOTES = {"description", "title", "$comment", "examples", "default", "markdownDescription", "deprecated"}


def portable(schema: Any) -> Any:
    """`schema` in keywords both backends read, where they can be written: each `not` as the subschema it leaves
    (`complement`), each oneOf as an anyOf (`_one_of_out`), each property dependency (`dependencies`,
    `dependentRequired`, `dependentSchemas`) as an anyOf of the property left out or present with what it brings.
    What cannot be written stays, for the backends to refuse."""
    local = not resources(schema)

    def one(node: dict[str, Any]) -> Any:
        node = _one_of_out(_dependencies_out(_conditions_out(node)), schema, local)
        other = complement(node["not"]) if "not" in node else None
        if other is None:
            return node
        rest = {k: v for k, v in node.items() if k != "not"}
        if not set(rest) - NOTES:
            return other if not isinstance(other, dict) else {**rest, **other}
        return {**rest, "allOf": [*(rest.get("allOf") or []), other]}
    return rebuild(schema, one)


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


def _one_of_out(node: dict[str, Any], root: Any, local: bool) -> dict[str, Any]:
    """`node` with its oneOf as an anyOf: as it is where no instance can match two branches (`exclusive`), else
    each branch with the complements of the others (exactly one of them), where those can be written."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or not branches:
        return node
    rest = {k: v for k, v in node.items() if k != "oneOf"}
    if len(branches) == 1 or exclusive(branches, root, local):
        either: list[Any] = branches
    else:
        others = [complement(_inlined(b, root, local)) for b in branches]
        if len(branches) > MAX_ONE_OF or any(c is None for c in others):
            return node
        either = [{"allOf": [b, *(c for j, c in enumerate(others) if j != i)]} for i, b in enumerate(branches)]
    if "anyOf" in rest:
        return {**rest, "allOf": [*(rest.get("allOf") or []), {"anyOf": either}]}
    return {**rest, "anyOf": either}


def _dependencies_out(node: dict[str, Any]) -> dict[str, Any]:
    """`node` with its property dependencies as allOf branches: each an anyOf of the property left out, or present
    with the properties it requires or the subschema it brings (exact: both pass what is no object)."""
    found = [(k, node[k]) for k in ("dependencies", "dependentRequired", "dependentSchemas")
             if isinstance(node.get(k), dict)]
    if not found:
        return node
    branches = []
    for _, entries in found:
        for name, need in entries.items():
            present: Any = {"required": [name, *need]} if isinstance(need, list) else \
                {"allOf": [{"required": [name]}, need]}
            branches.append({"anyOf": [{"properties": {name: False}}, present]})
    rest = {k: v for k, v in node.items() if k not in dict(found)}
    return {**rest, "allOf": [*(rest.get("allOf") or []), *branches]}


def complement(node: Any, within: Any = None) -> Any:
    """A subschema matching exactly what `node` does not, or None where none is written here: of an empty one
    (false), of a type, of required properties and the schemas of present ones (an object that lacks one, or
    holds one its schema refuses, or is no object), of an anyOf (all of the complements), of values that are only
    true, false and null. `within`: a subschema the instance also matches (its enum or const), so that values can
    be complemented among its own."""
    if node is True or node is False:
        return not node
    if not isinstance(node, dict):
        return None
    keys = set(node) - NOTES
    if not keys:
        return False
    if keys <= {"type"} and not ("integer" in types(node) and "number" not in types(node)):  # no type: non-integers
        left = [t for t in TYPES if t not in types(node)]
        return {"type": left} if left else False
    if keys <= {"anyOf"} and isinstance(node["anyOf"], list):
        parts = [complement(b, within) for b in node["anyOf"]]
        return None if any(p is None for p in parts) else {"allOf": parts}
    if keys <= {"type", "required", "properties"} and types(node) <= {"object"}:
        return _not_object(node, within)
    values = _values(node)
    if keys in ({"enum"}, {"const"}) and values and all(v is None or isinstance(v, bool) for v in values):
        left = [v for v in (True, False, None) if not any(v is x for x in values)]
        others = {"type": [t for t in TYPES if t not in ("boolean", "null")]}
        return {"anyOf": [others, {"enum": left}]} if left else others
    among = _values(within) if isinstance(within, dict) else None
    if keys in ({"enum"}, {"const"}) and values is not None and among is not None:  # the others of `within`'s
        shut = {value_key(v) for v in values}
        left = [v for v in among if value_key(v) not in shut]
        return {"enum": left} if left else False
    return None


def _values(node: dict[str, Any]) -> list[Any] | None:
    """A subschema's const or enum values; None: it has neither."""
    return node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else None


def value_key(v: Any) -> str:
    """A value as JSON compares it (1 == 1.0, keys in any order)."""
    return json.dumps(canonical(v), sort_keys=True)


def _not_object(node: dict[str, Any], within: Any) -> Any:
    """Not (an object holding every required property, each present one as its schema says)."""
    props, known = node.get("properties") or {}, (within or {}).get("properties") or {}
    required = node.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list):
        return None
    branches: list[Any] = [{"type": [t for t in TYPES if t != "object"]}] if types(node) else []  # untyped: they match
    branches += [{"type": "object", "properties": {name: False}} for name in required]
    for name, sub in props.items():
        other = complement(sub, known.get(name) if isinstance(known, dict) else None)
        if other is None:
            return None
        if other is not False:
            branches.append({"type": "object", "properties": {name: other}, "required": [name]})
    return {"anyOf": branches} if branches else False
