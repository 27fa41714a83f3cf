"""Servers in processes of their own: the bench's `ddscope serve` when no --url is given, and real
peers (ddscope.vllm_peer).

A server on a thread of the bench's process shares its interpreter lock and its cores with the client
that times it, and so measures their contention rather than the engine (2.4x slower on a 2-core CPU).
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddscope.server.launch import wait_healthy

POLL_S = 0.2


class ServerFailed(RuntimeError):
    """The server process exited or never became healthy; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(text[-lines:])


@contextmanager
def server_process(cmd: list[str], url: str, log_path: Path, startup_timeout_s: float = 600.0,
                   env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run `cmd`, its output in `log_path`, until `url`/health answers 200; stop it (SIGINT, then
    SIGKILL) on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        _wait_healthy(url, proc, log_path, startup_timeout_s)
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def serve_process(serve_args: list[str], log_path: Path, host: str = "127.0.0.1") -> Iterator[str]:
    """`ddscope serve SERVE_ARGS` on a free port of `host`; yields its URL."""
    port = free_port(host)
    url = f"http://{host}:{port}"
    cmd = [sys.executable, "-m", "ddscope.cli", "serve", "--host", host, "--port", str(port), *serve_args]
    with server_process(cmd, url, log_path):
        yield url


def _wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    why = wait_healthy(url, lambda: proc.poll() is None, timeout_s, POLL_S)
    if why == "stopped":
        raise ServerFailed(f"the server exited with code {proc.returncode} during startup "
                           f"(log: {log_path}):\n{_tail(log_path)}")
    if why == "timeout":
        raise ServerFailed(f"the server at {url} was not healthy within {timeout_s:g} s (log: {log_path}):\n"
                           f"{_tail(log_path)}")
