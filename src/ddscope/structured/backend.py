"""The grammar backends behind one interface, as vLLM's (v1/structured_output/backend_types.py): a Backend names
what it would not enforce and compiles the rest once, to a Compiled grammar that travels with the request; the
tree walk drives a Matcher of it. A new backend is one module and one line in BACKENDS."""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from ddscope.structured.constraint import Constraint
from ddscope.structured.schema import Gap

if TYPE_CHECKING:  # the server builds constraints without loading torch
    import torch

BACKENDS: dict[str, tuple[str, str]] = {  # name -> module, class; `auto` tries them in this order
    "xgrammar": ("xgrammar_backend", "XGrammarBackend"),
    "guidance": ("guidance_backend", "GuidanceBackend"),
}
CHOICES = ("auto", *BACKENDS)  # --structured-outputs-config's backend, as vLLM names them


class Matcher(Protocol):
    """One sequence's position in a compiled grammar, as the tree walk drives it."""

    def accept(self, token: int) -> bool:
        """Take `token` if the grammar allows it here (False, and no change, if not)."""

    def rollback(self, tokens: int) -> None:
        """Undo the last `tokens` accepted."""

    def is_terminated(self) -> bool:
        """A stop token ended the grammar."""

    def fill(self, bitmask: torch.Tensor) -> None:
        """The legal next tokens into an int32 [1, ceil(vocab / 32)] bitmask (bit i of word w: token 32 w + i)."""

    def forces(self) -> bool:
        """Whether the grammar forces the next bytes here: about a microsecond where a fill may take a hundred, and
        true wherever a single token is legal (it forces its bytes)."""


class Compiled(ABC):
    """A constraint compiled by one backend, once, before the request is admitted: it travels with the request
    to the engine, which makes a matcher of it for each sequence."""

    def __init__(self, constraint: Constraint, backend: str):
        self.constraint, self.backend = constraint, backend

    @abstractmethod
    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start."""


class Backend(ABC):
    """One engine's compiler for one backend: the tokenizer's vocabulary, its stop tokens the engine's EOS."""
    name: str

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids

    def ready(self) -> None:
        """Build what a first compile needs (the tokenizer's tables): once, outside any compile's time limit."""

    @abstractmethod
    def gaps(self, c: Constraint) -> list[Gap]:
        """What of `c` this backend would loosen (empty: it enforces all of it)."""

    @abstractmethod
    def compile(self, c: Constraint) -> Compiled:
        """`c` compiled; ConstraintError naming the keyword and path where it refuses it."""


def backend_class(name: str) -> type[Backend]:
    """The backend's class, imported when first asked for; KeyError naming the backends there are."""
    if name not in BACKENDS:
        raise KeyError(f"unknown structured-outputs backend {name!r}; one of {', '.join(CHOICES)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(f"ddscope.structured.{module}"), cls)
