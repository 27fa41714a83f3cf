"""The bench's own `ddscope serve`, in a process of its own when no --url is given.

A server on a thread of the bench's process shares its interpreter lock and its cores with the client that
times it, and so measures their contention rather than the engine (docs/bench.md says by how much).
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddscope.util.process import free_port, server_process


@contextmanager
def serve_process(serve_args: list[str], log_path: Path, host: str = "127.0.0.1") -> Iterator[str]:
    """`ddscope serve SERVE_ARGS` on a free port of `host`; yields its URL."""
    port = free_port(host)
    url = f"http://{host}:{port}"
    cmd = [sys.executable, "-m", "ddscope.cli", "serve", "--host", host, "--port", str(port), *serve_args]
    with server_process(cmd, url, log_path):
        yield url
