"""The server's state: its config, the engine and its worker once loaded, and the private tokenizer thread."""
from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ddscope.engine.limits import default_method
from ddscope.engine.request import check_method
from ddscope.server.constraints import StructuredOutputsConfig
from ddscope.server.metrics import ServerMetrics
from ddscope.server.schemas import APIError
from ddscope.server.worker import EngineWorker


if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ddscope.engine import Engine

T = TypeVar("T")



@dataclass
class Surface:
    """What a team exposes to agents, in vLLM's flags: keys, model names, CORS, structured outputs and tools."""
    api_keys: tuple[str, ...] = ()  # --api-key: any of them, as a Bearer token, on /v1 (empty: open)
    served_model_names: tuple[str, ...] = ()  # --served-model-name: the names answered to, the first reported
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    tool_parser: str | None = None  # --tool-call-parser, with --enable-auto-tool-choice: reads `auto` calls
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no cross-origin access (vLLM's default)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass
class ServerConfig:
    method: str | None = None  # requests' default: None, ddtree with a drafter, else ar (set at load)
    budget: int | str | None = None  # requests' default: None, the engine's
    max_queue: int = 64
    request_timeout: float = 600.0
    max_body_bytes: int = 8 * 1024 * 1024
    log_interval: float = 10.0
    spec_decode_metrics: str = "summary"  # vLLM's --per-request-spec-decode-metrics: none, summary or detailed
    per_request_metrics: bool = False     # vLLM's --enable-per-request-metrics: the timing fields too
    surface: Surface = field(default_factory=Surface)


class ServerState:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = ServerMetrics()
        self.engine: Engine | None = None
        self.worker: EngineWorker | None = None
        self.load_error: str | None = None
        # Tokenization stays off both the event loop and the engine thread: a private copy of the
        # tokenizer on one thread, since HF fast tokenizers are not safe to share across threads.
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self._tok_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddscope-tokenize")

    def attach(self, engine: Engine) -> None:
        self.config.method = self.config.method or default_method(engine.methods)
        if self.config.method not in engine.methods:
            raise ValueError(f"default method {self.config.method!r} is not available for this checkpoint "
                             f"(available: {', '.join(engine.methods)}); pass a drafter or --method ar")
        check_method(self.config.method, self.config.budget, engine.bounds)  # fail at startup on a bad budget
        engine.calibrate()  # here, on the load thread: never on the event loop, never beside a decode
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.worker = EngineWorker(engine, self.metrics.bind(self.names(engine)[0]), max_queue=self.config.max_queue,
                                   log_interval=self.config.log_interval)
        self.engine = engine  # last: /health turns 200 only when everything is in place

    def names(self, engine: Engine) -> tuple[str, ...]:
        """The model names this server answers to, the first the one it reports."""
        return self.config.surface.served_model_names or (engine.model_name,)

    def drain(self, grace: float | None) -> None:
        """Refuse new requests, give those in flight `grace` seconds, then answer the rest 503. The handlers
        still render their answers (tokenizer thread and all) until close()."""
        if self.worker is not None:
            self.worker.close(grace)

    def close(self) -> None:
        """Stop, and let go of the engine: FastAPI's caches keep the app's endpoints, and so this state, alive
        (fastapi/dependencies/models.py: lru_cache of 4,096 callables in 0.165), and an engine holds its KV pool."""
        self.drain(0.0)
        self._tok_thread.shutdown(wait=False, cancel_futures=True)
        self.engine = self.worker = self.tokenizer = None

    async def tokenize(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tok_thread, fn, *args)


def engine_of(state: ServerState) -> Engine:
    if state.engine is None:
        raise APIError(503, "the model is still loading" if state.load_error is None
                       else f"the model failed to load: {state.load_error}", code="model_not_ready",
                       headers={"Retry-After": "5"})
    return state.engine
