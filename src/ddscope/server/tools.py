"""Tool calls' HTTP mapping: a request's `tools` and `tool_choice` as the structured room's types, and the parser
that renders and reads its calls (ddscope.structured.tool_parsers).

`required` and a named tool are a grammar in the parser's own format (vLLM's JSON schemas without a parser:
tool_parsers/utils.py:382-485 in vLLM 0.33); `auto` is free text the parser reads, served only with
`--enable-auto-tool-choice --tool-call-parser NAME`, as vLLM serves it. Ids are vLLM's (`chatcmpl-tool-` and 16 hex
digits)."""
from __future__ import annotations

from ddscope.server.schemas import APIError, ChatCompletionRequest
from ddscope.structured.tool_choice import EMPTY_PARAMETERS, Tool, ToolChoice
from ddscope.structured.tool_parsers import ToolParser, parser_for


def choice_of(req: ChatCompletionRequest, parser: str | None) -> ToolChoice | None:
    """What the request's tools ask of the output (None: no tools); a 400 where the server or the request cannot
    serve it."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_parameter")
        return None
    given = req.tool_choice if req.tool_choice is not None else "auto"  # vLLM's default once tools are given
    if not isinstance(given, str):  # {"type": "function", "function": {"name": ...}}: any name, "auto" included
        if given.function.name not in {t.function.name for t in req.tools}:
            raise APIError(400, f"tool_choice names {given.function.name!r}, which is not among the request's "
                                "tools", param="tool_choice", code="invalid_parameter")
        return ToolChoice.named(given.function.name)
    if given == "auto" and parser is None:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                       param="tool_choice", code="invalid_parameter")
    return ToolChoice(given)


def parser_of(req: ChatCompletionRequest, choice: ToolChoice | None, parser: str | None) -> ToolParser | None:
    """The parser that renders and reads this request's calls; None where no calls are read (no tools, `none`)."""
    if choice is None or choice.mode == "none":
        return None
    tools = [Tool(t.function.name, t.function.parameters or dict(EMPTY_PARAMETERS)) for t in req.tools or ()]
    return parser_for(parser, tools, choice, parallel=req.parallel_tool_calls is not False)
