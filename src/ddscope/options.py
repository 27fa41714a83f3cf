"""Command-line options shared by `ddscope` subcommands (generate, serve, bench).

A leaf module: the subcommand parsers import it, and the top-level `ddscope.cli` imports them, so
no import loop runs through `ddscope.cli`.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddscope.engine import Engine


def budget_arg(value: str) -> int | str:
    """A DDTree node budget: an integer >= 1, or 'auto'."""
    if value == "auto":
        return value
    try:
        budget = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be an integer >= 1 or 'auto', got {value!r}") from None
    if budget < 1:
        raise argparse.ArgumentTypeError(f"budget must be >= 1, got {budget}")
    return budget


def add_model_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--target/--drafter/--device/--dtype, shared by every command that loads an engine."""
    p.add_argument("--target", help="target checkpoint directory (HF layout; default: the bundled demo target)")
    p.add_argument("--drafter", help="DFlash drafter directory (z-lab layout; default: the demo drafter with the "
                                     "demo target, none with --target, which allows only --method ar)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="torch dtype (default: %(default)s)")


def load_engine(args: argparse.Namespace, **kw: Any) -> Engine:
    """The engine named by add_model_args' options; torch is imported only here."""
    from ddscope.engine import Engine
    return Engine.load(args.target, args.drafter, device=args.device, dtype=args.dtype, **kw)
