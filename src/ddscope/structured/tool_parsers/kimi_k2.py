"""Kimi K2: `<|tool_calls_section_begin|>`, then per call `<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{...}<|tool_call_end|>`, then `<|tool_calls_section_end|>`; the header is the call's
own id, the name what is before `:IDX` without `functions.`. vLLM 0.33: parser/kimi_k2.py:3-13 (the format),
:43-49 (the markers and the id pattern), :177-189 (the name from the header)."""
from __future__ import annotations

import re

from ddscope.structured.tool_choice import Tool
from ddscope.structured.tool_parsers.base import Format, FramedParser, Whitespace, const, json_arguments
from ddscope.structured.tool_parsers.scan import Draft, blocks, json_value, skip_space

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END, ARGUMENTS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
INDEX = "0|[1-9][0-9]{0,2}"  # the call's place in the turn; bounded, so that no model writes digits forever
HEADER = re.compile(r"\s*(?:functions\.)?(?P<name>.+):\d+\s*$", re.DOTALL)


class KimiK2(FramedParser):
    name = "kimi_k2"
    start = SECTION_BEGIN
    prefix, suffix = SECTION_BEGIN, SECTION_END

    def read(self, text: str) -> list[Draft]:
        return [_call(body, closed) for body, closed in blocks(text, CALL_BEGIN, CALL_END)]

    def call_format(self, tool: Tool, ws: Whitespace) -> list[Format]:
        return [const(f"{CALL_BEGIN}functions.{tool.name}:"), {"type": "regex", "pattern": INDEX},
                const(ARGUMENTS), json_arguments(tool.parameters, ws), const(CALL_END)]


def _call(body: str, closed: bool) -> Draft:
    header, sep, rest = body.partition(ARGUMENTS)
    match = HEADER.match(header) if sep else None
    if match is None:
        return Draft(None, "", False)
    arguments, end = json_value(rest, skip_space(rest, 0))
    return Draft(match["name"], arguments, closed and end is not None)
