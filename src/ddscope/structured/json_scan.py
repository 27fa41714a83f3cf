"""The scanner that follows an output's JSON byte by byte (`scan`: where it is, each open array's finished items)
and the matcher that keeps uniqueItems with it beside a backend's (`UniqueMatcher`): a token is refused where
the scanner would finish an item equal to one before it, or leave a partial item no way on but a repeat
(ddscope.structured.unique's `Rule`). A fill reads only the tokens that may be refused here (`Tokens`' masks)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

import numpy as np

from ddscope.structured.backend import Compiled, Matcher
from ddscope.structured.constraint import Constraint
from ddscope.structured.schema import value_key
from ddscope.structured.unique import ENDS, SPACE, Path, Plan, Rule


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
        self.opening = np.array([b"[" in t for t in texts]) & self.closing  # may open an array and finish an item
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
            item = piece(top.start, end)
            if top.rule.keys and item[:1] == b"{":
                return  # kept unique by its key properties (keyed)
            key = value_key(json.loads(item, parse_float=Decimal, parse_int=Decimal))
            if key in top.used:
                raise Veto
            frames[-1] = replace(top, used=top.used | {key})

    def keyed(begun: int, end: int) -> None:
        """A string value finished: where it is a key property of an object item, it must be a new one (two items
        equal hold equal values for every key: a branch's items hold its key, which no other's may repeat)."""
        if len(frames) < 2 or frames[-1].array or not frames[-2].array or frames[-2].rule is None or \
                frames[-1].key not in frames[-2].rule.keys:
            return
        key = f"{frames[-1].key!r} " + value_key(json.loads(piece(begun, end)))
        if key in frames[-2].used:
            raise Veto
        frames[-2] = replace(frames[-2], used=frames[-2].used | {key})

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
                    keyed(start, at + 1)
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
        elif c in b"]}" and frames:
            frames.pop()
            finish(at + 1)
        elif c == 0x2C:  # comma
            want_key = bool(frames) and not frames[-1].array
            comma = bool(frames) and frames[-1].array
        elif c == 0x3A:  # colon
            want_key = False
        else:
            mode, start, is_key = SCALAR, at, False
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
        if self.state.done:
            return
        bits = bitmask.numpy()[0].view(np.uint8)
        legal = np.unpackbits(bits, bitorder="little")[:len(self.tokens.texts)].view(bool)
        # outside a kept array, only a token that opens one and finishes an item in it may repeat one
        ids = self._candidates(legal) if self.state.ruled() else np.flatnonzero(legal & self.tokens.opening)
        vetoed = {int(t) for t in ids if not self._passes(int(t))}
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
                used = json.loads(key).encode("utf-8", "surrogatepass")
                if used.startswith(content):
                    found.append(np.array(t.before_quote.get(used[len(content):], []), dtype=np.int64))
        ids = np.concatenate(found)
        return ids[legal[ids]]
