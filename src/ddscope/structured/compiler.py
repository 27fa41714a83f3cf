"""One engine's grammar compiler: constraints compiled by the backend `--structured-outputs-config` names, once,
cached by constraint, before the request is admitted (the server compiles on a thread of its own; the compiled
grammar travels with the request, so the engine's thread never compiles).

`auto` falls back per constraint, as vLLM's does (v1/structured_output/__init__.py): xgrammar where it enforces
the whole constraint, else guidance; where neither does, the refusal names the keyword and its path. Structural
tags (forced tool calls) are xgrammar's format and compile there under every backend. A compile runs on a
thread of its own and is bounded in time: one past COMPILE_TIMEOUT_S is refused, and so is the same constraint
again, while it runs on."""
from __future__ import annotations

import dataclasses
import json
import re
import string
import threading
from collections import OrderedDict
from typing import Any

from ddscope.structured.backend import BACKENDS, CHOICES, Backend, Compiled, backend_class
from ddscope.structured.constraint import Constraint, ConstraintError
from ddscope.structured.json_scan import Tokens, UniqueCompiled
from ddscope.structured.rewrite import portable
from ddscope.structured.schema import MAX_NESTING, locate, nesting
from ddscope.structured.unique import Plan, enforced

COMPILE_TIMEOUT_S = 10.0  # vLLM bounds a regex's at 5 s (VLLM_REGEX_COMPILATION_TIMEOUT_S) and nothing else
MAX_RUNAWAY = 4  # compiles past their time still running: beyond this, new ones wait for them to end
CACHE_ENTRIES = 256
Key = tuple[str, Constraint]  # (backend asked for, constraint)


class Grammars:
    """The compiler of one engine's tokenizer: each backend built at its first compile, so that an engine never
    asked for a constraint loads none."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], timeout_s: float = COMPILE_TIMEOUT_S,
                 backend: str = "auto"):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self.timeout_s, self.backend = timeout_s, backend
        self.backends: dict[str, Backend] = {}
        self.cache: OrderedDict[Key, Compiled] = OrderedDict()
        self.running: dict[Key, threading.Thread] = {}  # compiles past their time, still going
        self.lock = threading.Lock()
        self.building = threading.Lock()  # held while a backend is built: about a second, so not `lock`
        self._tokens: Tokens | None = None

    def compile(self, c: Constraint, backend: str | None = None) -> Compiled:
        """The compiled grammar (cached); ConstraintError if no backend asked for enforces it, or it does not
        compile within the time limit."""
        key = (backend or self.backend, c)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
            self.running = {k: t for k, t in self.running.items() if t.is_alive()}
            if key in self.running:
                raise ConstraintError(f"compiling this {c.kind} took over {self.timeout_s:g} s; it is refused")
            if len(self.running) >= MAX_RUNAWAY:
                raise ConstraintError("the server is still compiling constraints that ran past their time limit")
        order = [self.backend_named(n) for n in self.order(key[0], c)]  # made ready here, outside the time limit
        tokens = self.tokens() if c.kind == "json" and _names_unique(c.spec) else None  # and so is this
        compiled = self._bounded(key, lambda: self._first(order, c, tokens))
        with self.lock:
            self.cache[key] = compiled
            while len(self.cache) > CACHE_ENTRIES:
                self.cache.popitem(last=False)
        return compiled

    def backend_named(self, name: str) -> Backend:
        """The engine's backend `name`, built and made ready once (compiles run on several threads at once)."""
        with self.building:
            if name not in self.backends:
                backend = backend_class(name)(self.tokenizer, self.vocab_size, self.stop_ids)
                backend.ready()
                self.backends[name] = backend
            return self.backends[name]

    def tokens(self) -> Tokens:
        """Each token's bytes, as the uniqueItems scanner reads them: once per engine."""
        with self.building:
            if self._tokens is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._tokens = Tokens(info.decoded_vocab)
            return self._tokens

    @staticmethod
    def order(backend: str, c: Constraint) -> list[str]:
        """The backends to try, in turn."""
        if backend not in CHOICES:
            raise ConstraintError(f"unknown structured-outputs backend {backend!r}; one of {', '.join(CHOICES)}")
        if c.kind == "structural_tag":
            return ["xgrammar"]
        return list(BACKENDS) if backend == "auto" else [backend]

    def _bounded(self, key: Key, work: Any) -> Compiled:
        """`work()` on a thread of its own, given timeout_s."""
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["grammar"] = work()
            except Exception as e:
                result["error"] = e

        worker = threading.Thread(target=run, name="ddscope-grammar", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            with self.lock:
                self.running[key] = worker
            raise ConstraintError(f"compiling the {key[1].kind} constraint took over {self.timeout_s:g} s")
        if "error" in result:
            raise result["error"]
        return result["grammar"]

    @staticmethod
    def _first(order: list[Backend], c: Constraint, tokens: Tokens | None) -> Compiled:
        """The first backend's grammar that enforces all of `c`; else the refusal of the last one tried (the most
        capable), with the gaps of those before it. A `not` is written as what it leaves, where it can be
        (rewrite.portable), and uniqueItems is kept beside the backend, where a scanner can (unique.enforced).
        The schema is tried as written exactly first, then narrower where a `not` or oneOf cannot be written
        whole; a refusal is the exact reading's, which names the keyword that could not be written."""
        given, plan = _given(c, narrowing=False)
        try:
            return _compiled(order, given, plan, c, tokens)
        except ConstraintError as refusal:
            narrower, plan = _given(c, narrowing=True)
            if narrower.spec == given.spec:
                raise
            try:
                return _compiled(order, narrower, plan, c, tokens)
            except ConstraintError:
                raise refusal from None


def _given(c: Constraint, narrowing: bool) -> tuple[Constraint, Plan | None]:
    """`c` as the backends are given it: a JSON schema rewritten (portable) and without the uniqueItems a scanner
    keeps (the plan that keeps them)."""
    if c.kind != "json":
        return c, None
    try:
        schema = json.loads(c.spec)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"the json constraint is not JSON: {e}") from None
    check_nesting(schema)
    stripped, plan = enforced(portable(schema, narrowing))
    if plan is not None and c.whitespace is not None and not json_space_only(c.whitespace):
        raise ConstraintError(f"uniqueItems at {locate(schema, 'uniqueItems')} is not enforced beside a "
                              "whitespace_pattern that matches more than JSON's whitespace")
    return (dataclasses.replace(c, spec=json.dumps(stripped)) if stripped != schema else c), plan


def _compiled(order: list[Backend], c: Constraint, plan: Plan | None, asked: Constraint,
              tokens: Tokens | None) -> Compiled:
    refusals = []
    for backend in order:
        try:
            gaps = backend.gaps(c)
            if gaps:
                raise ConstraintError(f"{gaps[0]} by {backend.name}" + (f" (and {len(gaps) - 1} more)"
                                                                       if len(gaps) > 1 else ""))
            compiled = backend.compile(c)
            if plan is None:
                return compiled
            assert tokens is not None  # built wherever the parsed spec names uniqueItems
            return UniqueCompiled(asked, compiled, plan, tokens)
        except ConstraintError as e:
            refusals.append(str(e))
    raise ConstraintError("; ".join(reversed(refusals)))


def _names_unique(spec: str) -> bool:
    try:
        return "uniqueItems" in json.dumps(json.loads(spec))  # as parsed: "unique\\u0049tems" names it too
    except ValueError:
        return False


def json_space_only(pattern: str) -> bool:
    """Whether a whitespace regex matches no character but JSON's four (the uniqueItems scanner reads only those)."""
    probe = string.printable.translate({ord(c): None for c in " \t\n\r"}) + "\x85\xa0\u2028\u3000"
    try:
        return not any(re.fullmatch(pattern, c) for c in probe)
    except re.error:
        return False


def check_nesting(schema: Any) -> None:
    """ConstraintError where the output would nest objects and arrays more than MAX_NESTING deep."""
    try:
        depth = nesting(schema)
    except RecursionError:
        depth = MAX_NESTING + 1
    if depth > MAX_NESTING:
        raise ConstraintError(f"the output would nest objects and arrays {depth} levels deep; at most {MAX_NESTING}")
