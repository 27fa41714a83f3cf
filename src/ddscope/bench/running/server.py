"""The server a run talks to: --url, or the bench's own `ddscope serve` in a process of its own; checked reachable,
its log followed (--server-log / --log-cmd), and the tokenizer that sizes prompts for it.

A server on a thread of the bench's process shares its interpreter lock and its cores with the client that
times it, and so measures their contention rather than the engine (docs/bench.md says by how much).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ddscope.bench.errors import BenchError


@contextmanager
def serve_process(serve_args: list[str], log_path: Path, host: str = "127.0.0.1") -> Iterator[str]:
    """`ddscope serve SERVE_ARGS` on a free port of `host`; yields its URL."""
    from ddscope.util.process import free_port, server_process

    port = free_port(host)
    url = f"http://{host}:{port}"
    cmd = [sys.executable, "-m", "ddscope.cli", "serve", "--host", host, "--port", str(port), *serve_args]
    with server_process(cmd, url, log_path):
        yield url


def on_server(args: argparse.Namespace, root: Path, work: Callable[[str, Any, Any], Any]) -> Any:
    """`work(base_url, client, log)` against one server: embedded (its log in `root`) or --url."""
    import httpx

    from ddscope.util.process import ServerFailed

    server = contextlib.nullcontext(args.url) if args.url else _embedded(args, root / "server.log")
    try:
        with server as base_url, httpx.Client() as client, _server_log(args) as log:
            _check_reachable(base_url, client)
            return work(base_url, client, log)
    except ServerFailed as e:
        raise BenchError(str(e)) from e


def tokenizer_for(args: argparse.Namespace, base_url: str, client: Any) -> tuple[Any, str]:
    """The tokenizer that sizes prompts exactly, and where it came from: --tokenizer; the embedded
    server's target; else the server's own /tokenize or model directory (running/workloads.py)."""
    from ddscope.bench.collecting.backends import Server
    from ddscope.bench.running.workloads import find_tokenizer, local_tokenizer

    directory = args.tokenizer
    if directory is None and not args.url:
        from ddscope.engine.limits import DEMO_DIR

        directory = args.target or DEMO_DIR / "target"
    if directory is None:
        return find_tokenizer(base_url, client, Server(base_url, client).models())
    try:
        return local_tokenizer(directory), f"--tokenizer {directory}" if args.tokenizer else f"the target {directory}"
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot load a tokenizer from {directory}: {e}") from e


def _embedded(args: argparse.Namespace, log_path: Path) -> Any:
    """`ddscope serve` in its own process, as the run's server."""
    flags = ["--method", args.method, "--budget", str(args.budget), "--device", args.device, "--dtype", args.dtype]
    for flag, value in (("--target", args.target), ("--drafter", args.drafter)):
        if value:
            flags += [flag, str(value)]
    return serve_process(flags, log_path)


def _check_reachable(base_url: str, client: Any) -> None:
    """Fail in one line where nothing answers at the URL, before the tokenizer search and the probe,
    whose own warnings and errors would bury the cause."""
    import httpx

    from ddscope.bench.collecting.backends import Server

    try:
        client.get(Server(base_url, client).base_url + "/v1/models", timeout=10.0)
    except (httpx.TransportError, httpx.InvalidURL) as e:
        raise BenchError(f"cannot reach the server at {base_url}: {e}") from e


def _server_log(args: argparse.Namespace) -> Any:
    """The followed server log (--server-log / --log-cmd) as a context manager, or a null one."""
    from ddscope.bench.collecting.server_log import LogError, ServerLog

    if getattr(args, "server_log", None) is None and getattr(args, "log_cmd", None) is None:
        return contextlib.nullcontext(None)
    try:
        log = ServerLog(path=args.server_log, command=args.log_cmd)
    except LogError as e:
        raise BenchError(str(e)) from e
    return contextlib.closing(log)
