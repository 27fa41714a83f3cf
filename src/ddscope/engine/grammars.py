"""Structured-output constraints and their compiled grammars (xgrammar), cached by constraint.

A constraint is compiled as vLLM 0.33's xgrammar backend compiles it (v1/structured_output/backend_xgrammar.py:
144-189): JSON schemas with `any_whitespace` and, without it, the separators (",", ":"); `json_object` as the schema
{"type": "object"}; choices as an EBNF of quoted alternatives (utils.py:441-458); EBNF grammars, or Lark where the
text has no `::=` (utils.py:409-438); regexes; structural tags. A compile runs on a thread of its own and is
bounded in time: one past COMPILE_TIMEOUT_S is refused, and so is the same constraint again, while it runs on.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
COMPILE_TIMEOUT_S = 10.0  # vLLM bounds a regex's at 5 s (VLLM_REGEX_COMPILATION_TIMEOUT_S) and nothing else
MAX_RUNAWAY = 4  # compiles past their time still running: beyond this, new ones wait for them to end
CACHE_ENTRIES = 256


class ConstraintError(ValueError):
    """A constraint that does not compile (or not in time): the request's fault, a 400."""


@dataclass(frozen=True)
class Constraint:
    """What the output must match. `spec`: the JSON schema or structural tag as JSON text, the regex, the
    EBNF/Lark grammar, or the choices as a JSON list; `any_whitespace`: JSON's free whitespace allowed;
    `whitespace`: a regex for JSON's whitespace instead (outlines' and vLLM's whitespace_pattern);
    `max_whitespace`: at most this many characters in each stretch of free whitespace (xgrammar's
    max_whitespace_cnt; None: unbounded)."""
    kind: str
    spec: str = ""
    any_whitespace: bool = True
    whitespace: str | None = None
    max_whitespace: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")


class Grammars:
    """One engine's compiler: the tokenizer's vocabulary as xgrammar reads it, its stop tokens the engine's EOS;
    built at the first compile, so that an engine that is never asked for a constraint never loads xgrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], timeout_s: float = COMPILE_TIMEOUT_S):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._compiler: Any = None
        self.timeout_s = timeout_s
        self.cache: OrderedDict[Constraint, Any] = OrderedDict()
        self.running: dict[Constraint, threading.Thread] = {}  # compiles past their time, still going
        self.lock = threading.Lock()

    def compile(self, c: Constraint) -> Any:
        """The compiled grammar (cached); ConstraintError if it does not compile within the time limit."""
        with self.lock:
            if c in self.cache:
                self.cache.move_to_end(c)
                return self.cache[c]
            self.running = {k: t for k, t in self.running.items() if t.is_alive()}
            if c in self.running:
                raise ConstraintError(f"compiling this {c.kind} took over {self.timeout_s:g} s; it is refused")
            if len(self.running) >= MAX_RUNAWAY:
                raise ConstraintError("the server is still compiling constraints that ran past their time limit")
        self.compiler  # built here, under no time limit of its own compile
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["grammar"] = self._compile(c)
            except Exception as e:  # xgrammar raises RuntimeError, ValueError or its own InvalidJSONError
                result["error"] = e

        worker = threading.Thread(target=run, name="ddscope-grammar", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            with self.lock:
                self.running[c] = worker
            raise ConstraintError(f"compiling the {c.kind} constraint took over {self.timeout_s:g} s")
        if "error" in result:
            raise ConstraintError(f"the {c.kind} constraint does not compile: {first_line(result['error'])}")
        with self.lock:
            self.cache[c] = result["grammar"]
            while len(self.cache) > CACHE_ENTRIES:
                self.cache.popitem(last=False)
        return result["grammar"]

    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile(self, c: Constraint) -> Any:
        comp = self.compiler
        if c.kind in ("json", "json_object"):
            schema = c.spec if c.kind == "json" else '{"type": "object"}'
            if c.whitespace is not None:
                return comp.compile_grammar(json_with_whitespace(schema, c.whitespace))
            separators = None if c.any_whitespace else (",", ":")
            return comp.compile_json_schema(schema, any_whitespace=c.any_whitespace, separators=separators,
                                            max_whitespace_cnt=c.max_whitespace)
        if c.kind == "regex":
            return comp.compile_regex(c.spec)
        if c.kind == "choice":
            return comp.compile_grammar(choice_grammar(json.loads(c.spec)))
        if c.kind == "grammar":
            return comp.compile_grammar(c.spec) if "::=" in _uncommented(c.spec) else comp.compile_lark(c.spec)
        return compile_structural_tag(comp, c.spec)


def compile_structural_tag(comp: Any, spec: str) -> Any:
    """The current format as xgrammar reads it, or the legacy {"structures": [{begin, schema, end}], "triggers"}
    as vLLM converts it (backend_xgrammar.py:173-189)."""
    import xgrammar as xgr

    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return comp.compile_structural_tag(items, tag["triggers"])
    return comp.compile_structural_tag(spec)


FREE_SPACE = "[ \\n\\r\\t]*"  # JSON's whitespace, as xgrammar writes it with any_whitespace


def json_with_whitespace(schema: str, pattern: str) -> str:
    """The schema's EBNF with every stretch of free whitespace matching `pattern` instead (the lookaheads that
    end strings keep theirs: they only test what may follow)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True))
    space = re.sub(r"\broot(\w*)", r"ddscope_space\1", str(xgr.Grammar.from_regex(pattern)))
    body = re.sub(r"(?<!\(=\()" + re.escape(FREE_SPACE), "ddscope_space", text)
    return body + "\n" + space


def choice_grammar(choices: list[str]) -> str:
    """An EBNF whose sentences are exactly `choices`."""
    return "root ::= " + " | ".join(f'"{_escape(s)}"' for s in choices)


def _escape(s: str) -> str:
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\u{ord(m.group()):04x}", out)


def _uncommented(text: str) -> str:
    return "\n".join(re.sub(r"(#|//).*$", "", line) for line in text.splitlines())


def first_line(e: Exception) -> str:
    """The error's first line, without the "[time] file.cc:line:" that xgrammar's C++ puts before it."""
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)[:300]
