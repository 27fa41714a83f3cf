"""The tool-call formats `--tool-call-parser` names, as vLLM names them (vllm/tool_parsers/__init__.py): name ->
module and class, imported when first asked for. A new format is one module and one line here."""
from __future__ import annotations

import importlib
from collections.abc import Sequence

from ddscope.structured.tool_choice import Tool, ToolChoice
from ddscope.structured.tool_parsers.base import ToolParser, Whitespace

__all__ = ["PARSERS", "ToolParser", "Whitespace", "parser_class", "parser_for"]

PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("hermes", "Hermes"),
    "llama3_json": ("llama3_json", "Llama3Json"),
    "mistral": ("mistral", "Mistral"),
    "qwen3_coder": ("qwen3_coder", "Qwen3Coder"),
    "kimi_k2": ("kimi_k2", "KimiK2"),
    "deepseek_v31": ("deepseek_v31", "DeepSeekV31"),
}
FORCED_JSON = ("forced_json", "ForcedJson")  # no parser named: vLLM's JSON for forced calls


def parser_class(name: str | None) -> type[ToolParser]:
    """The format's class; KeyError naming the formats there are."""
    if name is not None and name not in PARSERS:
        raise KeyError(f"unknown tool-call parser {name!r}; one of {', '.join(PARSERS)}")
    module, cls = PARSERS[name] if name is not None else FORCED_JSON
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def parser_for(name: str | None, tools: Sequence[Tool], choice: ToolChoice, parallel: bool = True) -> ToolParser:
    """A request's parser: the named format, or (None) vLLM's forced JSON."""
    return parser_class(name)(tools, choice, parallel)
