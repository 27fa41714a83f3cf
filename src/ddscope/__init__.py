"""ddscope: DDTree speculative decoding you can see into.

`Engine` and the rest load on first use, so that `ddscope --help` imports no torch."""
from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineConfig", "Generation", "Request", "RequestError", "Step"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ddscope import engine
        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
