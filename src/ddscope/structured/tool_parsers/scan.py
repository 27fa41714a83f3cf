"""Reading calls out of text that may still be growing: blocks between markers, and JSON values and objects as far
as they go. Every reader returns what is known so far, so that streaming and whole reads are one code path."""
from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Draft:
    """A call as far as the text goes. `arguments` only ever grows (streaming sends what it adds); `done`: the call
    is closed, its arguments whole."""
    name: str | None
    arguments: str
    done: bool


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def blocks(text: str, begin: str, end: str) -> list[tuple[str, bool]]:
    """The texts between each `begin` and its `end`, and whether that end has come (the last may be open; a
    partial end marker is cut from it, so that it never reaches the arguments)."""
    out: list[tuple[str, bool]] = []
    i = text.find(begin)
    while i >= 0:
        start = i + len(begin)
        j = text.find(end, start)
        if j < 0:
            body = text[start:]
            out.append((body[:len(body) - held_back(body, end)], False))
            break
        out.append((text[start:j], True))
        i = text.find(begin, j + len(end))
    return out


def json_value(text: str, i: int) -> tuple[str, int | None]:
    """The JSON value at `i`: its text and end when it is whole, else the text so far and None. A value cut short
    and a malformed one read alike; a whole read tells them apart, as the call never closes."""
    try:
        _, end = _DECODER.raw_decode(text, i)
    except ValueError:
        return text[i:], None
    return text[i:end], end


def object_fields(text: str, i: int) -> tuple[dict[str, tuple[str, bool]], int | None]:
    """The fields of the JSON object at `i` as far as the text goes (key -> value text, whole), and the object's
    end, None while it is open."""
    fields: dict[str, tuple[str, bool]] = {}
    if text[i:i + 1] != "{":
        return fields, None
    i += 1
    while True:
        i = skip_space(text, i)
        if text[i:i + 1] == "}":
            return fields, i + 1
        if fields and text[i:i + 1] == ",":
            i = skip_space(text, i + 1)
        key, end = json_value(text, i)
        if end is None or not key.startswith('"'):
            return fields, None
        i = skip_space(text, end)
        if text[i:i + 1] != ":":
            return fields, None
        i = skip_space(text, i + 1)
        value, end = json_value(text, i)
        fields[json.loads(key)] = (value, end is not None)
        if end is None:
            return fields, None
        i = end


def json_call(text: str, i: int, argument_keys: tuple[str, ...] = ("arguments",)) -> tuple[Draft, int | None]:
    """A call written as one JSON object {"name": ..., <argument key>: {...}}, and the object's end. Arguments
    given as a JSON string are its text; none given are {} (as vLLM's hermes reads them)."""
    fields, end = object_fields(text, i)
    name_text, name_whole = fields.get("name", ("", False))
    name = json.loads(name_text) if name_whole and name_text.startswith('"') else None
    key = next((k for k in argument_keys if k in fields), None)
    arguments, whole = fields[key] if key else ("", False)
    if arguments.startswith('"'):  # arguments as a string: only whole (its text is not a prefix of its value)
        arguments = json.loads(arguments) if whole else ""
    if end is not None and key is None:
        arguments = "{}"
    return Draft(name, arguments, end is not None and name is not None), end


def json_calls(text: str, i: int, separator: str, argument_keys: tuple[str, ...] = ("arguments",)) -> list[Draft]:
    """JSON calls one after another from `i`, `separator` between them (whitespace around it is free)."""
    drafts: list[Draft] = []
    while True:
        i = skip_space(text, i)
        if i >= len(text):
            return drafts
        draft, end = json_call(text, i, argument_keys)
        drafts.append(draft)
        if end is None:
            return drafts
        i = skip_space(text, end)
        if not text.startswith(separator.strip() or separator, i):
            return drafts
        i += len(separator.strip() or separator)


def json_list_calls(text: str, i: int, argument_keys: tuple[str, ...] = ("arguments",)) -> list[Draft]:
    """A JSON list of call objects from `i` (a lone object reads as a list of one, as vLLM's mistral reads it)."""
    i = skip_space(text, i)
    if text[i:i + 1] == "[":
        return json_calls(text, i + 1, ",", argument_keys)
    return json_calls(text, i, ",", argument_keys)[:1]


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
