"""What every real peer ddscope starts has in common (vllm_peer, sglang_peer): its process on a free 127.0.0.1
port, stopped on exit, and a start that fails reported with the peer's own root-cause line."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ddscope.util.process import ServerFailed, server_process


class PeerUnavailable(RuntimeError):
    """A peer cannot be installed or started here; the message says why."""


def first_raised(lines: list[str]) -> str | None:
    """The first `SomethingError: message` (or Exception) among `lines`: a traceback's own exception, or a chained
    one's original cause."""
    for line in lines:
        if found := re.search(r"\b(\w*(?:Error|Exception): .+)", line):
            return found.group(1).strip()
    return None


@contextmanager
def peer_server(cmd: list[str], port: int, log_path: Path, startup_timeout_s: float, env: dict[str, str],
                name: str, cause: Callable[[str], str | None]) -> Iterator[str]:
    """`cmd` serving on 127.0.0.1:`port`; yields its URL. A startup failure is PeerUnavailable led by `cause` of
    the log (the peer `name`'s root cause), a failure after it the caller's own."""
    url, started = f"http://127.0.0.1:{port}", False
    try:
        with server_process(cmd, url, log_path, startup_timeout_s, env):
            started = True
            yield url
    except ServerFailed as e:
        if started:
            raise
        why = cause(log_path.read_text(errors="replace")) if log_path.is_file() else None
        raise PeerUnavailable(f"{name}'s root cause: {why}\n{e}" if why else str(e)) from e
