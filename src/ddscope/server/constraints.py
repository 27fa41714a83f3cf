"""A request's structured-output fields as one engine Constraint, read as vLLM reads them.

Three spellings reach the same constraint: OpenAI's `response_format` (json_object, json_schema, structural_tag),
vLLM's `structured_outputs` (json, regex, choice, grammar, json_object, structural_tag) and the older `guided_*`
names. vLLM 0.33 merges `response_format` into `structured_outputs` (generate/base/protocol.py:181-211), so two
sources naming different constraints are a 400; it ignores `guided_*` with a warning (serve/engine/protocol.py:
21-76), ddscope honours them. The whitespace options apply per request here, and `--structured-outputs-config`
sets their defaults (vLLM reads `disable_any_whitespace` from its server config only: backend_xgrammar.py:40-42).
JSON's free whitespace is bounded by default (limits.MAX_WHITESPACE), so that no model can fill it until max_tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ddscope.engine.limits import MAX_WHITESPACE
from ddscope.server.schemas import APIError, ResponseFormat, SamplingRequest, StructuredOutputs
from ddscope.structured.backend import CHOICES
from ddscope.structured.constraint import Constraint, ConstraintError, first_line
from ddscope.structured.schema import closed
from ddscope.structured.tool_parsers import ToolParser, Whitespace



@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's --structured-outputs-config (config/structured_outputs.py): the defaults of every request."""
    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    max_whitespace: int | None = MAX_WHITESPACE  # ddscope's `max_whitespace_cnt`; None: unbounded (vLLM's)

    @classmethod
    def parse(cls, text: str) -> StructuredOutputsConfig:
        """From the flag's JSON; ValueError naming what is wrong."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--structured-outputs-config is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--structured-outputs-config must be a JSON object")
        known = {"backend", "disable_any_whitespace", "disable_additional_properties", "reasoning_parser",
                 "enable_in_reasoning", "max_whitespace_cnt"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--structured-outputs-config: unknown field(s) {', '.join(unknown)}")
        if data.get("backend", "auto") not in CHOICES:
            raise ValueError(f"--structured-outputs-config: backend {data['backend']!r} is not available; one of "
                             f"{', '.join(CHOICES)}")
        if data.get("reasoning_parser"):
            raise ValueError("--structured-outputs-config: reasoning_parser is not supported")
        bound = data.get("max_whitespace_cnt", MAX_WHITESPACE)
        if bound is not None and (type(bound) is not int or bound < 1):
            raise ValueError("--structured-outputs-config: max_whitespace_cnt must be a positive integer or null "
                             f"(unbounded), not {bound!r}")
        return cls(data.get("backend", "auto"), bool(data.get("disable_any_whitespace", False)),
                   bool(data.get("disable_additional_properties", False)), bound)


def constraint_of(req: SamplingRequest, config: StructuredOutputsConfig) -> tuple[str, Constraint] | None:
    """The field naming the request's constraint, and the constraint; None; APIError 400 on a malformed or
    conflicting one."""
    found = _sources(req)
    kinds = {(kind, json.dumps(spec, sort_keys=True)) for _, kind, spec in found}
    if len(kinds) > 1:
        named = ", ".join(f"{field} ({kind})" for field, kind, _ in found)
        raise APIError(400, f"one structured-outputs constraint at a time; this request names {named}",
                       param=found[1][0], code="invalid_parameter")
    if not found:
        return None
    field, kind, spec = found[0]
    opts = req.structured_outputs or StructuredOutputs()
    whitespace = opts.whitespace_pattern if opts.whitespace_pattern is not None else req.guided_whitespace_pattern
    compact = opts.disable_any_whitespace or config.disable_any_whitespace
    close = opts.disable_additional_properties or config.disable_additional_properties
    return field, _constraint(kind, _spec_text(field, kind, spec, close), config, compact, whitespace)


def tool_constraint(parser: ToolParser, config: StructuredOutputsConfig) -> Constraint:
    """A forced tool choice's constraint: the calls in the parser's format, their JSON arguments under the server's
    whitespace defaults; ConstraintError where a tool's parameters do not compile."""
    try:
        tag = parser.grammar(Whitespace(config.disable_any_whitespace, config.max_whitespace))
    except (RuntimeError, ValueError) as e:  # xgrammar's schema converter
        raise ConstraintError(f"a tool's parameters do not compile: {first_line(e)}") from None
    return Constraint("structural_tag", json.dumps(tag))


def _constraint(kind: str, spec: str, config: StructuredOutputsConfig, compact: bool,
                whitespace: str | None = None) -> Constraint:
    """The constraint with JSON's whitespace options; the default bound only where whitespace is free (compact JSON
    has none, and a whitespace_pattern says its own)."""
    if kind not in ("json", "json_object"):
        return Constraint(kind, spec)
    bound = config.max_whitespace if not compact and whitespace is None else None
    return Constraint(kind, spec, not compact, whitespace, bound)


def _sources(req: SamplingRequest) -> list[tuple[str, str, Any]]:
    """(field, kind, spec) of every constraint the request names."""
    out: list[tuple[str, str, Any]] = []
    so = req.structured_outputs
    if so is not None:
        kinds = [(k, getattr(so, k)) for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(so, k) is not None]
        if len(kinds) != 1:
            raise APIError(400, "structured_outputs must name exactly one of json, regex, choice, grammar, "
                                f"json_object, structural_tag; got {len(kinds)}", param="structured_outputs",
                           code="invalid_parameter")
        out.append(("structured_outputs",) + kinds[0])
    rf = req.response_format
    if rf is not None and rf.type != "text":
        out.append(("response_format",) + _response_format(rf))
    for legacy, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                         ("guided_grammar", "grammar")):
        if getattr(req, legacy) is not None:
            out.append((legacy, kind, getattr(req, legacy)))
    return out


def _response_format(rf: ResponseFormat) -> tuple[str, Any]:
    if rf.type == "json_object":
        return "json_object", True
    if rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format: type 'json_schema' needs the 'json_schema' field",
                           param="response_format", code="invalid_parameter")
        schema = rf.json_schema.schema_
        return "json", schema if schema is not None else {}
    return "structural_tag", rf.model_dump(exclude_none=True, by_alias=True, exclude={"json_schema"})


def _spec_text(field: str, kind: str, spec: Any, close: bool) -> str:
    """The constraint's text, checked for what is plainly malformed before it reaches the compiler."""
    def bad(why: str) -> APIError:
        return APIError(400, f"{field}: {why}", param=field, code="invalid_parameter")

    if kind == "json_object":
        if spec is not True:
            raise bad("json_object must be true if set; omit it to leave the output unconstrained")
        return ""
    if kind == "choice":
        if not spec:
            raise bad("choice must name at least one string")
        return json.dumps(spec)
    if kind in ("regex", "grammar"):
        if kind == "grammar" and not spec.strip():
            raise bad("grammar cannot be empty")
        if "\x00" in spec:
            raise bad(f"the {kind} holds a NUL character")
        return spec
    if isinstance(spec, str):  # json or structural_tag as text
        if not spec.strip():
            raise bad(f"{kind} cannot be empty")
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise bad(f"{kind} is not valid JSON: {e}") from None
    if kind == "json" and not isinstance(spec, (dict, bool)):
        raise bad("a JSON schema is an object (or true/false)")
    if kind == "json" and close:
        spec = closed(spec)
    return json.dumps(spec)
