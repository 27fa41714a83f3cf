"""Run the server: `serve` blocks (the CLI); `serve_in_background` is a context manager (tests, bench)."""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from ddscope.server.app import ServerConfig, attach_engine, create_app, mark_load_failed
from ddscope.util.process import wait_healthy

if TYPE_CHECKING:
    from ddscope.engine import Engine

log = logging.getLogger("ddscope.server")


class Server(uvicorn.Server):
    """uvicorn, except that at shutdown the engine worker is drained first: requests get the grace period to
    finish, and those still running or queued after it are answered 503 by the worker. (uvicorn itself would
    cancel their handlers and answer 500.)"""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self.config.app.state.ddscope
        await asyncio.to_thread(state.drain, self.config.timeout_graceful_shutdown)  # None: as long as it takes
        await super().shutdown(sockets)  # the handlers answer at once now; the lifespan's close() comes last


def _load_engine(target: str | Path | None, drafter: str | Path | None, engine_kw: dict[str, Any]) -> Engine:
    from ddscope.engine import Engine  # heavy (torch, transformers): only once a server is wanted

    return Engine.load(target=target, drafter=drafter, **engine_kw)


def _split(options: dict[str, Any]) -> tuple[ServerConfig, dict[str, Any]]:
    """A server's keyword options: ServerConfig's fields, and the rest Engine.load's."""
    names = {f.name for f in fields(ServerConfig)}
    return (ServerConfig(**{k: v for k, v in options.items() if k in names}),
            {k: v for k, v in options.items() if k not in names})


def serve(target: str | Path | None = None, drafter: str | Path | None = None, host: str = "127.0.0.1",
          port: int = 8000, *, shutdown_timeout: float = 30.0, **options: Any) -> None:
    """Listen at once (/health answers 503 while loading), load the engine in the background, serve.
    `options`: ServerConfig's fields (`method`, None: ddtree with a drafter, else ar), then Engine.load's.

    On SIGINT/SIGTERM, in-flight requests get `shutdown_timeout` seconds to finish, then are cancelled;
    then, as uvicorn does, the signal is raised again (KeyboardInterrupt for SIGINT). Raises the load
    error, after stopping the server, if the engine cannot be loaded.
    """
    config, engine_kw = _split(options)
    app = create_app(config)
    server = Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout))
    failure: list[BaseException] = []

    def load() -> None:
        t0 = time.monotonic()
        try:
            engine = _load_engine(target, drafter, engine_kw)
            attach_engine(app, engine)
        except Exception as e:  # noqa: BLE001 - whatever the failure, stop the server rather than hang at 503
            failure.append(e)
            mark_load_failed(app, str(e))
            server.should_exit = True
            return
        from ddscope.models.native import kernels

        log.info("model %s ready in %.1f s: methods=%s max_model_len=%d default method=%s budget=%s kernels=%s",
                 engine.model_name, time.monotonic() - t0, ",".join(engine.methods), engine.max_model_len,
                 config.method, config.budget or engine.config.budget, kernels())

    threading.Thread(target=load, name="ddscope-load", daemon=True).start()
    server.run()
    if failure:
        raise failure[0]


@contextmanager
def serve_in_background(target: str | Path | None = None, drafter: str | Path | None = None,
                        host: str = "127.0.0.1", port: int = 0, *, engine: Engine | None = None,
                        shutdown_timeout: float = 5.0, startup_timeout: float = 60.0,
                        **options: Any) -> Iterator[str]:
    """Load the engine (or use `engine`), serve it from a background thread, yield the base URL. `options`:
    ServerConfig's fields (`method`, None: ddtree with a drafter, else ar), then Engine.load's.

    port=0 picks a free port. Waits until /health is 200. On exit, in-flight requests get `shutdown_timeout`
    seconds to finish before they are cancelled, then the worker stops.
    """
    config, engine_kw = _split(options)
    if engine is None:
        engine = _load_engine(target, drafter, engine_kw)
    app = create_app(config, engine)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))  # bound here, so the URL is known before uvicorn starts
    # log_config=None: leave the host process's logging alone.
    server = Server(uvicorn.Config(app, log_config=None, access_log=False,
                                   timeout_graceful_shutdown=shutdown_timeout))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="ddscope-uvicorn", daemon=True)
    thread.start()
    url = f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}"
    try:
        _wait_healthy(url, thread, startup_timeout)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _wait_healthy(url: str, thread: threading.Thread, timeout: float) -> None:
    why = wait_healthy(url, thread.is_alive, timeout)
    if why == "stopped":
        raise RuntimeError(f"the server at {url} stopped during startup; see the log")
    if why == "timeout":
        raise TimeoutError(f"the server at {url} was not healthy within {timeout:g} s")
