"""Command-line options shared by `ddscope` subcommands (generate, serve, bench, eval-acceptance).

A leaf module: the subcommand parsers import it, and the top-level `ddscope.cli` imports them, so
no import loop runs through `ddscope.cli`.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable


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


def default_threads() -> int:
    """One fewer torch thread than the CPUs this process may use (at least 1). torch splits each op evenly over
    its OpenMP threads and waits for the slowest, so a thread whose core another process keeps busy stalls
    every op; docs/server.md (Threads) measures it. vLLM's CPU backend likewise keeps a core free."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low` (argparse names the option in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1, e.g. prompt lengths."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def any_int_list(text: str) -> list[int]:
    """Comma-separated integers, unchecked: layer ids and contexts, which their consumer checks against a model."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def number_in(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """A float in [low, high], or (low, high] with low_open."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {text}")
        return value
    return parse


def add_threads_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--threads, defaulting to default_threads() (shown in --help as this machine's number)."""
    p.add_argument("--threads", type=at_least(1), default=default_threads(),
                   help="torch CPU threads (default: %(default)s, one fewer than the usable CPUs, so a busy core "
                        "elsewhere cannot stall every op; see docs/server.md, Threads)")


def threads_or_auto(text: str) -> int | None:
    """--prefill-threads: 'auto' (None) or an integer >= 1."""
    return None if text == "auto" else at_least(1)(text)


def add_prefill_threads_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--prefill-threads", type=threads_or_auto, default=None, metavar="N|auto",
                   help="torch threads for a large step: a prompt of 256+ new tokens, or a batch of several "
                        "sequences (default: auto, the decode's --threads plus the CPUs other processes leave idle: "
                        "large matmuls split well; see docs/server.md, Threads)")


def set_threads(threads: int) -> None:
    """Apply --threads to torch (imported only here)."""
    import torch
    torch.set_num_threads(threads)


def add_model_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--target/--drafter/--device/--dtype, shared by every command that loads an engine."""
    p.add_argument("--target", help="target checkpoint directory (HF layout; default: the bundled demo target)")
    p.add_argument("--drafter", help="DFlash drafter directory (z-lab layout; default: the demo drafter with the "
                                     "demo target, none with --target, which allows only --method ar)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="torch dtype (default: %(default)s)")


def stdout_console():
    """A rich console on stdout; redirected to a file it is wide, so no column is cut to rich's default 80."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)
