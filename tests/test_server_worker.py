"""The engine worker stops a cancelled job within one more verify step, counted in steps, never in seconds:
a cancel that lands while step k is made ends the job after step k or k + 1, and so does a shutdown."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from ddscope.engine import Step
from ddscope.engine.request import Request
from ddscope.server.metrics import ServerMetrics
from ddscope.server.worker import EngineWorker, Failed, Job, ShuttingDown
from ddscope.speculative.stats import GenerationStats, RoundStats

WAIT_S = 60  # generous: only a hang reaches it


class SteppingEngine:
    """The engine's batch interface over one endless sequence of one-token steps, counting the steps and
    running `hook` while it makes step `hook_at`."""

    waiting, kv_usage, preemptions, max_drafts = 0, 0.0, 0, 15

    def __init__(self, hook_at: int):
        self.hook_at, self.hook, self.steps, self.closed = hook_at, lambda: None, 0, False
        self.seq: SimpleNamespace | None = None

    def sequence(self, prompt: list[int], request: Request) -> SimpleNamespace:
        return SimpleNamespace(outbox=deque(), started=False, preemptions=0, error=None,
                               stats=GenerationStats(method="ar", budget=None, prompt_tokens=1))

    def add(self, seq: SimpleNamespace) -> None:
        self.seq = seq

    def abort(self, seq: SimpleNamespace) -> None:
        self.closed = True

    def step(self) -> SimpleNamespace:
        self.steps += 1
        if self.steps == self.hook_at:
            self.hook()
        # the first token is the prefill's, without a verify step
        rnd = None if self.steps == 1 else RoundStats(ctx_len=self.steps, nodes=0, committed=1)
        self.seq.outbox.append(Step([0], "x", rnd, self.seq.stats))
        return SimpleNamespace(sequences=1, decodes=1, draft_ms=0.0, tree_ms=0.0, verify_ms=0.0, commit_ms=0.0)


@dataclass
class SignallingJob(Job):
    """A Job that says when it has been cancelled."""
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self, reason: str = "cancelled") -> None:
        super().cancel(reason)
        self.cancelled.set()


def job() -> SignallingJob:
    return SignallingJob("req", [1], Request(), deadline=time.monotonic() + 3600)  # a deadline no test reaches


def worker_for(engine: SteppingEngine) -> EngineWorker:
    return EngineWorker(engine, ServerMetrics().bind("m"), max_queue=1, log_interval=3600)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_job_cancelled_at_step_k_runs_at_most_one_more(k):
    engine = SteppingEngine(hook_at=k)

    async def run() -> object:
        worker, j = worker_for(engine), job()
        engine.hook = j.cancel
        worker.submit(j)
        try:
            return await asyncio.wait_for(j.events.get(), WAIT_S)  # not streamed: the outcome alone
        finally:
            worker.close()

    outcome = asyncio.run(run())
    assert isinstance(outcome, Failed) and outcome.status == "cancelled" and outcome.error is None
    assert k <= engine.steps <= k + 1
    assert engine.closed


def test_shutdown_stops_the_job_in_flight_within_one_more_step():
    k = 3
    engine = SteppingEngine(hook_at=k)
    reached = threading.Event()

    async def run() -> object:
        worker, j = worker_for(engine), job()

        def hold() -> None:  # step k is still being made when the server shuts down
            reached.set()
            assert j.cancelled.wait(WAIT_S)

        engine.hook = hold
        worker.submit(j)
        assert await asyncio.to_thread(reached.wait, WAIT_S)
        await asyncio.to_thread(worker.close, 0.0, WAIT_S)
        with pytest.raises(ShuttingDown):
            worker.submit(job())
        return await asyncio.wait_for(j.events.get(), WAIT_S)

    outcome = asyncio.run(run())
    assert isinstance(outcome, Failed) and outcome.status == "cancelled"
    assert isinstance(outcome.error, ShuttingDown)
    assert k <= engine.steps <= k + 1
    assert engine.closed
