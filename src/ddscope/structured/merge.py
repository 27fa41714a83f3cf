"""Subschemas merged into one that means both (`merged`), for a backend that reads a combinator alone
(xgrammar): what a subschema asserts beside its combinators written into their branches (`distributed`), a const
or enum beside other assertions as the values that pass them (`narrowed`), and where nothing can match
(`impossible`). Each result accepts exactly the instances the original does; where one cannot be written so, the
node stays as it was, for the backend's gaps to name."""
from __future__ import annotations

import json
from typing import Any

from ddscope.structured.exclusive import overlap
from ddscope.structured.schema import (ASSERTIONS, checker, combined_beside, fixed_values, pointed, subschemas, types,
                                       value_key)

MINS = ("minimum", "minLength", "minItems", "minProperties")  # merged: the larger bound
MAXES = ("maximum", "maxLength", "maxItems", "maxProperties")
MAX_BRANCHES = 64  # two anyOfs merged: at most this many pairs


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
        rest = merged(rest, inlined(branch, root, local))  # type: ignore[arg-type]
        if not isinstance(rest, dict):
            return node
    kinds = [k for k in ("anyOf", "oneOf") if isinstance(rest.get(k), list)]
    if len(kinds) > 1:
        return node
    if not kinds:
        return rest
    beside = {k: v for k, v in rest.items() if k != kinds[0]}
    asserted = {k: v for k, v in beside.items() if k in ASSERTIONS | {"type", "const", "enum"}}
    branches = [merged(asserted, inlined(b, root, local)) for b in rest[kinds[0]]]
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
        props, required = node.get("properties"), node.get("required")
        for name in required if isinstance(props, dict) and isinstance(required, list) else ():
            if isinstance(name, str) and props.get(name) is False:
                return f"{path}.properties.{name}"
    return None


def narrowed(node: dict[str, Any], draft: Any) -> Any:
    """A const or enum beside other assertions as the values among them that pass the rest (exact: an instance is
    one of them); `false` where none does. Checked by jsonschema under the document's draft (`draft`: its
    `$schema`), formats included; as it was where the rest holds a $ref or does not read."""
    values = fixed_values(node)
    rest = {k: v for k, v in node.items() if k in ASSERTIONS | {"type"}}
    both = "const" in node and "enum" in node  # xgrammar would read the enum alone
    if values is None or not (rest or both) or "$ref" in json.dumps(rest):
        return node
    try:
        check = checker(rest, draft, formats=True)
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
    props, required = node.get("properties"), node.get("required")
    return types(node) == {"object"} and isinstance(props, dict) and isinstance(required, list) and any(
        isinstance(name, str) and props.get(name) is False for name in required)


def inlined(branch: Any, root: Any, local: bool) -> Any:
    """A branch that is a local $ref alone, as its target where that is no $ref itself (one hop: a chain's middle
    $ref may carry siblings, which later drafts apply; the $refs inside the target still point where they did)."""
    if isinstance(branch, dict) and set(branch) == {"$ref"} and local and str(branch["$ref"]).startswith("#/"):
        target = pointed(branch["$ref"], root)
        return target if isinstance(target, dict) and "$ref" not in target else branch
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
    if not _mergeable(a, b) or not _mergeable(b, a):
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
    if fixed_values(a) is not None and fixed_values(b) is not None:  # both bound the values: those of both
        theirs = {value_key(v) for v in fixed_values(b)}  # type: ignore[union-attr]
        both = [v for v in fixed_values(a) if value_key(v) in theirs]  # type: ignore[union-attr]
        if not both:
            return False
        out = {k: v for k, v in out.items() if k != "const"} | {"enum": both}
    return _closed_over(a, b, out)


def _mergeable(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether a keyword of `a` reads `b`'s in a way one node cannot hold: additionalProperties against the other's
    patterns, items against the other's prefixItems, contains counts, unevaluated*, a draft 4 exclusive bound."""
    def differs(k: str) -> bool:
        return k in b and a.get(k) != b.get(k)
    if a.get("patternProperties") and (differs("patternProperties") or b.get("additionalProperties", True) is not True
                                       or "properties" in b):
        return False
    if any(k in a for k in ("prefixItems", "additionalItems")) or isinstance(a.get("items"), list):
        if any(differs(k) or k in b and k not in a for k in ("prefixItems", "additionalItems", "items")):
            return False
    if any(k in a and (differs(k) or k not in b) for k in ("contains", "minContains", "maxContains")) and any(
            k in b for k in ("contains", "minContains", "maxContains")):
        return False
    if any(k in a or k in b for k in ("unevaluatedProperties", "unevaluatedItems")) and a != b:
        return False
    return not any(isinstance(a.get(k), bool) for k in ("exclusiveMinimum", "exclusiveMaximum"))


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
        extra = True if extra == {} else extra  # {} takes anything, as true does
        for name in set(other.get("properties") or {}) - set(side.get("properties") or {}):
            if extra is False:
                props[name] = False
            elif extra is not True:
                return None
    if props:
        out["properties"] = props
    return out
