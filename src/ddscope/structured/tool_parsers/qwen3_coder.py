"""Qwen3-Coder XML: `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`,
a value's wrapping newlines markup, a value typed by the tool's schema (a string as written, else its JSON).
vLLM 0.33: parser/qwen3.py:3-14 (the format), :44-58 (the tags and the parameter regex), :61-87 (one newline
trimmed each side; the arguments as a JSON object), parser/engine/parser_engine.py:293-330 (values coerced to the
schema's type). Arguments stream as a JSON object that grows a whole parameter at a time."""
from __future__ import annotations

import json
import re
from typing import Any

from ddscope.structured.tool_choice import Tool
from ddscope.structured.tool_parsers.base import Format, FramedParser, Whitespace, const
from ddscope.structured.tool_parsers.scan import Draft, blocks

BEGIN, END = "<tool_call>", "</tool_call>"
FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
FUNCTION_END = "</function>"
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3Coder(FramedParser):
    name = "qwen3_coder"
    start = BEGIN
    separator = "\n"

    def read(self, text: str) -> list[Draft]:
        return [self._call(body, closed) for body, closed in blocks(text, BEGIN, END)]

    def call_format(self, tool: Tool, ws: Whitespace) -> list[Format]:
        params: Format = {"type": "json_schema", "json_schema": tool.parameters, "style": "qwen_xml"}
        bound = 1 if ws.compact else ws.bound  # XML has no compact form: the template's newline, and no more
        if bound is not None:
            params["max_whitespace_cnt"] = bound
        return [const(f"{BEGIN}\n<function={tool.name}>\n"), params, const(f"{FUNCTION_END}\n{END}")]

    def _call(self, body: str, closed: bool) -> Draft:
        head = FUNCTION.match(body)
        if head is None:
            return Draft(None, "", False)
        name, rest = head[1].strip(), body[head.end():]
        done = FUNCTION_END in rest
        pairs = [f"{json.dumps(p.strip(), ensure_ascii=False)}: "
                 f"{json.dumps(self._value(name, p.strip(), v), ensure_ascii=False)}"
                 for p, v in PARAMETER.findall(rest.split(FUNCTION_END)[0])]
        arguments = "{" + ", ".join(pairs) + ("}" if done else "")
        return Draft(name, arguments, done and closed)

    def _value(self, function: str, parameter: str, raw: str) -> Any:
        """The value as its schema types it: a string as written, anything else its JSON (a string if not JSON)."""
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        tool = self.tools.get(function)
        schema = (tool.parameters.get("properties") or {}).get(parameter, {}) if tool else {}
        types = schema.get("type") if isinstance(schema, dict) else None
        types = [types] if isinstance(types, str) else (types or [])
        if not types or "string" in types:
            return value
        try:
            return json.loads(value)
        except ValueError:
            return value
