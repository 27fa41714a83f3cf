"""JSON Schema read keyword by keyword: every subschema with its JSON path, so that a backend can name what it
would not enforce (`Gap`), and the shapes every backend compiles alike (closed objects, the output's nesting).

Only the keywords that hold schemas are walked into, so a property named like a keyword (`"properties":
{"additionalProperties": false}`) is a property, never the keyword."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import unquote

MAX_NESTING = 64  # objects and arrays the output nests, as vLLM's (sampling_params.py:39)

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",  # name -> schema
               "dependencies")  # (draft 7's: a schema, or a list of names, which is no schema)
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


def rebuild(node: Any, fn: Callable[..., Any], originals: bool = False) -> Any:
    """`node` with `fn` applied to every subschema, innermost first (`fn(rebuilt)`, or `fn(rebuilt, original)`
    where `originals`: the subschema before its children were rebuilt)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: rebuild(child, fn, originals) for name, child in node[key].items()}
    for key in SCHEMA_LISTS + ("items",):
        if isinstance(node.get(key), list):
            out[key] = [rebuild(child, fn, originals) for child in node[key]]
    for key in SCHEMA_ONE:
        if isinstance(node.get(key), dict):
            out[key] = rebuild(node[key], fn, originals)
    return fn(out, node) if originals else fn(out)


def resources(root: Any) -> list[str]:
    """The paths of the subschemas below the root that are resources of their own with a $ref inside: an `$id`
    (drafts 3 and 4: `id`) that is a URI, not a plain fragment (`#name`, an anchor), so `#/...` refs inside them
    point into them (one without a $ref inside changes no reading)."""
    draft = str(root.get("$schema", "")) if isinstance(root, dict) else ""
    key = "id" if "draft-03" in draft or "draft-04" in draft else "$id"
    return [path for n, path in subschemas(root) if path != "$" and isinstance(n.get(key), str)
            and not n[key].startswith("#") and '"$ref"' in json.dumps(n)]


def inside(path: str, resource: str) -> bool:
    """Whether the subschema at `path` lies in the one at `resource` (itself included)."""
    return path == resource or path.startswith((resource + ".", resource + "["))


def resolved(node: Any, root: Any, local: bool) -> dict[str, Any]:
    """The subschema a $ref into this document leads to (followed while it leads on); {} (any instance) where it
    leads elsewhere, or where the document holds resources of its own (not `local`). Under draft 7 a $ref's
    siblings are ignored, and later drafts only narrow them, so the target bounds both."""
    seen: set[str] = set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        ref = node["$ref"]
        if ref in seen or not ref.startswith("#/") or not local:
            return {}
        seen.add(ref)
        node = pointed(ref, root)
    return node if isinstance(node, dict) else {}


def pointed(ref: str, root: Any) -> Any:
    """What a `#/...` JSON pointer points to in `root` (None: nothing)."""
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node


def checker(node: Any, draft: Any, formats: bool = False) -> Any:
    """A jsonschema validator of `node` under the draft `draft` (a `$schema` URI; 2020-12 where it names none),
    checking formats where asked."""
    import jsonschema

    kind = jsonschema.validators.validator_for({"$schema": draft} if draft else {},
                                               default=jsonschema.Draft202012Validator)
    return kind(node, format_checker=jsonschema.FormatChecker() if formats else None)


def names_refused(node: dict[str, Any], draft: str) -> list[str] | None:
    """The properties a subschema names whose names its propertyNames refuses (checked by jsonschema under the
    document's draft `draft`); None where it has no propertyNames or it cannot be read here."""
    names, props = node.get("propertyNames"), node.get("properties") or {}
    if not isinstance(names, (dict, bool)) or not isinstance(props, dict) or "$ref" in json.dumps(names):
        return None
    try:
        check = checker(names, draft)
        return [k for k, v in props.items() if v is not False and not check.is_valid(k)]
    except Exception:  # noqa: BLE001 - a names schema jsonschema cannot read (a bad pattern)
        return None


def loose_values(node: dict[str, Any]) -> bool:
    """Whether a const or enum holds a value the rest of its subschema may refuse (a reading that takes the values
    alone lets it through): one of a JSON type its `type` does not allow, or any beside another assertion."""
    values, named = values_of(node), types(node)
    return values is not None and (bool(set(node) & ASSERTIONS) or bool(named) and any(
        not (kind in named or (kind == "integer" and "number" in named)) for kind, _ in values))


def ref_beside(node: dict[str, Any]) -> bool:
    """Whether a $ref stands beside keywords that assert (which drafts after 7 apply with it)."""
    return "$ref" in node and bool(set(node) & (ASSERTIONS | {"type", "const", "enum"}) - {"$ref"})


def combined_beside(node: dict[str, Any]) -> str | None:
    """The combinator (anyOf, oneOf, allOf) of a subschema that also asserts something beside it, if any."""
    found = [k for k in COMBINATORS if isinstance(node.get(k), list)]
    return found[0] if found and set(node) & (ASSERTIONS | {"type", "const", "enum"}) - {found[0]} else None


COMBINATORS = ("anyOf", "oneOf", "allOf")


def refs_alone(root: Any) -> bool:
    """Whether the document's `$schema` is draft 4, 6 or 7, where a $ref's siblings are ignored."""
    declared = root.get("$schema") if isinstance(root, dict) else None
    return isinstance(declared, str) and any(f"draft-0{n}" in declared for n in (4, 6, 7))


# Keywords that can refuse an instance (beside const, enum and type): applicators and validations of drafts 4-2020-12
ASSERTIONS = {"multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength", "minLength",
              "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
              "maxProperties", "minProperties", "required", "dependentRequired", "dependencies", "allOf", "anyOf",
              "oneOf", "not", "if", "then", "else", "dependentSchemas", "prefixItems", "items", "additionalItems",
              "contains", "properties", "patternProperties", "additionalProperties", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "$ref", "$dynamicRef", "$recursiveRef"}


def asserted(node: dict[str, Any]) -> set[str]:
    """The keywords of a subschema that can refuse an instance; the rest (titles, unknown keywords) are notes."""
    return set(node) & (ASSERTIONS | {"type", "const", "enum"})


def values_of(node: dict[str, Any]) -> set[tuple[str, str]] | None:
    """The values a subschema's const or enum allows, each as (its JSON type, itself as JSON compares it: 1 ==
    1.0 == -0.0 + 1, true != 1, also inside arrays and objects); None: not bounded so."""
    found = fixed_values(node)
    return None if found is None else {(_kind(v), value_key(v)) for v in found}


def canonical(v: Any) -> Any:
    """`v` with every number as JSON compares numbers: an integral one as an int (1.0 and -0.0 too), others as
    floats."""
    if isinstance(v, bool) or not isinstance(v, (int, float, list, dict)):
        return v
    if isinstance(v, list):
        return [canonical(x) for x in v]
    if isinstance(v, dict):
        return {k: canonical(x) for k, x in v.items()}
    return int(v) if isinstance(v, int) or v.is_integer() else v


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "integer" if isinstance(canonical(v), int) else "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}.get(type(v), "string")


def is_object(node: dict[str, Any]) -> bool:
    return "object" in types(node) or (not types(node) and "properties" in node)


def closed(schema: Any) -> Any:
    """Every object subschema without its own additionalProperties gets `false` (vLLM's
    disable_additional_properties)."""
    return rebuild(schema, lambda n: {**n, "additionalProperties": n.get("additionalProperties", False)}
                   if is_object(n) else n)


def value_key(v: Any) -> str:
    """A value as JSON compares it: a number by its value, exactly at any size (1 == 1.0 == 1e0, as Decimal),
    object keys in any order."""
    if isinstance(v, (int, float, Decimal)) and not isinstance(v, bool):
        d = Decimal(repr(v)) if isinstance(v, float) else Decimal(v)
        return "#" + ("0" if d.is_finite() and d == 0 else str(d.normalize()))
    if isinstance(v, list):
        return "[" + ",".join(value_key(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(json.dumps(k) + ":" + value_key(x) for k, x in sorted(v.items())) + "}"
    return json.dumps(v)


def fixed_values(node: dict[str, Any]) -> list[Any] | None:
    """The values a subschema's const and enum allow (both: those of both); None: it has neither."""
    found = node["enum"] if isinstance(node.get("enum"), list) else None
    if "const" in node:
        found = [node["const"]] if found is None or any(value_key(v) == value_key(node["const"]) for v in found) \
            else []
    return found
