"""JSON Schema read keyword by keyword: every subschema with its JSON path, so that a backend can name what it
would not enforce (`Gap`), and the shapes every backend compiles alike (closed objects, the output's nesting).

Only the keywords that hold schemas are walked into, so a property named like a keyword (`"properties":
{"additionalProperties": false}`) is a property, never the keyword."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

MAX_NESTING = 64  # objects and arrays the output nests, as vLLM's (sampling_params.py:39)

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")  # [schema]
SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
              "contains", "not", "if", "then", "else", "propertyNames")
NESTS = {"object", "array"}


@dataclass(frozen=True)
class Gap:
    """A keyword a backend would not enforce, at a JSON path in the schema (`$.properties.name`)."""
    keyword: str
    path: str
    why: str = "is not enforced"

    def __str__(self) -> str:
        return f"{self.keyword} at {self.path} {self.why}"


def subschemas(node: Any, path: str = "$") -> Iterator[tuple[dict[str, Any], str]]:
    """Every object subschema of `node` (itself first), with its path."""
    if not isinstance(node, dict):
        return
    yield node, path
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                yield from subschemas(child, f"{path}.{key}.{name}")
    for key in SCHEMA_LISTS + ("items",):
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                yield from subschemas(child, f"{path}.{key}[{i}]")
    for key in SCHEMA_ONE:
        yield from subschemas(node.get(key), f"{path}.{key}")


def locate(schema: Any, keyword: str) -> str | None:
    """The path of the first subschema using `keyword`."""
    return next((p for node, p in subschemas(schema) if keyword in node), None)


def types(node: dict[str, Any]) -> set[str]:
    """The JSON types a subschema names (none: any)."""
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def nesting(schema: Any) -> int:
    """How deep the output's objects and arrays can nest: a subschema's value inside its object or array is one
    level down, its anyOf/allOf branches on the same level; a recursive $ref is followed once round its loop."""
    defs = {f"#/{k}/{n}": s for k in ("$defs", "definitions") if isinstance(schema, dict)
            and isinstance(schema.get(k), dict) for n, s in schema[k].items()}
    done: dict[str, int] = {}  # a definition's depth, once (a schema may $ref it from many places)

    def depth(node: Any, seen: frozenset[str]) -> int:
        if not isinstance(node, dict):
            return 0
        here = 1 if types(node) & NESTS or (not types(node) and _container(node)) else 0
        inside = max((depth(v, seen) for k, v in _values(node) if k in _INSIDE), default=0)
        beside = max((depth(v, seen) for k, v in _values(node) if k not in _INSIDE), default=0)
        ref = node.get("$ref")
        if ref in defs and ref not in seen:
            if ref not in done:
                done[ref] = depth(defs[ref], seen | {ref})
            beside = max(beside, done[ref])
        return max(here + inside, beside)

    return depth(schema, frozenset())


_INSIDE = {"properties", "patternProperties", "additionalProperties", "unevaluatedProperties", "items",
           "prefixItems", "additionalItems", "unevaluatedItems", "contains"}  # a value one level inside the node


def _container(node: dict[str, Any]) -> bool:
    return any(k in node for k in _INSIDE | {"required", "minProperties", "maxProperties", "minItems", "maxItems"})


def _values(node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(keyword, child schema) for each schema directly under `node`."""
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict) and key not in ("$defs", "definitions"):
            for child in node[key].values():
                yield key, child
    for key in SCHEMA_LISTS + ("items",):
        if isinstance(node.get(key), list):
            for child in node[key]:
                yield key, child
    for key in SCHEMA_ONE:
        if isinstance(node.get(key), dict):
            yield key, node[key]


def rebuild(node: Any, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """`node` with `fn` applied to every subschema, innermost first."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: rebuild(child, fn) for name, child in node[key].items()}
    for key in SCHEMA_LISTS + ("items",):
        if isinstance(node.get(key), list):
            out[key] = [rebuild(child, fn) for child in node[key]]
    for key in SCHEMA_ONE:
        if isinstance(node.get(key), dict):
            out[key] = rebuild(node[key], fn)
    return fn(out)


def exclusive(branches: list[Any], root: Any) -> bool:
    """Whether no instance can match two of `branches`, so that oneOf means what anyOf does: each pair allows
    apart JSON types (named, or those of its const/enum values, its anyOf's or its allOf's), or apart const/enum
    values, or, objects both, requires a property whose values are apart so (a discriminator), or a property the
    other, closed, does not name. Only what it can read counts: a branch without a type, or behind a
    $ref outside the document, overlaps every other."""
    read = [_target(b, root) for b in branches]
    return all(_apart(a, b, root, 0) for i, a in enumerate(read) for b in read[i + 1:])


def _target(node: Any, root: Any) -> dict[str, Any]:
    """The subschema a local $ref leads to (followed while it leads on; an external or unknown one: {}, any
    instance). Under draft 7 a $ref's siblings are ignored, and later drafts only narrow them, so the target
    bounds both."""
    seen: set[str] = set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        ref = node["$ref"]
        if ref in seen or not ref.startswith("#/"):
            return {}
        seen.add(ref)
        node = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def _apart(a: dict[str, Any], b: dict[str, Any], root: Any, depth: int) -> bool:
    ka, kb = _kinds(a, root), _kinds(b, root)
    if ka and kb and not any(_overlap(x, y) for x in ka for y in kb):
        return True
    if _allowed(a) is not None and _allowed(b) is not None and not _allowed(a) & _allowed(b):
        return True
    if not types(a) == types(b) == {"object"}:  # `required` binds objects only: a string would match both
        return False
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    ra, rb = set(a.get("required") or ()), set(b.get("required") or ())
    if (_closed(a) and rb - set(pa)) or (_closed(b) and ra - set(pb)):
        return True
    return depth < 4 and any(_apart(_target(pa.get(k), root), _target(pb.get(k), root), root, depth + 1)
                             for k in ra & rb)


def off_type(node: dict[str, Any]) -> bool:
    """Whether a subschema's const or enum holds a value of a JSON type its `type` does not allow (that value can
    never validate; where it is the only one, nothing can)."""
    named = types(node)
    return bool(named) and any(not (kind in named or (kind == "integer" and "number" in named))
                               for kind, _ in _allowed(node) or ())


def _kinds(node: dict[str, Any], root: Any, depth: int = 0) -> set[str]:
    """The JSON types an instance of `node` can have, as far as it says (empty: any)."""
    if types(node) or depth > 8:
        return types(node)
    if (values := _allowed(node)) is not None:
        return {kind for kind, _ in values}
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key]:
            found = [_kinds(_target(b, root), root, depth + 1) for b in node[key]]
            if all(found):
                return set().union(*found)
    known = [k for b in node.get("allOf") or () if (k := _kinds(_target(b, root), root, depth + 1))]
    return set.intersection(*known) if known else set()


def _closed(node: dict[str, Any]) -> bool:
    """An object that takes no property but those it names."""
    return node.get("additionalProperties") is False and not node.get("patternProperties")


def _overlap(x: str, y: str) -> bool:
    return x == y or {x, y} == {"integer", "number"}


def _allowed(node: dict[str, Any]) -> set[tuple[str, str]] | None:
    """The values a subschema's const or enum allows, each as (its JSON type, itself as JSON compares it: 1 ==
    1.0, true != 1); None: not bounded so."""
    if "const" in node:
        found = [node["const"]]
    elif isinstance(node.get("enum"), list):
        found = node["enum"]
    else:
        return None
    return {_value(v) for v in found}


def _value(v: Any) -> tuple[str, str]:
    if isinstance(v, bool):
        return "boolean", json.dumps(v)
    if isinstance(v, (int, float)):
        return ("integer" if float(v).is_integer() else "number"), repr(float(v))
    kind = {str: "string", list: "array", dict: "object", type(None): "null"}.get(type(v), "string")
    return kind, json.dumps(v, sort_keys=True)


def is_object(node: dict[str, Any]) -> bool:
    return "object" in types(node) or (not types(node) and "properties" in node)


def closed(schema: Any) -> Any:
    """Every object subschema without its own additionalProperties gets `false` (vLLM's
    disable_additional_properties)."""
    return rebuild(schema, lambda n: {**n, "additionalProperties": n.get("additionalProperties", False)}
                   if is_object(n) else n)
