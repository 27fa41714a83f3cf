"""`uniqueItems`, which neither backend enforces, kept beside either of them: the backend compiles the schema
without it, and a scanner that follows the output's JSON (ddscope.structured.json_scan) vetoes each token that
would finish an item equal (as JSON compares values) to one before it in an array the schema keeps unique. Here:
which arrays those are and how their items must go on (`Plan`, `Rule`), read off the schema.

A veto must never leave the output with nowhere to go, so only items that can always go on another way are taken:
strings, numbers and integers without limits on what may follow (a repeat's end refused, the item goes on: only an
integer's 0 cannot), and fixed values (const, enum, true, false, null), whose partial item must stay the start of
one not used yet, a comma needing one left. Objects are kept unique by a required property that is an open string
(narrower than uniqueItems: two that share it are refused). Other objects, arrays, limited strings, limits on the
items from outside the node's own `items`, and $refs the plan cannot follow keep uniqueItems a gap, refused by name.

The array's rule is read from the path its output reaches (`Plan.rule`), over every branch that may apply there:
where any says unique, items are kept unique. Where another branch there takes repeats, that may strand an output
the other branch allows: the fill then raises rather than serve a repeat.
"""
from __future__ import annotations

import copy
import json
import math
import re
from decimal import Decimal
from typing import Any, NamedTuple


from ddscope.structured.schema import (ASSERTIONS, canonical, ref_beside, resolved, resources, subschemas, types,
                                       value_key)

SPACE = frozenset(b" \t\n\r")
ENDS = SPACE | frozenset(b",]}")  # what ends a number or a literal
STRING_LIMITS = {"pattern", "format", "maxLength", "enum", "const", "not", "if", "allOf", "anyOf", "oneOf", "$ref"}
Path = tuple[str | int, ...]


class Rule(NamedTuple):
    """How an array's items stay unique. `forms`: the values of its fixed branches (const, enum, true, false,
    null), each one's texts by its key; `open`: the kinds one branch takes whole ("string", "number", "integer";
    "literal": no check). A partial item must still go to a value not used yet: one of an open kind (an integer
    that is 0 so far has no other), or an unused fixed value it starts."""
    forms: dict[str, tuple[bytes, ...]]
    open: frozenset[str]
    keys: frozenset[str] = frozenset()  # object items: required open strings, each kept unique where present

    def __or__(self, other: Rule) -> Rule:  # type: ignore[override]
        return Rule({**self.forms, **other.forms}, self.open | other.open, self.keys | other.keys)

    def stuck(self, used: frozenset[str], partial: bytes | None) -> bool:
        """Whether an item that starts `partial` (None: after a comma, none begun) can only repeat one."""
        unused = {key: texts for key, texts in self.forms.items() if key not in used}
        if partial is None:
            return not self.open and not unused and not self.keys
        if partial[:1] == b"{" and self.keys:
            return False  # its key, an open string, goes on another way
        if partial[:1] == b'"':
            text = None if "string" in self.open else _decoded(partial)
            return text is not None and not any(json.loads(k).startswith(text) for k in unused if k[:1] == '"')
        if any(t.startswith(partial) for texts in unused.values() for t in texts):
            return False
        if partial[:1] not in b"-0123456789":
            return "literal" not in self.open
        if "number" in self.open:  # a zero with an exponent stays 0 whatever digits follow
            return ZERO in used and ZERO_EXPONENT.fullmatch(partial) is not None
        if "integer" in self.open:  # an integer's 0 goes on to nothing else; a fraction is no integer
            return ZERO in used and partial in (b"0", b"-0") or re.search(rb"[.eE]", partial) is not None
        return True


ZERO = "#0"  # value_key(0)
ZERO_EXPONENT = re.compile(rb"-?0(\.0*)?[eE][-+]?[0-9]*")
ANY = Rule({}, frozenset({"string", "number", "literal"}))  # where an array need not be unique: no partial checked
NUMBER_LIMITS = {"maximum", "exclusiveMaximum", "multipleOf", "not", "if", "allOf", "anyOf", "oneOf", "$ref"}
VALUES = {"type", "enum", "const"}


def _decoded(partial: bytes) -> str | None:
    """A partial string item's text so far (an unfinished escape or character left out); None where unread."""
    content = UNFINISHED_ESCAPE.sub(rb"\1", partial[1:])
    try:
        return json.loads('"' + content.decode("utf-8", errors="ignore") + '"')
    except ValueError:
        return None


UNFINISHED_ESCAPE = re.compile(rb"(?<!\\)((?:\\\\)*)\\(?:u[0-9a-fA-F]{0,3})?$")


class Plan:
    """Where the output's arrays must hold unique items, read off the schema as the output reaches them."""

    def __init__(self, root: Any):
        self.root, self.local = root, not resources(root)
        self._nodes: dict[Path, list[dict[str, Any]]] = {(): self._expand([root])}
        self._rules: dict[Path, Rule | None] = {}

    def item_rule(self, node: dict[str, Any]) -> Rule | None:
        """The rule of an array subschema's items; None where their kind is not one a veto can steer (an object
        without a required open string, a string with a length limit or a pattern that may not go on: a partial
        one may have no way on but a repeat)."""
        leaves = self._leaves(node.get("items"))
        rules = [_leaf_rule(leaf) or self._keyed(leaf) for leaf in leaves or ()]
        if not rules or any(r is None for r in rules) or len({k for r in rules for k in r.keys}) > 1:
            return None
        out = Rule({}, frozenset())
        for r in rules:
            out |= r  # type: ignore[operator]
        return out

    def rule(self, path: Path) -> Rule | None:
        """How the array at `path` of the output keeps its items unique; None: it need not."""
        if path not in self._rules:
            nodes = self.nodes(path)
            rules = [r for n in nodes if _unique(n) and (r := self.item_rule(n)) is not None]
            rule = None
            for r in rules + ([ANY] if rules and not all(_unique(n) for n in nodes if _array(n)) else []):
                rule = r if rule is None else rule | r
            self._rules[path] = rule
        return self._rules[path]

    def nodes(self, path: Path) -> list[dict[str, Any]]:
        """Every subschema that may apply at `path`: $refs followed, every branch of allOf, anyOf and oneOf."""
        if path not in self._nodes:
            step = path[-1]
            self._nodes[path] = self._expand([c for n in self.nodes(path[:-1]) for c in _children(n, step)])
        return self._nodes[path]

    def _expand(self, nodes: list[Any]) -> list[dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        todo = [n for n in nodes if isinstance(n, dict)]
        while todo:
            n = todo.pop()
            if id(n) in out:
                continue
            out[id(n)] = n
            if "$ref" in n:
                todo.append(self._target(n))
            todo += [b for k in ("allOf", "anyOf", "oneOf") if isinstance(n.get(k), list) for b in n[k]
                     if isinstance(b, dict)]
        return list(out.values())

    def _keyed(self, leaf: dict[str, Any]) -> Rule | None:
        """An object's rule: its first required property whose value is an open string, kept unique; two objects
        that differ there differ (narrower than uniqueItems: two that share it are refused however else they
        differ). None where there is none, or where keywords beside may bind it (patternProperties, combinators)."""
        props, required = leaf.get("properties"), leaf.get("required")
        if types(leaf) != {"object"} or not isinstance(props, dict) or not isinstance(required, list) or \
                set(leaf) & (ALONGSIDE | {"patternProperties", "propertyNames", "dependencies", "dependentSchemas"}):
            return None
        for name in required:
            value = props.get(name)
            value = self._target(value) if isinstance(value, dict) and "$ref" in value and len(value) == 1 else value
            rule = _leaf_rule(value) if isinstance(value, dict) else None
            if rule is not None and rule.open == {"string"} and not rule.forms:
                return Rule({}, frozenset(), frozenset({name}))
        return None

    def _target(self, node: dict[str, Any]) -> Any:
        return self.root if node["$ref"] == "#" else resolved(node, self.root, self.local)

    def _leaves(self, node: Any, depth: int = 0) -> list[dict[str, Any]] | None:
        """An items schema as the union of its branches (refs followed); None where it is not only that."""
        if not isinstance(node, dict) or ref_beside(node) or depth > 16:
            return None
        node = self._target(node) if "$ref" in node else node
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and not set(node) & (ASSERTIONS | VALUES) - {key}:
                found = [self._leaves(b, depth + 1) for b in node[key]]
                return None if any(f is None for f in found) else [x for f in found for x in f]  # type: ignore
        return [node] if node else None


def enforced(schema: Any) -> tuple[Any, Plan | None]:
    """`schema` without the uniqueItems a scanner keeps (or that cannot matter: at most one item), and the plan
    that keeps them; None where it keeps none. The others stay, for the backends to refuse: items it cannot steer,
    limits on them from outside the node's own `items` (prefixItems, its allOf, an allOf it is a branch of), and
    every one in a document whose $refs the plan cannot follow (an anchor, another resource)."""
    nodes = list(subschemas(schema))
    if not any("uniqueItems" in n for n, _ in nodes):
        return schema, None
    plan = Plan(schema)
    refs = [n["$ref"] for n, _ in nodes if isinstance(n.get("$ref"), str)]
    if not plan.local or any(r != "#" and not r.startswith("#/") for r in refs):
        return schema, None
    conjoined = {id(plan._target(b) if "$ref" in b else b) for n, _ in nodes for b in n.get("allOf") or ()
                 if isinstance(b, dict)}
    kept = False

    def steered(n: dict[str, Any]) -> bool:
        return plan.item_rule(n) is not None and not set(n) & ALONGSIDE and not isinstance(n.get("items"), list)

    def removable(n: dict[str, Any]) -> bool:
        nonlocal kept
        unique = n["uniqueItems"] is True and not _trivial(n)
        if unique and (id(n) in conjoined or not steered(n)):
            return False
        kept |= unique
        return isinstance(n["uniqueItems"], bool)
    stripped = copy.deepcopy(schema)
    for (original, _), (mine, _) in zip(nodes, list(subschemas(stripped))):
        if "uniqueItems" in original and removable(original):
            del mine["uniqueItems"]
    return stripped, plan if kept else None


ALONGSIDE = {"prefixItems", "additionalItems", "allOf", "anyOf", "oneOf", "$ref", "contains", "not", "if"}


def _unique(n: dict[str, Any]) -> bool:
    return n.get("uniqueItems") is True and not _trivial(n)


def _trivial(n: dict[str, Any]) -> bool:
    """At most one item: unique whatever it is."""
    return isinstance(n.get("maxItems"), (int, float)) and n["maxItems"] <= 1


def _array(n: dict[str, Any]) -> bool:
    return "array" in types(n) or (not types(n) and any(k in n for k in ("items", "prefixItems", "minItems",
                                                                             "maxItems", "uniqueItems")))


def _leaf_rule(leaf: dict[str, Any]) -> Rule | None:
    """A branch of the items as a rule: its fixed values, or the kinds it takes whole; None: neither."""
    values = leaf.get("enum") if isinstance(leaf.get("enum"), list) else [leaf["const"]] if "const" in leaf else None
    if values is not None:
        if any(isinstance(v, (list, dict)) for v in values):
            return None
        return Rule({value_key(v): tuple(sorted(_texts(v))) for v in values}, frozenset())
    named = types(leaf)
    if not named or named & {"object", "array"}:
        return None
    limits = set(leaf) & STRING_LIMITS - ({"pattern"} if GOES_ON.fullmatch(str(leaf.get("pattern"))) else set())
    if "string" in named and limits or named & {"number", "integer"} and (
            set(leaf) & NUMBER_LIMITS or _below_zero(leaf)):
        return None
    literals = ([True, False] if "boolean" in named else []) + ([None] if "null" in named else [])
    return Rule({value_key(v): tuple(sorted(_texts(v))) for v in literals}, frozenset(named & {"string", "number",
                                                                                              "integer"}))


# A pattern every match of which goes on to another, one more character of its last class (a sequence that ends in
# a repeated class, anchored; no group, alternative, anchor or word boundary before): a repeat's end refused, the
# string goes on
GOES_ON = re.compile(r"\^?(?:[^|()\[\\$^]|\\[^bBAZzG]|\[(?:[^\]\\]|\\.)+\])*\[(?:[^\]\\]|\\.)+\][*+]\$")


def _below_zero(leaf: dict[str, Any]) -> bool:
    """Whether a number may be negative under a lower bound: a digit more may then fall below it."""
    bounds = [leaf[k] for k in ("minimum", "exclusiveMinimum") if k in leaf]
    return any(not isinstance(b, (int, float)) or b < 0 for b in bounds)


def _texts(v: Any) -> set[bytes]:
    """The ways a backend may write `v`: as the schema gives it, and canonical, ASCII-escaped or not; a float also
    in plain decimal (guidance writes 1e-07 as 0.0000001)."""
    texts = {json.dumps(x, ensure_ascii=a).encode() for x in (v, canonical(v)) for a in (True, False)}
    return texts | ({format(Decimal(repr(v)), "f").encode()} if isinstance(v, float) and math.isfinite(v) else set())


def _children(n: dict[str, Any], step: str | int) -> list[Any]:
    """The subschemas of `n` for its property `step` (a name) or its item `step` (an index)."""
    if isinstance(step, str):
        props, patterns = n.get("properties"), n.get("patternProperties")
        found = [props[step]] if isinstance(props, dict) and step in props else []
        if isinstance(patterns, dict):
            found += [s for p, s in patterns.items() if _search(p, step)]
        extra = n.get("additionalProperties")
        return found or ([extra] if isinstance(extra, dict) else [])
    items = n.get("prefixItems") if isinstance(n.get("prefixItems"), list) else n.get("items")
    if isinstance(items, list):
        rest = n.get("items") if "prefixItems" in n else n.get("additionalItems")
        return [items[step]] if step < len(items) else [rest] if isinstance(rest, dict) else []
    return [items] if isinstance(items, dict) else []


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return True  # a pattern Python cannot read may match: its schema may apply
