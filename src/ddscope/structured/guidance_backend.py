"""llguidance, vLLM's `guidance` backend (v1/structured_output/backend_guidance.py): it enforces what xgrammar
drops (a pattern with lengths, a partial allOf, disjoint oneOf) and refuses, with an error, every keyword it does
not implement, so its own errors are the gaps; they are located in the schema to name a path. Its options are
forced (`overrides`): a schema's own `x-guidance` cannot make it lenient. Objects stay open to other properties
unless the schema or `disable_additional_properties` closes them, as vLLM runs it."""
from __future__ import annotations

import json
import re
from typing import Any

from ddscope.structured.backend import Backend, Compiled, Matcher
from ddscope.structured.constraint import Constraint, ConstraintError, first_line
from ddscope.structured.schema import Gap, locate, subschemas

SPACE = "[\\x20\\x0A\\x0D\\x09]"  # JSON's whitespace


class GuidanceCompiled(Compiled):
    def __init__(self, constraint: Constraint, tokenizer: Any, grammar: str, stop_ids: list[int]):
        super().__init__(constraint, "guidance")
        self.tokenizer, self.grammar, self.stop_ids = tokenizer, grammar, frozenset(stop_ids)

    def matcher(self) -> Matcher:
        return GuidanceMatcher(self)


class GuidanceMatcher:
    """llguidance's matcher with xgrammar's termination: a stop token ends the grammar and counts as one token.
    llguidance records no token for a stop taken where the grammar cannot go on (vLLM's `rollback_lag`)."""

    def __init__(self, compiled: GuidanceCompiled):
        import llguidance as llg

        self.m = llg.LLMatcher(compiled.tokenizer, compiled.grammar, log_level=0)
        self.stops = compiled.stop_ids
        self.terminated = False
        self.unrecorded = False  # the stop that ended the grammar was not recorded by llguidance

    def accept(self, token: int) -> bool:
        if self.terminated:
            return False
        if token in self.stops:
            if not self.m.is_accepting():
                return False
            self.unrecorded = self.m.is_stopped()
            if not self.unrecorded:
                self.m.consume_token(token)
            self.terminated = True
            return True
        return self.m.try_consume_tokens([token]) == 1  # consume_token would leave an error state for good

    def rollback(self, tokens: int) -> None:
        if tokens and self.terminated:
            tokens -= self.unrecorded
            self.terminated = self.unrecorded = False
        if tokens:
            self.m.rollback(tokens)

    def is_terminated(self) -> bool:
        return self.terminated

    def fill(self, bitmask: Any) -> None:
        self.m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask[0].numel() * bitmask.element_size())

    def forces(self) -> bool:
        return not self.terminated and bool(self.m.compute_ff_bytes())


class GuidanceBackend(Backend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]):
        super().__init__(tokenizer, vocab_size, stop_ids)
        self._tokenizer: Any = None

    @property
    def lltokenizer(self) -> Any:
        if self._tokenizer is None:  # about a second: once per engine
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=list(self.stop_ids))
        return self._tokenizer

    def ready(self) -> None:
        self.lltokenizer  # noqa: B018  (built on first use)

    def gaps(self, c: Constraint) -> list[Gap]:
        # xgrammar's structural-tag format is xgrammar's own (tool calls compile there under every backend)
        return [Gap("structural_tag", "$", "is compiled by xgrammar only")] if c.kind == "structural_tag" else []

    def compile(self, c: Constraint) -> Compiled:
        import llguidance as llg

        grammar = self._grammar(c)
        try:
            error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.lltokenizer)
        except Exception as e:  # llguidance raises ValueError, or its own errors, on a grammar it cannot read
            raise ConstraintError(f"the {c.kind} constraint does not compile: {first_line(e)}") from None
        if error:
            raise ConstraintError(self._explain(c, messages[0] if messages else "llguidance refused it"))
        return GuidanceCompiled(c, self.lltokenizer, grammar, self.stop_ids)

    def _grammar(self, c: Constraint) -> str:
        import llguidance as llg

        try:
            if c.kind in ("json", "json_object"):
                schema = c.spec if c.kind == "json" else '{"type": "object"}'
                return llg.LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(c))
            if c.kind == "choice":
                if not json.loads(c.spec):  # Lark reads no alternatives as the empty string
                    raise ValueError("a choice needs at least one string")
                return llg.grammar_from("choice", c.spec)
            return llg.grammar_from("regex" if c.kind == "regex" else "grammar", c.spec)
        except ValueError as e:
            raise ConstraintError(f"the {c.kind} constraint does not compile: {first_line(e)}") from None

    def _explain(self, c: Constraint, message: str) -> str:
        """llguidance's error, with the keyword and path it is about where it names one."""
        text = first_line(ValueError(message))
        keyword, schema = _keyword(message), json.loads(c.spec) if c.kind == "json" else None
        named = re.search(r"Unknown format: (\S+)", message)
        path = next((p for n, p in subschemas(schema) if n.get("format") == named.group(1)), None) if named else \
            locate(schema, keyword) if keyword and schema is not None else None
        where = f"{keyword} at {path}: " if path else ""
        return f"the {c.kind} constraint does not compile under guidance: {where}{text}"


def _json_options(c: Constraint) -> dict[str, Any]:
    """xgrammar's whitespace and separators, in llguidance's options; nothing lenient."""
    options: dict[str, Any] = {"lenient": False, "coerce_one_of": False, "item_separator": ",",
                               "key_separator": ":"}
    if c.whitespace is not None:
        return {**options, "whitespace_pattern": c.whitespace}
    if not c.any_whitespace:
        return {**options, "whitespace_flexible": False}
    bound = f"{{0,{c.max_whitespace}}}" if c.max_whitespace is not None else "*"
    return {**options, "whitespace_pattern": SPACE + bound}


def _keyword(message: str) -> str | None:
    """The schema keyword an llguidance error is about."""
    if found := re.search(r'Unimplemented keys: \["([^"]+)"', message):
        return found.group(1)
    for keyword, sign in (("oneOf", "oneOf"), ("format", "Unknown format"), ("$ref", "Resource"),
                          ("$ref", "Pointer"), ("pattern", "regex")):
        if sign in message:
            return keyword
    return None
