"""A server in a process of its own, on a free 127.0.0.1 port, healthy before it is used and stopped on exit:
the bench's own `ddscope serve` and every real peer start this way."""
from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

POLL_S = 0.2


class ServerFailed(RuntimeError):
    """The server process exited or never became healthy; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A free port below the kernel's ephemeral range. A port the kernel hands out (bind to 0) is handed out again
    to the sockets a server opens while it starts (SGLang's gloo and ZMQ), and its own bind then fails (seen in CI)."""
    low = _ephemeral_low()
    for _ in range(tries):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} below {low} in {tries} tries")


def _ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default low bound


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


def _wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    why = wait_healthy(url, lambda: proc.poll() is None, timeout_s, POLL_S)
    if why == "stopped":
        raise ServerFailed(f"the server exited with code {proc.returncode} during startup "
                           f"(log: {log_path}):\n{_tail(log_path)}")
    if why == "timeout":
        raise ServerFailed(f"the server at {url} was not healthy within {timeout_s:g} s (log: {log_path}):\n"
                           f"{_tail(log_path)}")


def wait_healthy(url: str, alive: Callable[[], bool], timeout: float, poll_s: float = 0.05) -> str | None:
    """Poll `url`/health until it answers 200 (None), the server stops ("stopped"), or `timeout` s pass
    ("timeout")."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not alive():
                return "stopped"
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return None
            except httpx.TransportError:
                pass
            time.sleep(poll_s)
    return "timeout"
