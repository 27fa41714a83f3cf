"""The single engine thread: jobs join the engine's running batch as they arrive (continuous batching).

The event loop never touches the engine. A handler submits a Job and awaits its events; the worker
hands it to the engine as a sequence, steps the batch, and pushes each sequence's committed steps to its
job's asyncio queue with call_soon_threadsafe. The worker holds no decoding logic: the engine's
scheduler picks each step's batch. A job is cancelled by setting a flag, which the worker checks after
every step and then aborts the sequence, so a disconnect or timeout costs at most one more step; a job
cancelled before the worker took it leaves the queue at once, so its slot goes to the next client.

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

from ddscope.server.metrics import PHASES, ModelMetrics
from ddscope.server.responses import spec_decode_record, timing_record
from ddscope.speculative.sampling import TokenLogprob

if TYPE_CHECKING:
    from ddscope.engine import Engine, Step
    from ddscope.engine.request import Request

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
    records: dict[str, Any] = field(default_factory=dict)  # vLLM-shaped per-request records: "spec" and "timing"


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
    request: Request  # checked: what Engine.sequence runs
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
        self.start, self.steps, self.committed, self.tokens, self.busy_s = now, 0, 0, 0, 0.0

    def busy(self, seconds: float) -> None:
        """Time the engine spent stepping: tok/s is over this, not over idle time between requests."""
        self.busy_s += seconds

    def record(self, tokens: int, verified: bool) -> None:
        """`tokens` completion tokens, committed by a verify step unless they are a prefill's first token."""
        self.tokens += tokens
        if verified:
            self.steps += 1
            self.committed += tokens

    def maybe_log(self, running: int, waiting: int) -> None:
        now = time.monotonic()
        elapsed = now - self.start
        if elapsed < self.interval:
            return
        if self.tokens:
            log.info("decode window_s=%.1f steps=%d avg_commit=%.3f gen_tok_s=%.1f busy_s=%.1f running=%d waiting=%d",
                     elapsed, self.steps, self.committed / self.steps if self.steps else 0.0,
                     self.tokens / self.busy_s if self.busy_s else 0.0, self.busy_s, running, waiting)
        self._reset(now)


@dataclass
class Active:
    """A job the engine is running: its sequence and what its client has been sent so far."""
    job: Job
    seq: Any  # ddscope.engine.sequence.Sequence
    start: float  # when the worker handed it to the engine
    first_at: float | None = None
    step_at: float | None = None  # when its latest Step was handed out
    last: Any = None  # its latest Step
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class EngineWorker:
    def __init__(self, engine: Engine, metrics: ModelMetrics, *, max_queue: int, log_interval: float):
        self.engine = engine
        self._preemptions = engine.preemptions  # the count already in vllm:num_preemptions
        self.metrics = metrics
        self.max_queue = max_queue
        self._queue: deque[Job] = deque()  # submitted, not yet handed to the engine
        self._ready = threading.Condition()  # guards _queue, _closing, _stopped, _active and dead
        self._window = DecodeWindow(log_interval)
        self._closing = False  # new jobs are refused
        self._stopped = False  # and no more are run
        self._active: list[Active] = []
        self._engine_waiting = 0  # sequences the engine holds but has not admitted, as of the last step
        self.dead: BaseException | None = None  # why the thread died, once it has
        self._thread = threading.Thread(target=self._loop, name="ddscope-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._queue) + self._engine_waiting

    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, job: Job) -> None:
        with self._ready:
            if self.dead is not None:
                raise WorkerDied(f"the engine worker died ({type(self.dead).__name__}); see the server log")
            if self._closing:
                raise ShuttingDown("server is shutting down")
            if self.waiting >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting requests)")
            self._queue.append(job)
            self._set_gauges()
            self._ready.notify_all()

    def withdraw(self, job: Job) -> None:
        """A job given up on before the worker took it leaves the queue now, freeing its slot; a running one
        stops after the next step (it is cancelled already)."""
        with self._ready:
            try:
                self._queue.remove(job)
            except ValueError:
                return
            self._set_gauges()
        self._finish(job, Failed(job.cancel_reason or "cancelled"))

    def close(self, grace: float | None = 0.0, timeout: float = 30.0) -> None:
        """Refuse new jobs, give those running and waiting `grace` seconds to finish, then stop them (503 to
        their clients) and the thread."""
        with self._ready:
            self._closing = True
            self._ready.wait_for(lambda: not self._queue and not self._active, timeout=grace)
            self._stopped = True
            active, waiting = list(self._active), list(self._queue)
            self._queue.clear()
            self._ready.notify_all()
        for a in active:
            a.job.cancel()
        for job in waiting:
            job.cancel()
            self._finish(job, Failed("cancelled", ShuttingDown("server is shutting down")))
        self._thread.join(timeout)

    def _set_gauges(self) -> None:
        running = len(self._active) - self._engine_waiting
        self.metrics.running.set(max(running, 0))
        self.metrics.waiting.set(self.waiting)

    def _loop(self) -> None:
        try:
            while self._take():
                self._step()
            for a in list(self._active):  # stopped: whoever is still running is told, and leaves the engine
                self.engine.abort(a.seq)
                self._end(a, Failed(a.job.cancel_reason or "cancelled", self._shutdown_error()))
        except BaseException as e:  # a bug outside any one generation: no request would ever be served
            self._die(e)

    def _take(self) -> bool:
        """Hand the queued jobs to the engine, waiting for one while none runs; False once stopped."""
        with self._ready:
            while not self._queue and not self._active and not self._stopped:
                if not self._ready.wait(timeout=self._window.interval):
                    self._window.maybe_log(0, 0)
            if self._stopped:
                return False
            jobs = list(self._queue)
            self._queue.clear()
        for job in jobs:
            self._start(job)
        return True

    def _start(self, job: Job) -> None:
        now = time.monotonic()
        if now > job.deadline:
            job.cancel("timeout")
        if job.cancel_reason:  # given up on while it waited
            self._finish(job, Failed(job.cancel_reason, self._shutdown_error()))
            return
        try:
            seq = self.engine.sequence(job.prompt, job.request)
        except ValueError as e:  # invalid input the app did not catch: still the client's fault
            self._finish(job, Failed("error", InvalidRequest(str(e))))
            return
        except Exception as e:  # the engine failed before generating: ours, not the client's
            log.exception("engine failed on request %s", job.request_id)
            self._finish(job, Failed("error", e))
            return
        self.engine.add(seq)
        self.metrics.prompt_tokens.inc(len(job.prompt))
        with self._ready:
            self._active.append(Active(job, seq, now))
            self._engine_waiting += 1

    def _step(self) -> None:
        """One engine step; then each running job gets its new steps, or its end."""
        if not self._active:
            return
        began = time.monotonic()
        try:
            report = self.engine.step()
        except Exception as e:  # an engine bug fails the batch it hit, not the worker
            log.exception("engine step failed; failing the %d requests in it", len(self._active))
            for a in list(self._active):
                self.engine.abort(a.seq)
                self._end(a, Failed("error", e))
            return
        self._window.busy(time.monotonic() - began)
        self.metrics.batch_size.observe(report.sequences)
        self.metrics.engine_steps.inc()
        self.metrics.preemptions.inc(self.engine.preemptions - self._preemptions)
        self._preemptions = self.engine.preemptions
        self.metrics.kv_usage.set(self.engine.kv_usage)
        for phase in PHASES:
            if report.decodes:
                self.metrics.step_phase[phase].observe(getattr(report, f"{phase}_ms") / 1000)
        with self._ready:
            self._engine_waiting = self.engine.waiting
            self._set_gauges()
        now = time.monotonic()
        for a in list(self._active):
            try:
                outcome = self._drain(a, now)
            except Exception as e:  # a bug in the bookkeeping around the engine: this request fails, not the worker
                log.exception("request %s failed outside the engine", a.job.request_id)
                self.engine.abort(a.seq)
                outcome = Failed("error", e)
            if outcome is None and a.seq.error is not None:  # the step failed it alone; the engine let it go
                log.error("request %s failed in its commit", a.job.request_id, exc_info=a.seq.error)
                outcome = Failed("error", a.seq.error)
            if outcome is None:
                if now > a.job.deadline:
                    a.job.cancel("timeout")
                if a.job.cancel_reason:
                    self.engine.abort(a.seq)
                    outcome = Failed(a.job.cancel_reason, self._shutdown_error())
            if outcome is not None:
                self._end(a, outcome)
        self._window.maybe_log(len(self._active) - self._engine_waiting, self.waiting)

    def _drain(self, a: Active, now: float) -> Done | None:
        """Pass on the steps `a`'s sequence made; its Done once it finished."""
        job = a.job
        while a.seq.outbox:
            step = a.last = a.seq.outbox.popleft()
            if a.first_at is not None and a.step_at is not None:  # vLLM's inter-token latency: a step's gap
                self.metrics.itl.observe(now - a.step_at)
            a.step_at = now
            if a.first_at is None:
                a.first_at = now
                self.metrics.ttft.observe(now - job.arrival)
                self.metrics.cached_prompt_tokens.inc(step.stats.cached_tokens)
                a.prompt_logprobs = step.prompt_logprobs
            self._record_step(step)
            a.text.append(step.text)
            a.ids += step.token_ids
            if step.logprobs is not None and not job.stream:  # a stream's steps carry their own
                a.logprobs = (a.logprobs or []) + step.logprobs
            if job.stream:
                job.emit(step)
            if step.finish_reason:
                self.metrics.decode_time.observe(now - a.first_at)
                stats = step.stats.to_dict(rounds=job.return_rounds)
                stats["queue_ms"] = 1000 * (a.start - job.arrival)
                stats["ttft_ms"] = 1000 * (a.first_at - job.arrival)
                stats["preemptions"] = a.seq.preemptions
                records = {"spec": spec_decode_record(step.stats.rounds, self.engine.max_drafts),
                           "timing": timing_record(job.arrival, a.start, a.first_at, now, len(a.ids))}
                return Done(step.finish_reason, stats, "".join(a.text), step.matched_stop, a.ids, a.logprobs,
                            a.prompt_logprobs, records)
        return None

    def _end(self, a: Active, outcome: Done | Failed) -> None:
        """`a` leaves the worker; its client is told (a death before that still answers it, in _die)."""
        try:
            self._finish(a.job, outcome)
        except Exception:  # its bookkeeping failed: the client is still told, and the worker goes on
            log.exception("request %s: finishing failed", a.job.request_id)
            a.job.emit(outcome)
        with self._ready:
            if a in self._active:
                self._active.remove(a)
            self._engine_waiting = min(self._engine_waiting, len(self._active))
            self._set_gauges()
            self._ready.notify_all()  # a closing server may be waiting for this

    def _die(self, error: BaseException) -> None:
        log.critical("the engine worker died; failing every request in flight and in the queue", exc_info=error)
        with self._ready:
            self.dead, self._stopped = error, True
            for a in self._active:  # the engine may serve again (another worker): it holds none of them
                try:
                    self.engine.abort(a.seq)
                except Exception:
                    log.exception("request %s: could not leave the engine", a.job.request_id)
            jobs = [a.job for a in self._active] + list(self._queue)
            self._queue.clear()
            self._active.clear()
            self._engine_waiting = 0
            self._set_gauges()
            self._ready.notify_all()  # a closing server need not wait for its grace period
        for job in jobs:
            outcome = Failed("error", WorkerDied(f"the engine worker died: {error!r}"))
            try:
                self._finish(job, outcome)
            except Exception:  # what killed the thread may be in _finish itself: the client still hears
                job.emit(outcome)

    def _shutdown_error(self) -> ShuttingDown | None:
        return ShuttingDown("server is shutting down") if self._stopped else None

    def _record_step(self, step: Step) -> None:
        n, rnd = len(step.token_ids), step.round
        self.metrics.generation_tokens.inc(n)
        self._window.record(n, verified=rnd is not None)
        if rnd is None:  # the prefill's first token: no verify step
            return
        self.metrics.verify_steps.inc()
        self.metrics.committed_tokens.inc(n)
        self.metrics.draft_nodes.inc(rnd.nodes)
        self.metrics.grammar_masks.inc(rnd.grammar_masks)
        self.metrics.grammar_seconds.inc(rnd.grammar_ms / 1000)
        self.metrics.commit_length.observe(n)
        self.metrics.accepted_tokens.inc(n - 1)
        for position in range(n - 1):
            self.metrics.accepted_per_pos(position).inc()

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
