"""Mistral (tokenizers before v11, and vLLM's guided form): `[TOOL_CALLS]` and a JSON list of
{"name": ..., "arguments": {...}}; the text before the marker is content. vLLM 0.33: parser/mistral.py:71 (the
marker), :562-640 (`_legacy_extract_tool_calls`: content, the marker, the list; a lone object is one call).
v11+'s `[TOOL_CALLS]name[ARGS]{...}` is not read here."""
from __future__ import annotations

import json

from ddscope.structured.tool_choice import Tool
from ddscope.structured.tool_parsers.base import Format, FramedParser, Whitespace, const, json_arguments
from ddscope.structured.tool_parsers.scan import Draft, json_list_calls

MARKER = "[TOOL_CALLS]"


class Mistral(FramedParser):
    name = "mistral"
    start = MARKER
    prefix, separator, suffix = MARKER + "[", ", ", "]"

    def read(self, text: str) -> list[Draft]:
        return json_list_calls(text, len(MARKER))

    def call_format(self, tool: Tool, ws: Whitespace) -> list[Format]:
        return [const(f'{{"name": {json.dumps(tool.name)}, "arguments": '), json_arguments(tool.parameters, ws),
                const("}")]
