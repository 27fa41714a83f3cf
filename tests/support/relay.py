"""A relay in front of a real server, for tests that watch or trim what the bench sees of it."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx


class Relay(ThreadingHTTPServer):
    """Forwards every request to `upstream` on a free 127.0.0.1 port; a subclass overrides `forward` to look at
    or change an exchange."""

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream, self.client = upstream, httpx.Client(timeout=600)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def forward(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes, str]:
        """(status, content, content type) of the upstream's answer."""
        resp = self.client.request(method, self.upstream + path, content=body,
                                   headers={"content-type": "application/json"})
        return resp.status_code, resp.content, resp.headers.get("content-type", "")

    @contextmanager
    def running(self) -> Iterator[Relay]:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        try:
            yield self
        finally:
            self.shutdown()
            self.client.close()


class _Handler(BaseHTTPRequestHandler):
    server: Relay

    def log_message(self, *args: Any) -> None:
        pass

    def _relay(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else None
        status, content, kind = self.server.forward(method, self.path, body)
        self.send_response(status)
        self.send_header("content-type", kind or "application/json")
        self.send_header("content-length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._relay("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._relay("POST")
