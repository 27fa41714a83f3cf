"""Many sequences decoded together, one batched step at a time: sequence, block_manager, scheduler, runner, and
the public Engine over them. `Engine`, `Generation` and `Step` load on first use, so that `limits` (read by the
CLI and the server's schemas) costs no torch import."""
from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {"Engine": "ddscope.engine.engine", "Generation": "ddscope.engine.engine", "Step": "ddscope.engine.sequence",
         "load_engine": "ddscope.engine.engine", "Request": "ddscope.engine.request",
         "RequestError": "ddscope.engine.request", "EngineConfig": "ddscope.engine.limits"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
