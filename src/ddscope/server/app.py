"""The FastAPI app: OpenAI-compatible completions and chat over one engine worker.

The app starts without an engine (/health answers 503 "loading") and serves once
`attach_engine` is called, so the CLI can listen before a large checkpoint has loaded.
Handlers only validate, tokenize (on a private tokenizer thread) and wait for events;
the engine itself runs on the EngineWorker thread.
"""
from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddscope.server.metrics import ServerMetrics
from ddscope.model import KVCacheFull
from ddscope.server.responses import Logprobs, Reply, merge_logprobs, per_request_metrics, prompt_logprobs, sse
from ddscope.server.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
    error_body,
    reject_unsupported,
    validation_error,
)
from ddscope.server.worker import (Done, EngineWorker, Event, Failed, InvalidRequest, Job, QueueFull, ShuttingDown,
                                   WorkerDied)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ddscope.engine import Engine

T = TypeVar("T")
R = TypeVar("R", bound=BaseModel)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_MAX_TOKENS = 16  # /v1/completions, as in the OpenAI API; chat defaults to the rest of the context


@dataclass
class ServerConfig:
    method: str = "ddtree"  # default for requests that do not name one
    budget: int | str | None = None  # None: the engine's default_budget
    max_queue: int = 64
    request_timeout: float = 600.0
    max_body_bytes: int = 8 * 1024 * 1024
    log_interval: float = 10.0
    spec_decode_metrics: str = "summary"  # vLLM's --per-request-spec-decode-metrics: none, summary or detailed
    per_request_metrics: bool = False     # vLLM's --enable-per-request-metrics: the timing fields too


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
        if self.config.method not in engine.methods:
            raise ValueError(f"default method {self.config.method!r} is not available for this checkpoint "
                             f"(available: {', '.join(engine.methods)}); pass a drafter or --method ar")
        engine.check(self.config.method, self.config.budget)  # fail at startup on a bad default budget
        engine.calibrate()  # here, on the load thread: never on the event loop, never beside a decode
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.worker = EngineWorker(engine, self.metrics.bind(engine.model_name), max_queue=self.config.max_queue,
                                   log_interval=self.config.log_interval)
        self.engine = engine  # last: /health turns 200 only when everything is in place

    def drain(self, grace: float | None) -> None:
        """Refuse new requests, give those in flight `grace` seconds, then answer the rest 503. The handlers
        still render their answers (tokenizer thread and all) until close()."""
        if self.worker is not None:
            self.worker.close(grace)

    def close(self) -> None:
        self.drain(0.0)
        self._tok_thread.shutdown(wait=False, cancel_futures=True)

    async def tokenize(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tok_thread, fn, *args)


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
        return {"object": "list", "data": [_model_card(_engine(state))]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        _check_model(_engine(state), model)
        return _model_card(state.engine)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """The served tokenizer, so clients size prompts exactly (as vLLM's and SGLang's /tokenize)."""
        req = await _parse(request, state, TokenizeRequest)
        _check_text(req.prompt, "prompt", _engine(state).max_model_len)
        ids = await state.tokenize(lambda: state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return {"count": len(ids), "max_model_len": _engine(state).max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, state, DetokenizeRequest)
        engine = _engine(state)
        _prompt_ids(state.tokenizer, engine, req.tokens)  # the same range check as a prompt's
        return {"prompt": await state.tokenize(state.tokenizer.decode, req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, state, CompletionRequest)
        engine = _engine(state)
        special = req.add_special_tokens is not False  # vLLM's default for completions: True
        prompts = [_truncate(await state.tokenize(_prompt_ids, state.tokenizer, engine, p, special), req, engine)
                   for p in req.prompts]
        reply = Reply(chat=False, model=engine.model_name, include_usage=req.include_usage)
        return await _generate(request, state, req, prompts, reply, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, state, ChatCompletionRequest)
        engine = _engine(state)
        ids = _truncate(await state.tokenize(_chat_ids, state.tokenizer, engine, req), req, engine)
        reply = Reply(chat=True, model=engine.model_name, include_usage=req.include_usage)
        return await _generate(request, state, req, [ids], reply, arrival)

    return app


def attach_engine(app: FastAPI, engine: Engine) -> None:
    """Make a loading app ready: from here on /health is 200 and requests are served."""
    app.state.ddscope.attach(engine)


def mark_load_failed(app: FastAPI, message: str) -> None:
    app.state.ddscope.load_error = message


# --- request handling -------------------------------------------------------------------------

def _engine(state: ServerState) -> Engine:
    if state.engine is None:
        raise APIError(503, "the model is still loading" if state.load_error is None
                       else f"the model failed to load: {state.load_error}", code="model_not_ready",
                       headers={"Retry-After": "5"})
    return state.engine


def _model_card(engine: Engine) -> dict[str, Any]:
    # root: the checkpoint directory, as vLLM's card names it; dtype: what the target runs in (the bench's floor)
    return {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "ddscope", "root": engine.source,
            "max_model_len": engine.max_model_len, "dtype": str(engine.target.lm_head.weight.dtype).removeprefix("torch.")}


def _check_model(engine: Engine, model: str | None) -> None:
    if model is not None and model != engine.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {engine.model_name!r}",
                       param="model", code="model_not_found")


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
    _check_model(_engine(state), req.model)
    return req


PROMPT_CHARS_PER_TOKEN = 32  # a text prompt longer than this x max_model_len cannot fit: refused before tokenizing


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, engine: Engine, prompt: str | list[int],
                special: bool = False) -> list[int]:
    if isinstance(prompt, list):
        bad = [t for t in prompt if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {engine.vocab_size}); got {bad[:5]}", param="prompt",
                           code="invalid_token_id")
        return prompt
    return _encode_text(tokenizer, prompt, "prompt", engine.max_model_len, special)


def _truncate(ids: list[int], req: SamplingRequest, engine: Engine) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last N tokens (after the chat template); -1 is max_model_len - 1."""
    n = req.truncate_prompt_tokens
    if n is None:
        return ids
    n = engine.max_model_len - 1 if n == -1 else n
    if not 0 < n <= engine.max_model_len:
        raise APIError(400, f"truncate_prompt_tokens={req.truncate_prompt_tokens} must be -1 or in "
                            f"[1, max_model_len = {engine.max_model_len}]", param="truncate_prompt_tokens",
                       code="invalid_parameter")
    return ids[-n:]


def _check_text(text: str, param: str, max_model_len: int) -> None:
    """Text that cannot be tokenized, or is too long to fit any context, is refused before the tokenizer runs."""
    if len(text) > PROMPT_CHARS_PER_TOKEN * max_model_len:
        raise APIError(400, f"{param}: {len(text)} characters, over the {PROMPT_CHARS_PER_TOKEN * max_model_len} "
                            f"that could fit max_model_len ({max_model_len})", param=param, code="prompt_too_long")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # JSON can carry lone surrogates ("\ud800"); tokenizers reject them
        raise APIError(400, f"{param}: not valid Unicode (a lone surrogate)", param=param,
                       code="invalid_parameter") from None


def _encode_text(tokenizer: PreTrainedTokenizerBase, text: str, param: str, max_model_len: int,
                 special: bool) -> list[int]:
    _check_text(text, param, max_model_len)
    # Too long to fit is refused first, so the tokenizer's own too-long warning never fires; `special`: the
    # request's add_special_tokens (a chat template spells out its own, so chat's default adds none).
    ids = tokenizer.encode(text, add_special_tokens=special, verbose=False)
    if not ids:
        raise APIError(400, f"{param}: tokenizes to no tokens", param=param, code="empty_prompt")
    return ids


def _chat_ids(tokenizer: PreTrainedTokenizerBase, engine: Engine, req: ChatCompletionRequest) -> list[int]:
    if not tokenizer.chat_template:
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       param="messages", code="no_chat_template")
    messages = [m.template_dict() for m in req.messages]
    for m in messages:
        _check_text(m["content"], "messages", engine.max_model_len)
    # vLLM's merge: the request's template variables, then the top-level flags over them
    kwargs = {**(req.chat_template_kwargs or {}), "add_generation_prompt": req.add_generation_prompt,
              "continue_final_message": req.continue_final_message}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except (TemplateError, ValueError, TypeError) as e:  # a template's raise_exception, or a bad conversation
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages",
                       code="invalid_messages") from None
    return _encode_text(tokenizer, text, "messages", engine.max_model_len, bool(req.add_special_tokens))


def _engine_params(state: ServerState, req: SamplingRequest, prompt_len: int) -> dict[str, Any]:
    engine = state.engine
    method = req.method or state.config.method
    budget = req.budget if req.budget is not None else state.config.budget
    try:
        engine.check(method, budget)  # pure: the proposer itself is made on the engine thread
    except ValueError as e:
        raise APIError(400, str(e), param="method" if method not in engine.methods else "budget",
                       code="invalid_parameter") from None
    room = engine.max_model_len - prompt_len
    max_tokens = req.requested_max_tokens()
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS if isinstance(req, CompletionRequest) else room
    if max_tokens > room or room < 1:
        raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                            f"({engine.max_model_len})", param="max_tokens" if room >= 1 else "prompt",
                       code="context_length_exceeded")
    if req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})",
                       param="min_tokens", code="invalid_parameter")
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    for name, ids in (("stop_token_ids", req.stop_token_ids or []), ("logit_bias", bias),
                      ("allowed_token_ids", req.allowed_token_ids or [])):
        if any(not 0 <= t < engine.vocab_size for t in ids):
            raise APIError(400, f"{name}: token ids must be in [0, {engine.vocab_size})", param=name,
                           code="invalid_token_id")
    logprobs = req.top_logprobs_wanted()
    if req.best_of is not None and req.best_of > req.n and logprobs is None:
        logprobs = 0  # best_of ranks its choices by their tokens' log-probs
    return {"max_new_tokens": max_tokens, "method": method, "budget": budget, "temperature": req.temperature,
            "top_p": req.top_p, "top_k": max(req.top_k, 0), "min_p": req.min_p, "seed": req.seed,
            "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens, "stop": req.stop,
            "stop_token_ids": req.stop_token_ids, "logit_bias": bias or None, "logprobs": logprobs,
            "prompt_logprobs": _prompt_logprobs_wanted(req), "repetition_penalty": req.repetition_penalty,
            "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
            "allowed_token_ids": req.allowed_token_ids, "bad_words": req.bad_words,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens,
            "spaces_between_special_tokens": req.spaces_between_special_tokens, "cache_salt": req.cache_salt,
            "priority": req.priority}


def _prompt_logprobs_wanted(req: SamplingRequest) -> int | None:
    """vLLM: the field, or on a completions echo the logprobs asked for (completion/protocol.py:373-375)."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return req.logprobs if isinstance(req, CompletionRequest) and req.echo else None


def _child(params: dict[str, Any], index: int) -> dict[str, Any]:
    """The `index`-th of a request's n choices: seeded at seed + index, as vLLM's parallel sampling."""
    return params if params["seed"] is None else {**params, "seed": params["seed"] + index}


def _failure(event: Failed, timeout: float) -> APIError:
    if event.status == "timeout":
        return APIError(408, f"the request timed out after {timeout:g} s", code="timeout")
    if isinstance(event.error, ShuttingDown):
        return APIError(503, str(event.error), code="shutting_down")
    if event.status == "cancelled":
        return APIError(499, "the request was cancelled", code="cancelled")  # nobody is left to read it
    if isinstance(event.error, InvalidRequest):  # invalid input only the engine caught
        return APIError(400, str(event.error), code="invalid_parameter")
    if isinstance(event.error, KVCacheFull):
        return APIError(503, f"out of KV cache ({event.error}); retry later", code="kv_cache_full",
                        headers={"Retry-After": "1"})
    if isinstance(event.error, WorkerDied):
        return APIError(500, f"{event.error}; see the server log", code="worker_died")
    return APIError(500, "the engine failed on this request; see the server log", code="engine_error")


async def _watch_disconnect(request: Request, worker: EngineWorker, jobs: list[Job]) -> None:
    """Cancel the jobs as soon as the client goes away (the body is read, so only disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.cancel("cancelled")
        worker.withdraw(job)  # a queued job frees its slot now
        job.events.put_nowait(Failed("cancelled"))  # wake a handler still waiting on a queued job


async def _next_event(job: Job) -> Event:
    if not job.events.empty():  # never time out with an event in hand
        return job.events.get_nowait()
    try:
        return await asyncio.wait_for(job.events.get(), timeout=max(job.deadline - time.monotonic(), 0.0))
    except TimeoutError:  # the worker enforces the deadline between steps; this covers queued jobs
        job.cancel("timeout")
        return Failed("timeout")


def _submit(state: ServerState, job: Job) -> None:
    try:
        state.worker.submit(job)
    except QueueFull as e:
        raise APIError(503, f"{e}; retry later", code="queue_full", headers={"Retry-After": "1"}) from None
    except ShuttingDown as e:
        raise APIError(503, str(e), code="shutting_down") from None
    except WorkerDied as e:
        raise APIError(503, str(e), code="worker_died") from None


async def _generate(request: Request, state: ServerState, req: SamplingRequest, prompts: list[list[int]],
                    reply: Reply, arrival: float) -> Response:
    params = [_engine_params(state, req, len(ids)) for ids in prompts]  # all checked before any runs
    k = req.choices  # sequences per prompt: choice p * k + c is prompt p's c-th
    many = len(prompts) * k > 1
    jobs = [Job(f"{reply.id}-{p * k + c}" if many else reply.id, ids, _child(ps, c),
                deadline=arrival + state.config.request_timeout, return_rounds=req.return_rounds,
                stream=bool(req.stream), arrival=arrival)
            for p, (ids, ps) in enumerate(zip(prompts, params)) for c in range(k)]
    submitted: list[Job] = []
    watcher = asyncio.create_task(_watch_disconnect(request, state.worker, submitted))
    try:
        for job in jobs:
            _submit(state, job)
            submitted.append(job)
            request.state.reached_engine = True  # requests_total counts it from here on, not rejected_requests
        # Wait for each first event before answering, so that a failure is still a proper status code.
        if req.stream:
            firsts = [await _next_event(job) for job in jobs]
            for event in firsts:
                if isinstance(event, Failed):
                    raise _failure(event, state.config.request_timeout)
            stream = _stream(state, jobs, req, reply, firsts, watcher)
            watcher = None  # owned by the stream from here on
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        outcomes = [await _outcome(job, state) for job in jobs]
        kept = [i for p in range(len(prompts)) for i in _best(outcomes, p * k, k, req.n)]
        choices = [await _choice(state, req, reply, index, jobs[i].prompt, outcomes[i])
                   for index, i in enumerate(kept)]
        metrics = per_request_metrics([outcomes[i].records for i in kept], state.config.spec_decode_metrics,
                                      state.config.per_request_metrics)
        return JSONResponse(reply.response(choices, [outcomes[i].stats for i in kept], metrics,
                                           **await _chat_extras(state, req, prompts[0], outcomes[0])))
    finally:
        if watcher is not None:
            watcher.cancel()
            for job in submitted:
                job.cancel()  # no-op once the job is done; stops it on any early exit
                state.worker.withdraw(job)


def _best(outcomes: list[Done], first: int, k: int, n: int) -> list[int]:
    """The n of one prompt's k sequences to answer with: all of them, or (best_of) the n with the highest
    log-prob per token (OpenAI's rule; vLLM 0.32 ignores best_of), in the order they ran."""
    run = list(range(first, first + k))
    if k == n:
        return run
    def per_token(i: int) -> float:
        lps = outcomes[i].logprobs or []
        return sum(lp.logprob for lp in lps) / max(len(lps), 1)
    return sorted(sorted(run, key=per_token, reverse=True)[:n])


async def _outcome(job: Job, state: ServerState) -> Done:
    """The Done of a non-streaming job (whose only events are its outcome), or its failure raised."""
    event = await _next_event(job)
    if isinstance(event, Failed):
        raise _failure(event, state.config.request_timeout)
    return event


async def _chat_extras(state: ServerState, req: SamplingRequest, prompt: list[int], done: Done) -> dict[str, Any]:
    """Chat's top-level vLLM fields: prompt_token_ids and prompt_logprobs (completions put them in each choice)."""
    if not isinstance(req, ChatCompletionRequest):
        return {}
    extras: dict[str, Any] = {}
    if req.return_token_ids:
        extras["prompt_token_ids"] = prompt
    if done.prompt_logprobs is not None:
        extras["prompt_logprobs"] = await state.tokenize(prompt_logprobs, state.tokenizer, prompt,
                                                         done.prompt_logprobs)
    return extras


async def _choice(state: ServerState, req: SamplingRequest, reply: Reply, index: int, prompt: list[int],
                  done: Done) -> dict[str, Any]:
    text, parts, extra = done.text, [], {}
    if req.return_token_ids:
        extra["token_ids"] = done.token_ids
    if isinstance(req, ChatCompletionRequest):
        text = req.echoed + text
    else:
        if req.return_token_ids:
            extra["prompt_token_ids"] = prompt
        if done.prompt_logprobs is not None and req.prompt_logprobs is not None:
            extra["prompt_logprobs"] = await state.tokenize(prompt_logprobs, state.tokenizer, prompt,
                                                            done.prompt_logprobs)
        if req.echo:
            # vLLM: with return_token_ids the prompt comes back as ids, and its echoed text is "" (serving.py:536)
            head = "" if req.return_token_ids else await state.tokenize(state.tokenizer.decode, prompt)
            text = head + text
            if done.prompt_logprobs is not None and req.logprobs is not None:
                parts.append(await state.tokenize(Logprobs(state.tokenizer, False).render, prompt,
                                                  done.prompt_logprobs))
    if req.top_logprobs_wanted() is not None:
        offset = len(text) - len(done.text)
        parts.append(await state.tokenize(Logprobs(state.tokenizer, reply.chat, offset).render, done.token_ids,
                                          done.logprobs))
    return reply.choice(text, done.finish_reason, done.matched_stop, merge_logprobs(parts), index, **extra)


async def _events(jobs: list[Job], firsts: list[Event]) -> AsyncIterator[tuple[int, Event]]:
    """Every job's events as they come, tagged with the job's index: the firsts, then the rest."""
    for i, event in enumerate(firsts):
        yield i, event
    pending = {i: asyncio.ensure_future(_next_event(job)) for i, (job, event) in enumerate(zip(jobs, firsts))
               if not isinstance(event, (Done, Failed))}
    try:
        while pending:
            done, _ = await asyncio.wait(pending.values(), return_when=asyncio.FIRST_COMPLETED)
            for i in sorted(i for i, f in pending.items() if f in done):
                event = pending.pop(i).result()
                yield i, event
                if not isinstance(event, (Done, Failed)):
                    pending[i] = asyncio.ensure_future(_next_event(jobs[i]))
    finally:
        for f in pending.values():
            f.cancel()


async def _stream(state: ServerState, jobs: list[Job], req: SamplingRequest, reply: Reply, firsts: list[Event],
                  watcher: asyncio.Task) -> AsyncIterator[str]:
    """SSE chunks of every choice, each chunk one choice (vLLM's shape for n > 1)."""
    timeout = state.config.request_timeout
    wanted = req.top_logprobs_wanted() is not None
    logprobs = [Logprobs(state.tokenizer, reply.chat) if wanted else None for _ in jobs]
    ids = (lambda t: {"token_ids": t}) if req.return_token_ids else (lambda t: {})
    finished: dict[int, Done] = {}
    try:
        for i, job in enumerate(jobs):
            async for chunk in _stream_head(state, req, reply, i, job, firsts[i], logprobs[i]):
                yield chunk
        async for i, event in _events(jobs, firsts):
            if isinstance(event, Failed):  # headers are sent: report in the stream, as OpenAI-compatible servers do
                yield sse(_failure(event, timeout).body())
                break
            if isinstance(event, Done):
                finished[i] = event
                chunks = [reply.chunk(None, event.finish_reason, matched_stop=event.matched_stop, index=i)]
                if len(finished) == len(jobs):
                    chunks += _stream_tail(state, reply, [finished[j] for j in range(len(jobs))], chunks[0])
                for chunk in chunks:
                    yield sse(chunk)
                continue
            # A step may hold back text (a partial UTF-8 character, a possible stop string): nothing to send yet,
            # unless its tokens' logprobs or ids are asked for.
            if event.text or ((wanted or req.return_token_ids) and event.token_ids):
                lp = logprobs[i]
                rendered = await state.tokenize(lp.render, event.token_ids, event.logprobs) if lp else None
                yield sse(reply.chunk(event.text, logprobs=rendered, index=i, **ids(event.token_ids)))
        yield sse("[DONE]")
    finally:  # runs on normal end, on client disconnect (task cancelled) and on shutdown
        watcher.cancel()
        for job in jobs:
            job.cancel()


async def _stream_head(state: ServerState, req: SamplingRequest, reply: Reply, index: int, job: Job, first: Event,
                       logprobs: Logprobs | None) -> AsyncIterator[str]:
    """What opens a choice's stream: chat's role chunk (with the prompt's ids) and its echo, or the completions
    echo of the prompt."""
    if reply.chat:
        top = {"prompt_token_ids": job.prompt} if req.return_token_ids else {}
        chunk = reply.chunk("", role=True, index=index)
        yield sse({**chunk, **top})
        if req.echoed:
            yield sse(reply.chunk(req.echoed, index=index))
        return
    extra = {"prompt_token_ids": job.prompt} if req.return_token_ids else {}
    if req.echo:
        head = "" if req.return_token_ids else await state.tokenize(state.tokenizer.decode, job.prompt)
        scored = (await state.tokenize(logprobs.render, job.prompt, first.prompt_logprobs)
                  if logprobs and first.prompt_logprobs is not None else None)
        yield sse(reply.chunk(head, logprobs=scored, index=index, **extra))
    elif extra:
        yield sse(reply.chunk("", index=index, **extra))


def _stream_tail(state: ServerState, reply: Reply, done: list[Done], last: dict[str, Any]) -> list[dict[str, Any]]:
    """After the `last` finish chunk: the usage chunk (with include_usage). The `ddscope` extension rides on
    whichever ends the stream."""
    stats = [d.stats for d in done]
    tail = []
    if reply.include_usage:
        metrics = per_request_metrics([d.records for d in done], state.config.spec_decode_metrics,
                                      state.config.per_request_metrics)
        tail.append(reply.usage_chunk(stats, metrics))
    (tail or [last])[-1]["ddscope"] = stats[0] if len(stats) == 1 else stats
    return tail


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
