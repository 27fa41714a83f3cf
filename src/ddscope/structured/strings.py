"""Sets of strings (and of `null`, `true`, `false`) complemented as regexes both backends read: anchored, with no
lookaround. Python's `re` (jsonschema's) reads `$` before a final newline too, so each is written to read alike
there, or refused."""
from __future__ import annotations

import re
from typing import Any

from ddscope.structured.drafts import NARROWED

TYPES = ("array", "boolean", "null", "number", "object", "string")


CLASS_PATTERN = re.compile(r"(\^?)\[((?:[^\]\\^]|\\.)(?:[^\]\\]|\\.)*)\]([*+]?)(\$?)")


def not_pattern(pattern: Any) -> Any:
    """The strings a pattern of one character class refuses, narrowed (marked so: `NARROWED`): their telling
    character printable ASCII, which Python's re and the backends' regexes read alike (Python's `\\s` also takes
    \\x1c-\\x1f, and its `$` a final newline). Shapes: `[C]` anywhere, `^[C]`, `[C]$`, `^[C]*$`, `^[C]+$`."""
    shape = CLASS_PATTERN.fullmatch(pattern) if isinstance(pattern, str) else None
    if shape is None:
        return None
    start, body, repeat, end = shape.groups()
    try:
        within = re.compile(f"[{body}]")
    except re.error:
        return None
    if within.fullmatch("\n") and not start:
        return None  # Python's `$` takes a final newline, which the class would then tell
    other = "".join(_escaped(chr(c)) for c in range(0x21, 0x7F) if not within.fullmatch(chr(c)))
    if not other:
        return None
    other, any_ = f"[{other}]", ANY_CHAR + "*"
    found = {("", "", ""): f"^{other}*$", ("^", "", ""): f"^{other}{any_}$", ("", "", "$"): f"^(?:{any_}{other})?$",
             ("^", "*", "$"): f"^{any_}{other}{any_}$", ("^", "+", "$"): f"^{any_}{other}{any_}$"}.get(
                 (start, repeat, end))  # "" left out where Python's `$` would read "\n" as it
    return None if found is None else {"type": "string", "pattern": found, "$comment": NARROWED}


def not_values(values: list[Any]) -> Any:
    """Anything but `values` (strings, true, false, null): another type, another literal, or a string none of them
    is (`not_strings`)."""
    literals = [v for v in (True, False, None) if not any(v is x for x in values)]
    words = [v for v in values if isinstance(v, str)]
    kinds = ("boolean", "null") + (("string",) if words else ())
    branches: list[Any] = [{"type": [t for t in TYPES if t not in kinds]}]
    branches += [{"enum": literals}] if literals else []
    branches += [{"type": "string", "pattern": not_strings(words)}] if words else []
    return {"anyOf": branches}


def not_strings(words: list[str]) -> str:
    """A regex (anchored, no lookaround: both backends read it) matching every string but `words`: by their trie,
    a string that stops short of a word, leaves the trie at some character, or goes on past a word's end."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def rest(node: dict[str, Any]) -> str:
        kids = sorted(k for k in node if k)
        other = "[^" + "".join(_escaped(k) for k in kids) + "]" if kids else ANY_CHAR
        parts = ([] if "" in node else [""]) + [other + ANY_CHAR + "*"] + [_escaped(k) + rest(node[k]) for k in kids]
        return "(?:" + "|".join(parts) + ")"
    return "^" + rest(trie) + "$"


ANY_CHAR = "[\\s\\S]"


def _escaped(ch: str) -> str:
    return "\\" + ch if ch in "\\^-]$.|?*+()[]{}/" else ch
