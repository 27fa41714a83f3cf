"""Hermes (Qwen2.5/Qwen3, NousResearch): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks, one
a call, the text before the first the content. vLLM 0.33: tool_parsers/hermes_tool_parser.py:36-40 (the tags and
the block regex), :70-119 (whole extraction)."""
from __future__ import annotations

import json

from ddscope.structured.tool_choice import Tool
from ddscope.structured.tool_parsers.base import Format, FramedParser, Whitespace, const, json_arguments
from ddscope.structured.tool_parsers.scan import Draft, blocks, json_call, skip_space

BEGIN, END = "<tool_call>", "</tool_call>"


class Hermes(FramedParser):
    name = "hermes"
    start = BEGIN
    separator = "\n"

    def read(self, text: str) -> list[Draft]:
        drafts = []
        for body, closed in blocks(text, BEGIN, END):
            draft, _ = json_call(body, skip_space(body, 0))
            drafts.append(Draft(draft.name, draft.arguments, draft.done and closed))
        return drafts

    def call_format(self, tool: Tool, ws: Whitespace) -> list[Format]:
        return [const(f'{BEGIN}\n{{"name": {json.dumps(tool.name)}, "arguments": '),
                json_arguments(tool.parameters, ws), const(f"}}\n{END}")]
