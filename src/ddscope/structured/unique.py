"""`uniqueItems`, which neither backend enforces, enforced beside either of them: the backend compiles the schema
without it, and a scanner that follows the output's JSON vetoes each token that would finish an item equal (as
JSON compares values) to one before it in an array the schema keeps unique. A veto must never leave the output
with nowhere to go, so only items that can always go on another way are taken: strings, numbers and integers
without limits on what may follow (a repeat's end refused, the item goes on: only an integer's 0 cannot), and
fixed values (const, enum, true, false, null), whose partial item must stay the start of one not used yet, a
comma needing one left. Objects, arrays and limited strings keep uniqueItems a gap, refused by name.

The array's rule is read from the path its output reaches (`Plan.rule`), over every branch that may apply there:
where any says unique, items are kept unique. Where another branch there takes repeats, that may strand an output
the other branch allows: the fill then raises rather than serve a repeat.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from ddscope.structured.backend import Compiled, Matcher
from ddscope.structured.constraint import Constraint
from ddscope.structured.schema import (ASSERTIONS, canonical, rebuild, ref_beside, resolved, resources, subschemas,
                                       types)

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

    def __or__(self, other: Rule) -> Rule:  # type: ignore[override]
        return Rule({**self.forms, **other.forms}, self.open | other.open)

    def stuck(self, used: frozenset[str], partial: bytes | None) -> bool:
        """Whether an item that starts `partial` (None: after a comma, none begun) can only repeat one."""
        unused = [texts for key, texts in self.forms.items() if key not in used]
        if partial is None:
            return not self.open and not unused
        if b"\\" in partial or any(t.startswith(partial) for texts in unused for t in texts):
            return False
        kind = "string" if partial[:1] == b'"' else "number" if partial[:1] in b"-0123456789" else "literal"
        if kind == "number" and "number" not in self.open and "integer" in self.open:
            return partial in (b"0", b"-0") and "0" in used  # an integer's 0 goes on to nothing else
        return kind not in self.open


ANY = Rule({}, frozenset({"string", "number", "literal"}))  # where an array need not be unique: no partial checked
NUMBER_LIMITS = {"maximum", "exclusiveMaximum", "multipleOf", "not", "if", "allOf", "anyOf", "oneOf", "$ref"}
VALUES = {"type", "enum", "const"}


def value_key(v: Any) -> str:
    """A value as JSON compares it (1 == 1.0, keys in any order)."""
    return json.dumps(canonical(v), sort_keys=True)


class Plan:
    """Where the output's arrays must hold unique items, read off the schema as the output reaches them."""

    def __init__(self, root: Any):
        self.root, self.local = root, not resources(root)
        self._nodes: dict[Path, list[dict[str, Any]]] = {(): self._expand([root])}
        self._rules: dict[Path, Rule | None] = {}

    def item_rule(self, node: dict[str, Any]) -> Rule | None:
        """The rule of an array subschema's items; None where their kind is not one a veto can steer (an object,
        a string with a pattern or a length limit: a partial one may have no way on but a repeat)."""
        leaves = self._leaves(node.get("items"))
        rules = [_leaf_rule(leaf) for leaf in leaves or ()]
        if not rules or any(r is None for r in rules):
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
                todo.append(resolved(n, self.root, self.local))
            todo += [b for k in ("allOf", "anyOf", "oneOf") if isinstance(n.get(k), list) for b in n[k]
                     if isinstance(b, dict)]
        return list(out.values())

    def _leaves(self, node: Any) -> list[dict[str, Any]] | None:
        """An items schema as the union of its branches (refs followed); None where it is not only that."""
        if not isinstance(node, dict) or ref_beside(node):
            return None
        node = resolved(node, self.root, self.local) if "$ref" in node else node
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and not set(node) & (ASSERTIONS | VALUES) - {key}:
                found = [self._leaves(b) for b in node[key]]
                return None if any(f is None for f in found) else [x for f in found for x in f]  # type: ignore
        return [node] if node else None


def enforced(schema: Any) -> tuple[Any, Plan | None]:
    """`schema` without the uniqueItems a scanner keeps (or that cannot matter: at most one item), and the plan
    that keeps them; None where it keeps none. The others stay, for the backends to refuse."""
    if not any("uniqueItems" in n for n, _ in subschemas(schema)):
        return schema, None
    plan = Plan(schema)
    kept = False

    def drop(n: dict[str, Any]) -> dict[str, Any]:
        nonlocal kept
        if "uniqueItems" not in n or (n["uniqueItems"] is True and not _trivial(n) and plan.item_rule(n) is None):
            return n
        kept |= n["uniqueItems"] is True and not _trivial(n)
        return {k: v for k, v in n.items() if k != "uniqueItems"} if isinstance(n["uniqueItems"], bool) else n
    stripped = rebuild(schema, drop)
    return stripped, plan if kept else None


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
    if "string" in named and set(leaf) & STRING_LIMITS or named & {"number", "integer"} and (
            set(leaf) & NUMBER_LIMITS or _below_zero(leaf)):
        return None
    literals = ([True, False] if "boolean" in named else []) + ([None] if "null" in named else [])
    return Rule({value_key(v): tuple(sorted(_texts(v))) for v in literals}, frozenset(named & {"string", "number",
                                                                                              "integer"}))


def _below_zero(leaf: dict[str, Any]) -> bool:
    """Whether a number may be negative under a lower bound: a digit more may then fall below it."""
    bounds = [leaf[k] for k in ("minimum", "exclusiveMinimum") if k in leaf]
    return any(not isinstance(b, (int, float)) or b < 0 for b in bounds)


def _texts(v: Any) -> set[bytes]:
    """The ways a backend may write `v`: as the schema gives it, and canonical, ASCII-escaped or not."""
    return {json.dumps(x, ensure_ascii=a).encode() for x in (v, canonical(v)) for a in (True, False)}


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


class Tokens:
    """Each token's bytes (xgrammar's decoded vocabulary), and which tokens can finish a value from each place a
    scanner can be: found once per tokenizer, so a fill tests only those."""

    def __init__(self, texts: list[bytes]):
        self.texts = texts
        quotes = np.array([t.count(b'"') for t in texts])
        self.quoted = quotes > 0  # may close the string it is in
        self.ending = np.array([any(c in ENDS for c in t) for t in texts])  # may end the number it is in
        scalar = re.compile(rb'[-0-9a-z][^"]*[\s,\]}]')
        self.closing = np.array([b"]" in t or b"}" in t or q > 1 or scalar.search(t) is not None
                                 for t, q in zip(texts, quotes)])  # may finish a value from between values
        # From between values, tokens that only begin a string, or an integer other than 0, or neither
        self.opens_string = np.array([re.fullmatch(rb'[\s,]*("[^"\\]*)?', t) is not None for t in texts])
        self.opens_number = np.array([re.fullmatch(rb"[\s,]*(-?[1-9][0-9]*)?", t) is not None for t in texts])
        self.before_quote: dict[bytes, list[int]] = {}  # a plain token's text before its one quote
        tricky = []
        for i, t in enumerate(texts):
            head, _, tail = t.partition(b'"')
            if not self.quoted[i]:
                continue
            if b"\\" in head or b'"' in tail or any(c not in SPACE and c not in b",:" for c in tail):
                tricky.append(i)
            else:
                self.before_quote.setdefault(head, []).append(i)
        self.tricky = np.array(tricky, dtype=np.int64)  # quoted tokens a plain string's end does not cover


# The scanner: where in the JSON the output is. Modes:
OUT, STRING, ESCAPE, SCALAR = range(4)


@dataclass(frozen=True)
class Frame:
    """An open object or array of the output."""
    array: bool
    path: Path
    rule: Rule | None = None
    used: frozenset[str] = frozenset()  # arrays under a rule: their finished items' keys
    count: int = 0  # arrays: items begun
    start: int = -1  # arrays: where the current item began
    key: str = ""  # objects: the current property


@dataclass(frozen=True)
class Scan:
    frames: tuple[Frame, ...] = ()
    mode: int = OUT
    start: int = -1  # where the current string or scalar began
    is_key: bool = False  # the current string names a property
    want_key: bool = False  # objects: a string here names a property
    comma: bool = False  # arrays: a comma read, its item not begun
    done: bool = False  # the root value is finished

    def ruled(self) -> bool:
        return not self.done and any(f.rule is not None for f in self.frames)


class Veto(Exception):
    """The token would finish an item equal to one before it, or leave a fixed-set item nowhere to go."""


def scan(s: Scan, token: bytes, text: bytearray, plan: Plan) -> Scan:
    """The scanner after `token`, read after `text` (the output so far); Veto where the schema refuses it."""
    base, frames = len(text), list(s.frames)
    mode, start, is_key, want_key, comma, done = s.mode, s.start, s.is_key, s.want_key, s.comma, s.done

    def piece(a: int, b: int) -> bytes:
        return bytes(text[a:b]) if b <= base else bytes(text[a:]) + token[max(0, a - base):b - base]

    def begin(at: int) -> None:
        nonlocal comma
        comma = False
        if frames and frames[-1].array:
            frames[-1] = replace(frames[-1], count=frames[-1].count + 1, start=at)

    def finish(end: int) -> None:
        nonlocal done
        if not frames:
            done = True
            return
        top = frames[-1]
        if top.array and top.rule is not None:
            key = value_key(json.loads(piece(top.start, end)))
            if key in top.used:
                raise Veto
            frames[-1] = replace(top, used=top.used | {key})

    def here() -> Path:
        top = frames[-1] if frames else None
        return () if top is None else top.path + ((top.count - 1,) if top.array else (top.key,))

    for j, c in enumerate(token):
        if done:
            break
        at = base + j
        if mode == ESCAPE:
            mode = STRING
            continue
        if mode == STRING:
            if c == 0x5C:  # backslash
                mode = ESCAPE
            elif c == 0x22:  # quote
                mode = OUT
                if is_key:
                    frames[-1] = replace(frames[-1], key=json.loads(piece(start, at + 1)))
                    want_key = False
                else:
                    finish(at + 1)
            continue
        if mode == SCALAR:
            if c not in ENDS:
                continue
            mode = OUT
            finish(at)
        if c in SPACE:
            continue
        if c == 0x22:
            mode, start = STRING, at
            is_key = bool(frames) and not frames[-1].array and want_key
            if not is_key:
                begin(at)
        elif c in b"{[":
            begin(at)
            path = here()
            array = c == 0x5B
            frames.append(Frame(array, path, plan.rule(path) if array else None))
            want_key = not array
        elif c in b"]}":
            frames.pop()
            finish(at + 1)
        elif c == 0x2C:  # comma
            want_key = bool(frames) and not frames[-1].array
            comma = bool(frames) and frames[-1].array
        elif c == 0x3A:  # colon
            want_key = False
        else:
            mode, start = SCALAR, at
            begin(at)
    out = Scan(tuple(frames), mode, start, is_key, want_key, comma, done)
    _check_partial(out, piece, base + len(token))
    return out


def _check_partial(s: Scan, piece: Any, end: int) -> None:
    """Veto where the item the output is in can only go on to repeat one (Rule.stuck)."""
    top = s.frames[-1] if s.frames and not s.done else None
    if top is None or not top.array or top.rule is None:
        return
    if s.mode != OUT and not s.is_key:
        if top.rule.stuck(top.used, piece(s.start, end)):
            raise Veto
    elif s.mode == OUT and s.comma and top.rule.stuck(top.used, None):
        raise Veto


class UniqueCompiled(Compiled):
    """A backend's grammar of the schema without the uniqueItems `plan` keeps, with the scanner that keeps them."""

    def __init__(self, constraint: Constraint, inner: Compiled, plan: Plan, tokens: Tokens):
        super().__init__(constraint, inner.backend)
        self.inner, self.plan, self.tokens = inner, plan, tokens

    def matcher(self) -> Matcher:
        return UniqueMatcher(self.inner.matcher(), self.plan, self.tokens)


class UniqueMatcher:
    def __init__(self, inner: Matcher, plan: Plan, tokens: Tokens):
        self.inner, self.plan, self.tokens = inner, plan, tokens
        self.text = bytearray()
        self.state = Scan()
        self.history: list[tuple[int, Scan]] = []

    def accept(self, token: int) -> bool:
        if not self.inner.accept(token):  # first: the scanner reads only what the grammar allows
            return False
        try:
            after = scan(self.state, self.tokens.texts[token], self.text, self.plan)
        except Veto:
            self.inner.rollback(1)
            return False
        self.history.append((len(self.text), self.state))
        self.text += self.tokens.texts[token]
        self.state = after
        return True

    def rollback(self, tokens: int) -> None:
        self.inner.rollback(tokens)
        if tokens:
            size, self.state = self.history[-tokens]
            del self.history[-tokens:]
            del self.text[size:]

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def forces(self) -> bool:
        return self.inner.forces()

    def fill(self, bitmask: Any) -> None:
        self.inner.fill(bitmask)
        if not self.state.ruled():
            return
        bits = bitmask.numpy()[0].view(np.uint8)
        legal = np.unpackbits(bits, bitorder="little")[:len(self.tokens.texts)].view(bool)
        vetoed = [t for t in self._candidates(legal) if not self._passes(int(t))]
        if not vetoed:
            return
        words = bitmask.numpy()[0].view(np.uint32)
        for t in vetoed:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        if len(vetoed) == int(legal.sum()):
            raise RuntimeError("uniqueItems: every token the grammar allows here repeats an item (a schema whose "
                               "branches keep an array's items unique and not, at once)")

    def _passes(self, token: int) -> bool:
        try:
            scan(self.state, self.tokens.texts[token], self.text, self.plan)
            return True
        except Veto:
            return False

    def _candidates(self, legal: np.ndarray) -> np.ndarray:
        """The legal tokens that may be vetoed here; the rest can neither finish an item nor strand one."""
        s, t = self.state, self.tokens
        top = s.frames[-1]
        rule = top.rule if top.array else None
        if rule is None:  # inside an item of a kept array
            return np.flatnonzero(legal & (t.quoted if s.mode in (STRING, ESCAPE) else
                                           t.ending if s.mode == SCALAR else t.closing))
        strings, numbers = "string" in rule.open, bool(rule.open & {"number", "integer"})
        if s.mode in (STRING, ESCAPE) and strings:
            content = bytes(self.text[s.start + 1:])
            if s.mode == STRING and b"\\" not in content:
                return self._ends_of(content, legal)
            return np.flatnonzero(legal & t.quoted)
        number = s.mode == SCALAR and self.text[s.start] in b"-0123456789"
        if number and ("number" in rule.open or "integer" in rule.open and "0" not in top.used):
            return np.flatnonzero(legal & t.ending)  # it goes on whatever it reads: only its end may repeat one
        if s.mode == OUT and (strings or numbers):
            safe = (t.opens_string if strings else False) | (t.opens_number if numbers else False)
            return np.flatnonzero(legal & ~safe)
        return np.flatnonzero(legal)  # a fixed set's: the grammar holds them to its values' starts, few

    def _ends_of(self, content: bytes, legal: np.ndarray) -> np.ndarray:
        """In a string item: the plain tokens that close it as one already used, and the tricky ones."""
        t = self.tokens
        found = [t.tricky[legal[t.tricky]]]
        for key in self.state.frames[-1].used:
            if key.startswith('"'):
                used = json.loads(key).encode()
                if used.startswith(content):
                    found.append(np.array(t.before_quote.get(used[len(content):], []), dtype=np.int64))
        return np.concatenate(found)
