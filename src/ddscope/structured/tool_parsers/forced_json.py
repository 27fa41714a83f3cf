"""No --tool-call-parser: forced calls in vLLM's own JSON (tool_parsers/utils.py:382-485 in vLLM 0.33), a list of
at least one {"name": ..., "parameters": {...}} for `required`, the bare arguments for a named tool. The output is
only calls; `auto` needs a parser, and is refused without one."""
from __future__ import annotations

from typing import Any

from ddscope.structured.tool_parsers.base import ToolParser, Whitespace, json_arguments
from ddscope.structured.tool_parsers.scan import Draft, json_list_calls, json_value, skip_space


class ForcedJson(ToolParser):
    name = "forced_json"
    start = ""

    def calls_start(self, text: str) -> int | None:
        return 0

    def read(self, text: str) -> list[Draft]:
        if self.choice.mode == "named":
            arguments, end = json_value(text, skip_space(text, 0))
            return [Draft(self.choice.name, arguments, end is not None)]
        return json_list_calls(text, 0, ("parameters",))

    def grammar(self, ws: Whitespace) -> dict[str, Any]:
        return {"type": "structural_tag", "format": json_arguments(self.schema(), ws)}

    def schema(self) -> dict[str, Any]:
        """vLLM's schema: the named tool's parameters, or an array of at least one {name, parameters} (at most one
        without parallel_tool_calls), the tools' $defs hoisted to the top."""
        if self.choice.mode == "named":
            return self.tools[self.choice.name].parameters  # type: ignore[index]
        defs: dict[str, Any] = {}
        items = []
        for tool in self.tools.values():
            params = dict(tool.parameters)
            defs.update(params.pop("$defs", {}))
            items.append({"properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": params},
                          "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema
