"""Whether no instance can match two of a oneOf's branches (`exclusive`), so that it means what anyOf does: proved
from what the branches say, conservatively (a branch it cannot read overlaps every other)."""
from __future__ import annotations

from typing import Any

from ddscope.structured.schema import checker, resolved, types, values_of


def exclusive(branches: list[Any], root: Any, local: bool) -> bool:
    """Whether no instance can match two of `branches`, so that oneOf means what anyOf does: each pair allows
    apart JSON types (named, or those of its const/enum values, its anyOf or its allOf), or apart const/enum
    values, or, objects both, requires a property whose values are apart so (a discriminator), or a property the
    other, closed, does not name. Only what it can read counts: a branch without a type, behind a $ref outside the
    document (or inside one with resources of its own, `$id`s below the root), or malformed, overlaps every
    other. `local`: the document holds no resources below its root (`resources`)."""
    if isinstance(root, dict) and any(f"draft-0{n}" in str(root.get("$schema", "")) for n in (3, 4)):
        return False  # draft 4 has no const, and its integer refuses 1.0: values are not read as later drafts do
    try:
        read = [resolved(b, root, local) for b in branches]
        return all(_apart(a, b, root, local, 0) for i, a in enumerate(read) for b in read[i + 1:])
    except (TypeError, AttributeError, ValueError, RecursionError):  # not JSON Schema as read here
        return False


def _apart(a: dict[str, Any], b: dict[str, Any], root: Any, local: bool, depth: int) -> bool:
    ka, kb = _kinds(a, root, local), _kinds(b, root, local)
    if ka and kb and not any(overlap(x, y) for x in ka for y in kb):
        return True
    va, vb = values_of(a), values_of(b)
    if va is not None and vb is not None and not va & vb:
        return True
    if _refuses(b, a, root, local) or _refuses(a, b, root, local):
        return True
    if not types(a) == types(b) == {"object"}:  # `required` binds objects only: a string would match both
        return False
    pa, pb = a.get("properties", {}), b.get("properties", {})
    if not isinstance(pa, dict) or not isinstance(pb, dict):
        return False
    ra, rb = set(a.get("required") or ()), set(b.get("required") or ())
    if (_closed(a) and rb - set(pa)) or (_closed(b) and ra - set(pb)):
        return True
    return depth < 4 and any(_apart(resolved(pa.get(k), root, local), resolved(pb.get(k), root, local), root, local,
                                    depth + 1) for k in ra & rb)


def _refuses(values: dict[str, Any], other: dict[str, Any], root: Any, local: bool) -> bool:
    """Whether `other` refuses every value `values`'s const or enum allows (checked by jsonschema, its refs read
    against the root)."""
    found = [values["const"]] if "const" in values else values.get("enum")
    if not isinstance(found, list) or not local:
        return False
    try:
        check = checker(root, root.get("$schema") if isinstance(root, dict) else None).evolve(schema=other)
        return not any(check.is_valid(v) for v in found)
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot read here: not proved apart
        return False


def _kinds(node: dict[str, Any], root: Any, local: bool, depth: int = 0) -> set[str]:
    """The JSON types an instance of `node` can have, as far as it says (empty: any)."""
    if types(node) or depth > 8:
        return types(node)
    if (values := values_of(node)) is not None:
        return {kind for kind, _ in values}
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key]:
            found = [_kinds(resolved(b, root, local), root, local, depth + 1) for b in node[key]]
            if all(found):
                return set().union(*found)
    known = [k | ({"integer"} if "number" in k else set())  # every integer is a number
             for b in node.get("allOf") or () if (k := _kinds(resolved(b, root, local), root, local, depth + 1))]
    return set.intersection(*known) if known else set()


def _closed(node: dict[str, Any]) -> bool:
    """An object that takes no property but those it names."""
    return node.get("additionalProperties") is False and not node.get("patternProperties")


def overlap(x: str, y: str) -> bool:
    return x == y or {x, y} == {"integer", "number"}
