"""A generation over the engine worker: submit each choice, wait for or stream its events, watch for a
disconnect, pick `best_of`, and map the worker's failures to API errors."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ddscope.models.target import KVCacheFull
from ddscope.server.constraints import constraint_of, tool_constraint
from ddscope.server.requests import engine_request
from ddscope.server.responses import Logprobs, Reply, merge_logprobs, per_request_metrics, prompt_logprobs, sse
from ddscope.server.schemas import APIError, ChatCompletionRequest, SamplingRequest
from ddscope.server.state import ServerState
from ddscope.server.tools import choice_of, parser_of
from ddscope.structured.backend import Compiled
from ddscope.structured.constraint import ConstraintError
from ddscope.structured.tool_parsers import ToolParser
from ddscope.server.worker import (Done, EngineWorker, Event, Failed, InvalidRequest, Job, QueueFull, ShuttingDown,
                                   WorkerDied)


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


async def _constrain(state: ServerState, req: SamplingRequest) -> tuple[Compiled | None, ToolParser | None]:
    """The request's constraint, compiled now (off the event loop, and not on the engine's thread), and the parser
    of its tool calls; a 400 naming the field where it is malformed or does not compile in time."""
    surface = state.config.surface
    chat = isinstance(req, ChatCompletionRequest)
    parser = parser_of(req, choice_of(req, surface.tool_parser), surface.tool_parser) if chat else None
    field, constraint = constraint_of(req, surface.structured_outputs) or (None, None)  # checked either way

    backend = req.guided_decoding_backend or surface.structured_outputs.backend

    def compile() -> Compiled | None:
        nonlocal field
        c = constraint
        if parser is not None and parser.choice.forced:
            # The forced call is the turn: it wins over response_format, which shapes content (a call has none), as
            # vLLM answers the requests openai-agents sends with both.
            field, c = "tools", tool_constraint(parser, surface.structured_outputs)
        return state.engine.grammars.compile(c, backend) if c is not None else None

    try:
        return await asyncio.to_thread(compile), parser
    except ConstraintError as e:
        raise APIError(400, f"{field}: {e}", param=field, code="invalid_constraint") from None


async def generate(request: Request, state: ServerState, req: SamplingRequest, prompts: list[list[int]],
                    reply: Reply, arrival: float) -> Response:
    constraint, reply.tool = await _constrain(state, req)
    reply.shared = req.n
    requests = [engine_request(state, req, len(ids), constraint) for ids in prompts]  # all checked before any runs
    k = req.choices  # sequences per prompt: choice p * k + c is prompt p's c-th
    many = len(prompts) * k > 1
    jobs = [Job(f"{reply.id}-{p * k + c}" if many else reply.id, ids, r.child(c),
                deadline=arrival + state.config.request_timeout, return_rounds=req.return_rounds,
                stream=bool(req.stream), arrival=arrival)
            for p, (ids, r) in enumerate(zip(prompts, requests)) for c in range(k)]
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
    tools = [reply.tool.stream() if reply.tool and reply.chat else None for _ in jobs]
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
                reason = event.finish_reason
                if tools[i] is not None:
                    deltas, called = tools[i].finish()
                    for delta in deltas:
                        yield sse(reply.chunk(None, delta=delta, index=i))
                    reason = "tool_calls" if called and reason == "stop" else reason
                chunks = [reply.chunk(None, reason, matched_stop=event.matched_stop, index=i)]
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
                if tools[i] is not None:
                    for delta in tools[i].feed(event.text):
                        yield sse(reply.chunk(None, delta=delta, logprobs=rendered, index=i, **ids(event.token_ids)))
                    continue
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
