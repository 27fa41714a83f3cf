"""Llama 3.x JSON calls: a bare `{"name": ..., "parameters": {...}}` (vLLM also reads "arguments"), optionally after
`<|python_tag|>`, several separated by `; `. vLLM 0.33: tool_parsers/llama_tool_parser.py:47 (the tag), :84-112
(a call is any JSON object with a name, its arguments under "arguments" or "parameters"), :204 (the "; " between
calls). Calls begin at the tag, or at a `{` that opens the output; the text before the tag is content."""
from __future__ import annotations

import json

from ddscope.structured.tool_choice import Tool
from ddscope.structured.tool_parsers.base import Format, FramedParser, Whitespace, const, json_arguments
from ddscope.structured.tool_parsers.scan import Draft, json_calls

TAG = "<|python_tag|>"
KEYS = ("parameters", "arguments")


class Llama3Json(FramedParser):
    name = "llama3_json"
    start = TAG
    separator = "; "

    def calls_start(self, text: str) -> int | None:
        found = super().calls_start(text)
        if found is None and text.lstrip().startswith("{"):
            return 0
        return found

    def content_end(self, text: str) -> int:
        return 0 if not text.strip() else super().content_end(text)  # leading space may come before a `{`

    def read(self, text: str) -> list[Draft]:
        return json_calls(text, len(TAG) if text.startswith(TAG) else 0, self.separator, KEYS)

    def call_format(self, tool: Tool, ws: Whitespace) -> list[Format]:
        return [const(f'{{"name": {json.dumps(tool.name)}, "parameters": '), json_arguments(tool.parameters, ws),
                const("}")]
