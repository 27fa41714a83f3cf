"""The FastAPI app: OpenAI-compatible completions and chat over one engine worker.

The app starts without an engine (/health answers 503 "loading") and serves once
`attach_engine` is called, so the CLI can listen before a large checkpoint has loaded.
Handlers only validate, tokenize (on a private tokenizer thread) and wait for events;
the engine itself runs on the EngineWorker thread.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from importlib.metadata import PackageNotFoundError, version
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddscope.server.generate import generate
from ddscope.server.requests import chat_ids, check_text, prompt_ids, truncate
from ddscope.server.responses import Reply
from ddscope.server.schemas import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeRequest, error_body, reject_unsupported, validation_error)
from ddscope.server.state import ServerConfig, ServerState, Surface, engine_of

if TYPE_CHECKING:
    from ddscope.engine import Engine

R = TypeVar("R", bound=BaseModel)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def create_app(config: ServerConfig | None = None, engine: Engine | None = None) -> FastAPI:
    state = ServerState(config or ServerConfig())
    if engine is not None:
        state.attach(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(state.close)  # off the loop, so the worker's last events still land

    app = FastAPI(title="ddscope", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ddscope = state
    _install_error_handlers(app)
    _install_surface(app, state.config.surface)

    @app.get("/version")
    async def version_() -> dict[str, str]:
        return {"version": _version()}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's /ping: /health's status, no body."""
        return Response(status_code=(await health()).status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.worker is not None and state.worker.dead is not None:
            return JSONResponse({"status": "error", "message": f"the engine worker died: {state.worker.dead!r}"},
                                status_code=503)
        if state.worker is not None and state.worker.closing:  # so a load balancer stops sending traffic
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if state.engine is not None:
            return JSONResponse({"status": "ok"})
        if state.load_error is not None:
            return JSONResponse({"status": "error", "message": state.load_error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine = engine_of(state)
        return {"object": "list", "data": [_model_card(engine, name) for name in state.names(engine)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        _check_model(state, model)
        return _model_card(state.engine, model)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """The served tokenizer, so clients size prompts exactly (as vLLM's and SGLang's /tokenize)."""
        req = await _parse(request, state, TokenizeRequest)
        check_text(req.prompt, "prompt", engine_of(state).max_model_len)
        ids = await state.tokenize(lambda: state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return {"count": len(ids), "max_model_len": engine_of(state).max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, state, DetokenizeRequest)
        engine = engine_of(state)
        prompt_ids(state.tokenizer, engine, req.tokens)  # the same range check as a prompt's
        return {"prompt": await state.tokenize(state.tokenizer.decode, req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, state, CompletionRequest)
        engine = engine_of(state)
        special = req.add_special_tokens is not False  # vLLM's default for completions: True
        prompts = [truncate(await state.tokenize(prompt_ids, state.tokenizer, engine, p, special), req, engine)
                   for p in req.prompts]
        reply = Reply(chat=False, model=state.names(engine)[0], include_usage=req.include_usage)
        return await generate(request, state, req, prompts, reply, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, state, ChatCompletionRequest)
        engine = engine_of(state)
        ids = truncate(await state.tokenize(chat_ids, state.tokenizer, engine, req), req, engine)
        reply = Reply(chat=True, model=state.names(engine)[0], include_usage=req.include_usage)
        return await generate(request, state, req, [ids], reply, arrival)

    return app


def attach_engine(app: FastAPI, engine: Engine) -> None:
    """Make a loading app ready: from here on /health is 200 and requests are served."""
    app.state.ddscope.attach(engine)


def mark_load_failed(app: FastAPI, message: str) -> None:
    app.state.ddscope.load_error = message


def _model_card(engine: Engine, name: str) -> dict[str, Any]:
    # root: the checkpoint directory, as vLLM's card names it; dtype: what the target runs in (the bench's floor)
    return {"id": name, "object": "model", "created": 0, "owned_by": "ddscope", "root": engine.source,
            "max_model_len": engine.max_model_len, "dtype": str(engine.target.lm_head.weight.dtype).removeprefix("torch.")}


def _check_model(state: ServerState, model: str | None) -> None:
    names = state.names(engine_of(state))
    if model is not None and model not in names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{', '.join(repr(n) for n in names)}", param="model", code="model_not_found")


def _version() -> str:
    try:
        return version("ddscope")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _install_surface(app: FastAPI, surface: Surface) -> None:
    """API keys on /v1 (vLLM's --api-key: /health, /ping, /version, /metrics and /tokenize stay open; keys compared
    as SHA-256 digests in constant time, as vLLM's middleware does), and CORS where origins are allowed."""
    if surface.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(surface.allowed_origins),
                           allow_methods=list(surface.allowed_methods), allow_headers=list(surface.allowed_headers),
                           allow_credentials=surface.allow_credentials)
    if not surface.api_keys:
        return
    digests = [hashlib.sha256(k.encode()).digest() for k in surface.api_keys]

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Response:
        if request.method == "OPTIONS" or not request.url.path.startswith("/v1"):
            return await call_next(request)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = hashlib.sha256(token.strip().encode()).digest()
        matches = [hmac.compare_digest(given, d) for d in digests]  # every key compared: no early exit
        if scheme.lower() == "bearer" and any(matches):
            return await call_next(request)
        return JSONResponse(error_body(401, "a missing or wrong API key: send it as 'Authorization: Bearer KEY'",
                                       code="invalid_api_key"), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():  # also catches chunked bodies that lie about their size
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise APIError(400, "the body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return data


async def _parse(request: Request, state: ServerState, model: type[R]) -> R:
    data = reject_unsupported(await _read_json(request, state.config.max_body_bytes))
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    _check_model(state, req.model)
    return req


# --- errors -----------------------------------------------------------------------------------

def _install_error_handlers(app: FastAPI) -> None:
    def rejected(request: Request, status: int) -> None:
        if request.url.path in GENERATION_PATHS and not getattr(request.state, "reached_engine", False):
            app.state.ddscope.metrics.rejected.labels(str(status)).inc()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        rejected(request, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return JSONResponse(error_body(exc.status_code, message, code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in err.get("loc", ())]
        rejected(request, 400)
        return JSONResponse(error_body(400, f"{'.'.join(loc)}: {err.get('msg')}", param=loc[-1] if loc else None,
                                       code="invalid_parameter"), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        rejected(request, 500)
        return JSONResponse(error_body(500, "internal server error; see the server log", code="internal_error"),
                            status_code=500)
