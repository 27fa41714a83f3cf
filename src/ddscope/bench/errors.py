"""The errors every room of the bench raises, and its one warning. The CLI turns each into one line and an exit
code: `BenchError` and `AnalysisError` exit 2, `Stopped` and `NothingMeasured` exit 1."""
from __future__ import annotations

import sys


class BenchError(Exception):
    """A bad flag or unusable input: printed as one line, exit code 2."""


class Stopped(BenchError):
    """A run that stopped early (the server lost, Ctrl-C, a dropped stream): printed as one line, exit code 1."""


class AnalysisError(ValueError):
    """Input that cannot be analysed, with a message that says why."""


class NothingMeasured(AnalysisError):
    """No request produced a measurement: the one case that exits 1."""


def warn(message: str) -> None:
    print(f"ddscope bench: warning: {message}", file=sys.stderr)
