"""What every tool-call format shares: whole extraction, streaming, and the forced-call grammar, built on the two
things a format says for itself (`read`: the calls in its text; `call_format`: one call as a structural tag)."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ddscope.structured.constraint import ConstraintError
from ddscope.structured.tool_choice import Tool, ToolCall, ToolChoice, call_id
from ddscope.structured.tool_parsers.scan import Draft, held_back, is_json_object

Format = dict[str, Any]  # one xgrammar structural-tag format (structural_tag.py in xgrammar 0.2.9)


@dataclass(frozen=True)
class Whitespace:
    """JSON's free whitespace inside forced arguments: none (`compact`), or at most `bound` characters a stretch
    (None: unbounded), as the server's --structured-outputs-config says."""
    compact: bool = False
    bound: int | None = None


def const(value: str) -> Format:
    return {"type": "const_string", "value": value}


def sequence(*elements: Format) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": list(elements)}


def json_arguments(schema: dict[str, Any], ws: Whitespace) -> Format:
    """The arguments as JSON of `schema`, compiled as xgrammar compiles a JSON constraint (xgrammar_backend.py),
    so that whitespace means the same in a forced call as in response_format; ConstraintError naming a keyword
    xgrammar would not enforce."""
    import xgrammar as xgr  # only where a forced call is rendered

    from ddscope.structured.xgrammar_backend import schema_gaps, without_false_properties

    if gaps := schema_gaps(schema):
        raise ConstraintError(f"{gaps[0]} by xgrammar")
    ebnf = xgr.Grammar.from_json_schema(json.dumps(without_false_properties(schema)), any_whitespace=not ws.compact,
                                        separators=(",", ":") if ws.compact else None,
                                        max_whitespace_cnt=None if ws.compact else ws.bound)
    return {"type": "grammar", "grammar": str(ebnf)}


class ToolParser(ABC):
    """One format, for one request's tools and choice. `start` opens the calls in `auto` output (the text before it
    is the message's content); `prefix`, `separator` and `suffix` frame forced calls (FramedParser)."""
    name: ClassVar[str]
    start: ClassVar[str]
    prefix: ClassVar[str] = ""
    separator: ClassVar[str] = ""
    suffix: ClassVar[str] = ""

    def __init__(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool = True):
        self.tools = {t.name: t for t in tools}
        self.choice, self.parallel = choice, parallel

    @abstractmethod
    def read(self, text: str) -> list[Draft]:
        """The calls in `text`, which begins where the calls begin, as far as it goes."""

    def calls_start(self, text: str) -> int | None:
        """Where the calls begin in the output; None while none has."""
        i = text.find(self.start)
        return i if i >= 0 else None

    def content_end(self, text: str) -> int:
        """How far a stream may send content before any call: short of a tail that may open one."""
        return len(text) - held_back(text, self.start)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output. An output whose calls do not all parse (cut by max_tokens, or
        malformed) gives no calls and the text as content, as vLLM's parsers do."""
        start = self.calls_start(text)
        if start is None:
            return text, []
        drafts = self.read(text[start:])
        if not drafts or not all(d.done and d.name and is_json_object(d.arguments) for d in drafts):
            return text, []
        calls = [ToolCall(d.name, d.arguments) for d in drafts if d.name][:None if self.parallel else 1]
        head = text[:start]
        return (head if head.strip() else None), calls

    @abstractmethod
    def grammar(self, ws: Whitespace) -> dict[str, Any]:
        """A forced choice (`required`, or a named tool) as a structural tag in this format."""


class FramedParser(ToolParser):
    """A format whose forced calls are calls of one shape each, framed by `prefix`, `separator` and `suffix`."""

    @abstractmethod
    def call_format(self, tool: Tool, ws: Whitespace) -> list[Format]:
        """One call of `tool` in this format, as the elements of a structural-tag sequence."""

    def grammar(self, ws: Whitespace) -> dict[str, Any]:
        """A forced choice as a structural tag in this format: one call of the named tool, or (required) at least
        one call of any tool, one only without parallel_tool_calls."""
        names = [self.choice.name] if self.choice.mode == "named" else list(self.tools)
        calls = [sequence(*self.call_format(self.tools[n], ws)) for n in names]  # type: ignore[index]
        one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        body = [one]
        if self.choice.mode == "required" and self.parallel:
            again = sequence(const(self.separator), one) if self.separator else one
            body.append({"type": "star", "content": again})
        framed = ([const(self.prefix)] if self.prefix else []) + body + ([const(self.suffix)] if self.suffix else [])
        return {"type": "structural_tag", "format": sequence(*framed)}

    def stream(self) -> CallStream:
        return CallStream(self)


class CallStream:
    """One streamed choice's deltas: content until a call opens, then each call's name once (with its id) as soon
    as it is whole, and its arguments as they grow; what is left at the end, from the whole read."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.ids: list[str] = []  # per call begun
        self.args: list[str] = []  # per call: the arguments sent

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        start = self.parser.calls_start(self.text)
        out = self._content(start if start is not None else self.parser.content_end(self.text))
        if start is not None:
            out += self._calls(self.parser.read(self.text[start:]))
        return out

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas, and whether the choice made calls."""
        _, calls = self.parser.extract(self.text)
        if not calls:
            return self._content(len(self.text)), False
        return self._calls([Draft(c.name, c.arguments, True) for c in calls]), True

    def _content(self, end: int) -> list[dict[str, Any]]:
        if end <= self.sent:
            return []
        delta = {"content": self.text[self.sent:end]}
        self.sent = end
        return [delta]

    def _calls(self, drafts: list[Draft]) -> list[dict[str, Any]]:
        out = []
        for i, draft in enumerate(drafts[:None if self.parser.parallel else 1]):
            if draft.name is None:  # calls are sent in order: this one's name first
                break
            if i == len(self.ids):
                self.ids.append(call_id())
                self.args.append("")
                out.append(_call_delta(i, id=self.ids[i], type="function",
                                       function={"name": draft.name, "arguments": ""}))
            if draft.arguments.startswith(self.args[i]) and len(draft.arguments) > len(self.args[i]):
                new = draft.arguments[len(self.args[i]):]
                self.args[i] = draft.arguments
                out.append(_call_delta(i, function={"arguments": new}))
        return out


def _call_delta(index: int, **fields: Any) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, **fields}]}
