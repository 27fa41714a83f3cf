"""Whether no instance can match two of a oneOf's branches (`exclusive`), so that it means what anyOf does: proved
from what the branches say, conservatively (a branch it cannot read overlaps every other)."""
from __future__ import annotations

import math
import re
from typing import Any

from ddscope.structured.schema import checker, rebuild, resolved, types, value_key, values_of

LITERAL = re.compile(r"\^([^\\.^$|?*+()\[\]{}]*)\$")  # a pattern that one string matches (and it with a "\n")


def exclusive(branches: list[Any], root: Any, local: bool, within: set[str] | None = None) -> bool:
    """Whether no instance can match two of `branches`, so that oneOf means what anyOf does. Each pair is apart by:
    - JSON types (named, or those of its const/enum values, its anyOf or its allOf);
    - values: const, enum, or a pattern that one string matches;
    - numbers: bounds that do not meet;
    - every branch of one's anyOf/oneOf being apart from the other;
    - objects both: one requires more properties than the other allows, or requires a property the other names,
      its values apart so (a discriminator), or one the other, closed, does not name.
    Only what it can read counts: a branch without a type, behind a $ref outside the document (or inside one with
    resources of its own, `$id`s below the root), or malformed, overlaps every other. `local`: the document holds no
    resources below its root (`resources`); `within`: the types the oneOf's own subschema allows, in which an
    untyped branch is read."""
    draft = str(root.get("$schema", "")) if isinstance(root, dict) else ""
    if "draft-03" in draft:
        return False  # its type, required and extends are read otherwise
    if "draft-04" in draft:  # no const
        root, branches = rebuild(root, _no_const), [rebuild(b, _no_const) for b in branches]
    try:
        read = [_typed(resolved(b, root, local), within) for b in branches]
        return all(_apart(a, b, root, local, 0) for i, a in enumerate(read) for b in read[i + 1:])
    except (TypeError, AttributeError, ValueError, RecursionError):  # not JSON Schema as read here
        return False


def _no_const(node: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k != "const"}


def _typed(node: dict[str, Any], within: set[str] | None) -> dict[str, Any]:
    """`node` read within the types its context allows (an instance of another type is refused anyway)."""
    return {**node, "type": sorted(within)} if within and not types(node) else node


def _apart(a: dict[str, Any], b: dict[str, Any], root: Any, local: bool, depth: int) -> bool:
    ka, kb = _kinds(a, root, local), _kinds(b, root, local)
    if ka and kb and not any(overlap(x, y) for x in ka for y in kb):
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not va & vb:
        return True
    if ka and kb and ka | kb <= {"integer", "number"} and _bounds_apart(a, b, _draft4(root)):
        return True
    if _refuses(b, a, root, local) or _refuses(a, b, root, local):
        return True
    if depth < 4 and any(_split_apart(x, y, root, local, depth) for x, y in ((a, b), (b, a))):
        return True
    if not types(a) == types(b) == {"object"}:  # `required` binds objects only: a string would match both
        return False
    pa, pb = a.get("properties", {}), b.get("properties", {})
    if not isinstance(pa, dict) or not isinstance(pb, dict):
        return False
    ra, rb = set(a.get("required") or ()), set(b.get("required") or ())
    if (_closed(a) and rb - set(pa)) or (_closed(b) and ra - set(pb)):
        return True
    if len(ra) > b.get("maxProperties", math.inf) or len(rb) > a.get("maxProperties", math.inf):
        return True
    # a property one requires and the other names (so checks, when present), its values apart
    return depth < 4 and any(_apart(resolved(pa[k], root, local), resolved(pb[k], root, local), root, local, depth + 1)
                             for k in (ra | rb) & set(pa) & set(pb))


def _split_apart(x: dict[str, Any], y: dict[str, Any], root: Any, local: bool, depth: int) -> bool:
    """Whether every branch of `x`'s anyOf or oneOf (one of which each instance of `x` matches) is apart from `y`."""
    parts = next((x[k] for k in ("anyOf", "oneOf") if isinstance(x.get(k), list) and x[k]), None)
    return parts is not None and all(
        _apart(_typed(resolved(p, root, local), types(x)), y, root, local, depth + 1) for p in parts)


def _values(node: dict[str, Any]) -> set[tuple[str, str]] | None:
    """values_of, or the strings a string's pattern alone lets through where they are one literal."""
    found = values_of(node)
    if found is not None or types(node) != {"string"} or not isinstance(node.get("pattern"), str):
        return found
    lit = LITERAL.fullmatch(node["pattern"])
    return {("string", value_key(s)) for s in (lit.group(1), lit.group(1) + "\n")} if lit else None


def _bounds_apart(a: dict[str, Any], b: dict[str, Any], draft4: bool) -> bool:
    """Whether the numbers `a` allows and those `b` allows lie in intervals that do not meet."""
    bounds = [(_bound(n, "minimum", "exclusiveMinimum", -math.inf, draft4),
               _bound(n, "maximum", "exclusiveMaximum", math.inf, draft4)) for n in (a, b)]
    if any(x is None for pair in bounds for x in pair):
        return False
    ((alo, alo_open), (ahi, ahi_open)), ((blo, blo_open), (bhi, bhi_open)) = bounds  # type: ignore[misc]
    return ahi < blo or bhi < alo or (ahi == blo and (ahi_open or blo_open)) or (bhi == alo and (bhi_open or alo_open))


def _bound(node: dict[str, Any], inclusive: str, exclusive_key: str, none: float,
           draft4: bool) -> tuple[float, bool] | None:
    """(the bound, whether it is open), the tighter of both keywords; None where one is not of its draft's kind
    (draft 4: `exclusive*` a boolean opening the inclusive bound; later drafts: a number, a bound of its own)."""
    edge, strict = node.get(inclusive), node.get(exclusive_key)
    if edge is not None and not _number(edge) or strict is not None and (
            not isinstance(strict, bool) if draft4 else not _number(strict)):
        return None
    found = [(edge, strict is True)] if _number(edge) else []
    found += [(strict, True)] if _number(strict) else []
    if not found:
        return none, False
    pick = max if none < 0 else min
    value = pick(v for v, _ in found)
    return value, any(open_ for v, open_ in found if v == value)


def _draft4(root: Any) -> bool:
    return isinstance(root, dict) and any(d in str(root.get("$schema", "")) for d in ("draft-03", "draft-04"))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _refuses(values: dict[str, Any], other: dict[str, Any], root: Any, local: bool) -> bool:
    """Whether `other` refuses every value `values`'s const or enum allows (checked by jsonschema, its refs read
    against the root)."""
    found = [values["const"]] if "const" in values else values.get("enum")
    if not isinstance(found, list) or not local:
        return False
    try:
        check = checker(root, root.get("$schema") if isinstance(root, dict) else None).evolve(schema=other)
        return not any(check.is_valid(x) for v in found for x in _forms(v))
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot read here: not proved apart
        return False


def _forms(v: Any) -> list[Any]:
    """A value as an instance may write it: an integral number as an integer and as a float (1 and 1.0 are one to
    an enum, not to draft 4's integer)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and float(v).is_integer():
        return [v, int(v), float(v)]
    return [v]


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
