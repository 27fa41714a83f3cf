"""Tool calls in OpenAI's shape: what `tool_choice` constrains, and the calls read back from the output.

`required` and a named tool are structured outputs, with the schemas vLLM 0.33 builds (tool_parsers/utils.py:
382-485): an array of at least one {name, parameters} (at most one without parallel_tool_calls), or the named
tool's parameters. `auto` is free text that a parser reads, chosen as vLLM's `--enable-auto-tool-choice
--tool-call-parser hermes` chooses it (tool_parsers/hermes_tool_parser.py): `<tool_call>{"name": ..., "arguments":
...}</tool_call>` blocks, the text before the first one the message's content. Ids are vLLM's, `chatcmpl-tool-` and
16 hex digits (renderers/chat_utils/tool_call.py:27-32).
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ddscope.server.schemas import APIError, ChatCompletionRequest

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
OPEN_TAG = "<tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(8)}"


def choice_of(req: ChatCompletionRequest, parser: str | None) -> str | None:
    """What the request's tools ask of the output: None (no tools, or `none`), "auto", "required" or the named
    tool's name; a 400 where the server or the request cannot serve it."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_parameter")
        return None
    choice = req.tool_choice if req.tool_choice is not None else "auto"  # vLLM's default once tools are given
    if choice == "none":
        return None
    if choice == "auto":
        if parser is None:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                "set", param="tool_choice", code="invalid_parameter")
        return "auto"
    if choice == "required":
        return "required"
    name = choice.function.name
    if name not in {t.function.name for t in req.tools}:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the request's tools",
                       param="tool_choice", code="invalid_parameter")
    return name


def tool_schema(req: ChatCompletionRequest, choice: str) -> dict[str, Any] | None:
    """The JSON schema a forced choice constrains the output to; None for `auto`."""
    if choice == "auto":
        return None
    if choice != "required":
        tool = next(t.function for t in req.tools if t.function.name == choice)
        return tool.parameters or {"type": "object", "properties": {}}
    defs: dict[str, Any] = {}
    items = []
    for t in req.tools:
        params = dict(t.function.parameters or {"type": "object", "properties": {}})
        defs.update(params.pop("$defs", {}))
        items.append({"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def read_calls(choice: str, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from a finished output: a forced choice's JSON, or hermes blocks for `auto`. An output
    that does not parse (cut by max_tokens) gives no calls and the text as content, as vLLM's parsers do."""
    calls: list[ToolCall] = []
    content: str | None = text
    if choice == "auto":
        if OPEN_TAG in text:
            blocks = [_hermes(b) for b in HERMES.findall(text[text.index(OPEN_TAG):])]
            if blocks and all(b is not None for b in blocks):
                calls = [ToolCall(name, args, call_id()) for name, args in blocks]
                content = text[:text.index(OPEN_TAG)] or None
    elif choice == "required":
        try:
            items = json.loads(text)
            calls = [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False), call_id()) for i in items]
            content = None
        except (ValueError, TypeError, KeyError):
            calls = []
    else:
        try:
            json.loads(text)
            calls, content = [ToolCall(choice, text, call_id())], None
        except ValueError:
            calls = []
    return content, calls if parallel else calls[:1]


def _hermes(block: str) -> tuple[str, str] | None:
    try:
        call = json.loads(block)
        args = call.get("arguments", {})
        return call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class ToolStream:
    """One streamed choice's deltas under tools: a named tool's name once, then its arguments as they come;
    `required` and the calls of `auto` whole at the end (`auto` streams its content until a call opens)."""

    def __init__(self, choice: str, parallel: bool = True):
        self.choice, self.parallel = choice, parallel
        self.text = ""
        self.sent = 0  # characters of `text` sent as content or arguments
        self.id = call_id()

    def feed(self, text: str) -> list[dict[str, Any]]:
        first = not self.text
        self.text += text
        if self.choice == "required":
            return []
        if self.choice != "auto":  # named: the arguments are the output
            head = {"id": self.id, "type": "function", "function": {"name": self.choice}} if first else {}
            return [{"tool_calls": [{"index": 0, **head, "function": {**head.get("function", {}), "arguments": text}}]}]
        safe = self._content_end()
        out = [{"content": self.text[self.sent:safe]}] if safe > self.sent else []
        self.sent = max(self.sent, safe)
        return out

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas, and whether the choice made tool calls."""
        if self.choice not in ("auto", "required"):
            return [], True
        content, calls = read_calls(self.choice, self.text, self.parallel)
        if not calls:
            rest = self.text[self.sent:]
            return ([{"content": rest}] if rest else []), False
        return [{"tool_calls": [{"index": i, **c.to_dict()}]} for i, c in enumerate(calls)], True

    def _content_end(self) -> int:
        """How far content may go: up to an opened call, or short of a tail that may be the start of one."""
        if OPEN_TAG in self.text:
            return self.text.index(OPEN_TAG)
        for k in range(min(len(OPEN_TAG) - 1, len(self.text)), 0, -1):
            if OPEN_TAG.startswith(self.text[-k:]):
                return len(self.text) - k
        return len(self.text)
