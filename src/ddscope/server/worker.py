"""The single engine thread: a bounded FIFO of jobs, run one at a time (batch 1).

The event loop never touches the engine. A handler submits a Job and awaits its events; the
worker pushes each committed step to the job's asyncio queue with call_soon_threadsafe. A job
is cancelled by setting a flag, which the worker checks between verify steps and then closes
the engine's stream, so a disconnect or timeout costs at most one more step; a job cancelled
while it waits leaves the queue at once, so its slot goes to the next client.

If the thread itself dies (a bug outside one request's generation), every job in flight and in
the queue fails at once, and `dead` turns /health to 503.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from ddscope.model import KVCacheFull
from ddscope.sampling import TokenLogprob
from ddscope.server.metrics import PHASES, ModelMetrics

if TYPE_CHECKING:
    from ddscope.engine import Engine, Step

log = logging.getLogger("ddscope.server")


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class WorkerDied(RuntimeError):
    pass


class InvalidRequest(ValueError):
    """The engine refused the request's parameters before generating: the client's fault (400)."""


@dataclass
class Done:
    """Last event of a finished generation."""
    finish_reason: str
    stats: dict[str, Any]  # GenerationStats.to_dict() plus the server's queue_ms and ttft_ms
    text: str = ""  # the whole completion (a non-streaming job gets no per-step events)
    matched_stop: int | str | None = None  # Step.matched_stop of the last step
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # when asked for: one per token of token_ids
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for (echo)


@dataclass
class Failed:
    """Last event of a generation that did not finish: status is error, cancelled or timeout."""
    status: str
    error: BaseException | None = None


Event = Union["Step", Done, Failed]  # what a job's queue carries: steps, then one Done or Failed


@dataclass
class Job:
    request_id: str
    prompt: list[int]
    params: dict[str, Any]  # Engine.stream keyword arguments
    deadline: float  # time.monotonic() after which the job times out
    return_rounds: bool = False
    stream: bool = False  # per-step events wake the event loop, which costs engine time: only when asked
    arrival: float = field(default_factory=time.monotonic)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancel_reason: str | None = None  # "cancelled" | "timeout", set once by whoever cancels first
    _cancel_lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self, reason: str = "cancelled") -> None:
        with self._cancel_lock:
            self.cancel_reason = self.cancel_reason or reason

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed (server stopped); nobody is listening
            pass


class DecodeWindow:
    """Counts verify steps and tokens, and logs a windowed decode line every `interval` seconds of activity."""

    def __init__(self, interval: float):
        self.interval = interval
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.start, self.steps, self.committed, self.tokens = now, 0, 0, 0

    def record(self, tokens: int, verified: bool) -> None:
        """`tokens` completion tokens, committed by a verify step unless they are a prefill's first token."""
        self.tokens += tokens
        if verified:
            self.steps += 1
            self.committed += tokens

    def maybe_log(self, running: bool, waiting: int) -> None:
        now = time.monotonic()
        elapsed = now - self.start
        if elapsed < self.interval:
            return
        if self.tokens:
            log.info("decode window_s=%.1f steps=%d avg_commit=%.3f gen_tok_s=%.1f running=%d waiting=%d",
                     elapsed, self.steps, self.committed / self.steps if self.steps else 0.0,
                     self.tokens / elapsed, running, waiting)
        self._reset(now)


class EngineWorker:
    def __init__(self, engine: Engine, metrics: ModelMetrics, *, max_queue: int, log_interval: float):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._queue: deque[Job] = deque()
        self._ready = threading.Condition()  # guards _queue, _closing, _stopped, _current and dead
        self._window = DecodeWindow(log_interval)
        self._closing = False  # new jobs are refused
        self._stopped = False  # and no more are run
        self._current: Job | None = None
        self.dead: BaseException | None = None  # why the thread died, once it has
        self._thread = threading.Thread(target=self._loop, name="ddscope-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, job: Job) -> None:
        with self._ready:
            if self.dead is not None:
                raise WorkerDied(f"the engine worker died ({type(self.dead).__name__}); see the server log")
            if self._closing:
                raise ShuttingDown("server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting requests)")
            self._queue.append(job)
            self.metrics.waiting.inc()
            self._ready.notify_all()

    def withdraw(self, job: Job) -> None:
        """A job given up on while it waits leaves the queue now, freeing its slot; a running one stops
        at the next step (it is cancelled already)."""
        with self._ready:
            try:
                self._queue.remove(job)
            except ValueError:
                return
            self.metrics.waiting.dec()
        self._finish(job, Failed(job.cancel_reason or "cancelled"))

    def close(self, grace: float | None = 0.0, timeout: float = 30.0) -> None:
        """Refuse new jobs, give those running and waiting `grace` seconds to finish, then stop them (503 to
        their clients) and the thread."""
        with self._ready:
            self._closing = True
            self._ready.wait_for(lambda: not self._queue and self._current is None, timeout=grace)
            self._stopped = True
            current, waiting = self._current, list(self._queue)
            self._queue.clear()
            self.metrics.waiting.dec(len(waiting))
            self._ready.notify_all()
        if current is not None:
            current.cancel()
        for job in waiting:
            job.cancel()
            self._finish(job, Failed("cancelled", ShuttingDown("server is shutting down")))
        self._thread.join(timeout)

    def _next(self) -> Job | None:
        with self._ready:
            while not self._queue and not self._stopped:
                if not self._ready.wait(timeout=self._window.interval):
                    self._window.maybe_log(False, 0)
            if self._stopped:
                return None
            self.metrics.waiting.dec()
            self._current = self._queue.popleft()
            return self._current

    def _loop(self) -> None:
        try:
            while (job := self._next()) is not None:
                self._run(job)
        except BaseException as e:  # a bug outside any one generation: no request would ever be served
            self._die(e)

    def _die(self, error: BaseException) -> None:
        log.critical("the engine worker died; failing every request in flight and in the queue", exc_info=error)
        with self._ready:
            self.dead, self._stopped = error, True
            jobs = ([self._current] if self._current is not None else []) + list(self._queue)
            self.metrics.waiting.dec(len(self._queue))
            self._queue.clear()
            self._current = None
            self._ready.notify_all()  # a closing server need not wait for its grace period
        for job in jobs:
            outcome = Failed("error", WorkerDied(f"the engine worker died: {error!r}"))
            try:
                self._finish(job, outcome)
            except Exception:  # what killed the thread may be in _finish itself: the client still hears
                job.emit(outcome)

    def _run(self, job: Job) -> None:
        """Run one job to its outcome; the job stays `_current` until its client has been told (a death
        before that still answers it, in _die)."""
        if time.monotonic() > job.deadline:
            job.cancel("timeout")
        if job.cancel_reason:  # given up on while it waited, or stopped by close() before it ran
            outcome: Done | Failed = Failed(job.cancel_reason, self._shutdown_error())
        else:
            self.metrics.running.inc()
            try:
                outcome = self._generate(job, time.monotonic())
            except Exception as e:  # a bug in the bookkeeping around the engine: this request fails, not the worker
                log.exception("request %s failed outside the engine", job.request_id)
                outcome = Failed("error", e)
            finally:  # update the gauge before the client can see the answer
                self.metrics.running.dec()
        try:
            self._finish(job, outcome)
        except Exception:  # its bookkeeping failed: the client is still told, and the worker goes on
            log.exception("request %s: finishing failed", job.request_id)
            job.emit(outcome)
        with self._ready:
            self._current = None
            self._ready.notify_all()  # a closing server may be waiting for this

    def _shutdown_error(self) -> ShuttingDown | None:
        return ShuttingDown("server is shutting down") if self._stopped else None

    def _generate(self, job: Job, start: float) -> Done | Failed:
        try:
            steps = self.engine.stream(job.prompt, **job.params)
        except ValueError as e:  # invalid input the app did not catch: still the client's fault
            return Failed("error", InvalidRequest(str(e)))
        except Exception as e:  # the engine failed before generating: ours, not the client's
            log.exception("engine failed on request %s", job.request_id)
            return Failed("error", e)
        self.metrics.prompt_tokens.inc(len(job.prompt))
        first_at: float | None = None
        last = None
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] | None = None
        prompt_logprobs = None
        try:
            for last in steps:
                now = time.monotonic()
                if first_at is None:
                    first_at = now
                    self.metrics.ttft.observe(now - job.arrival)
                    self.metrics.cached_prompt_tokens.inc(last.stats.cached_tokens)
                    prompt_logprobs = last.prompt_logprobs
                self._record_step(last)
                text.append(last.text)
                ids += last.token_ids
                if last.logprobs is not None and not job.stream:  # a stream's steps carry their own
                    logprobs = logprobs or []
                    logprobs += last.logprobs
                if job.stream:
                    job.emit(last)
                if last.finish_reason:
                    break
                if now > job.deadline:
                    job.cancel("timeout")
                if job.cancel_reason:
                    return Failed(job.cancel_reason, self._shutdown_error())
        except KVCacheFull as e:  # capacity, not a bug: the client may retry
            log.warning("request %s: %s", job.request_id, e)
            return Failed("error", e)
        except Exception as e:  # an engine bug must not kill the worker
            log.exception("engine failed on request %s", job.request_id)
            return Failed("error", e)
        finally:
            steps.close()
            self._window.maybe_log(True, self.waiting)
        stats = last.stats.to_dict(rounds=job.return_rounds)
        stats["queue_ms"] = 1000 * (start - job.arrival)
        stats["ttft_ms"] = 1000 * (first_at - job.arrival)
        return Done(last.finish_reason, stats, "".join(text), last.matched_stop, ids, logprobs, prompt_logprobs)

    def _record_step(self, step: Step) -> None:
        n, rnd = len(step.token_ids), step.round
        self.metrics.generation_tokens.inc(n)
        self._window.record(n, verified=rnd is not None)
        if rnd is None:  # the prefill's first token: no verify step
            return
        self.metrics.verify_steps.inc()
        self.metrics.committed_tokens.inc(n)
        self.metrics.draft_nodes.inc(rnd.nodes)
        self.metrics.commit_length.observe(n)
        for phase in PHASES:
            self.metrics.step_phase[phase].observe(getattr(rnd, f"{phase}_ms") / 1000)

    def _finish(self, job: Job, outcome: Done | Failed) -> None:
        now = time.monotonic()
        status = outcome.status if isinstance(outcome, Failed) else "finished"
        self.metrics.requests[status].inc()
        fields = f"request id={job.request_id} status={status} prompt_tokens={len(job.prompt)}"
        if isinstance(outcome, Done):
            self.metrics.e2e.observe(now - job.arrival)
            s = outcome.stats
            fields += (f" completion_tokens={s['completion_tokens']} method={s['method']} budget={s['budget']}"
                       f" verify_steps={s['verify_steps']} avg_commit={s['avg_commit']:.3f}"
                       f" tok_s={s['decode_tok_per_s']:.1f} queue_ms={s['queue_ms']:.1f} ttft_ms={s['ttft_ms']:.1f}"
                       f" finish_reason={outcome.finish_reason}")
        elif outcome.error is not None:
            fields += f" error={type(outcome.error).__name__}"
        log.info("%s e2e_ms=%.1f", fields, 1000 * (now - job.arrival))
        job.emit(outcome)
