"""What the output must match (a Constraint), and the error of one that cannot be served honestly."""
from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class ConstraintError(ValueError):
    """A constraint that does not compile (or not in time, or not honestly): the request's fault, a 400."""


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


def first_line(e: Exception) -> str:
    """The error's first line, without the "[time] file.cc:line:" that xgrammar's C++ puts before it."""
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)[:300]
