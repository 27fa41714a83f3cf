"""DeepSeek V3.1: `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>` (fullwidth bars, U+2581 for spaces). vLLM 0.33:
tool_parsers/deepseekv31_tool_parser.py:40-49 (the markers and the call regex), :79-121 (whole extraction)."""
from __future__ import annotations

from ddscope.structured.tool_choice import Tool
from ddscope.structured.tool_parsers.base import Format, FramedParser, Whitespace, const, json_arguments
from ddscope.structured.tool_parsers.scan import Draft, blocks, json_value, skip_space

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class DeepSeekV31(FramedParser):
    name = "deepseek_v31"
    start = CALLS_BEGIN
    prefix, suffix = CALLS_BEGIN, CALLS_END

    def read(self, text: str) -> list[Draft]:
        return [_call(body, closed) for body, closed in blocks(text, CALL_BEGIN, CALL_END)]

    def call_format(self, tool: Tool, ws: Whitespace) -> list[Format]:
        return [const(f"{CALL_BEGIN}{tool.name}{SEP}"), json_arguments(tool.parameters, ws), const(CALL_END)]


def _call(body: str, closed: bool) -> Draft:
    name, sep, rest = body.partition(SEP)
    if not sep or not name.strip():
        return Draft(None, "", False)
    arguments, end = json_value(rest, skip_space(rest, 0))
    return Draft(name.strip(), arguments, closed and end is not None)
