"""The batching path under faults and pressure (issue 41's audit): a step is all or nothing per sequence, a dead
worker leaves nothing in the engine, usage after preemption counts only what the first admission found, a
resumed scored request scores nothing again, a long prompt holds back neither admission nor drafting, and a
queue of transformers-backend requests holds no caches. After each, the pool's blocks all come back."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.engine import Engine
from ddscope.engine.request import Request
from ddscope.server.metrics import ServerMetrics
from ddscope.server.worker import EngineWorker, Failed, Job
from ddscope.speculative.decoder import Decoder
from support.pool_check import assert_pool_empty

JOBS = [("def add(a, b):", dict(method="ddtree", budget=16, max_new_tokens=40, ignore_eos=True)),
        ("class Stack:\n    def", dict(method="dflash", max_new_tokens=40, ignore_eos=True)),
        ("for i in range(10):", dict(method="ddtree", budget=8, max_new_tokens=40, ignore_eos=True, temperature=0.8,
                                     seed=3))]


@pytest.fixture(scope="module")
def oracle(tiny_engine):
    return oracle_engine(tiny_engine, accuracy=0.8)


def drain(engine: Engine, seqs: list, limit: int = 2000) -> dict[int, list[int]]:
    out = {s.id: [] for s in seqs}
    for _ in range(limit):
        for s in seqs:
            while s.outbox:
                out[s.id] += s.outbox.popleft().token_ids
        if not engine.busy:
            return out
        try:
            engine.step()
        except RuntimeError:
            for s in seqs:  # what a stream's follow() does: only its own sequence leaves
                if s.decoder.commit.__name__ == "boom":
                    engine.abort(s)
    raise AssertionError("the engine did not finish")


def running(engine: Engine, steps: int) -> tuple[list[list[int]], list]:
    """JOBS' outputs alone, then JOBS added to `engine` together and `steps` steps into their decoding."""
    alone = [engine.generate(p, **kw).token_ids for p, kw in JOBS]
    seqs = [engine.sequence(p, **kw) for p, kw in JOBS]
    for s in seqs:
        engine.add(s)
    for _ in range(steps):
        engine.step()
    return alone, seqs


def test_a_failed_commit_fails_its_sequence_alone(oracle):
    alone, seqs = running(oracle, 4)
    bad = seqs[1]
    calls = [0]

    def boom(tree, out):  # the verify ran: every cache advanced; this commit fails
        calls[0] += 1
        raise RuntimeError("commit failed")

    bad.decoder.commit = boom
    got = drain(oracle, seqs)
    assert calls[0] >= 1
    for s, want in zip(seqs, alone):
        if s is not bad:
            assert got[s.id] == want, "a neighbour's failure shifted this sequence's cache"
    assert bad.error is not None and bad.finished
    assert_pool_empty(oracle)


def test_a_failed_forward_rewinds_every_cache(oracle, monkeypatch):
    alone, seqs = running(oracle, 3)
    target = oracle.runner.target
    real = target.forward_many

    def fails_late(segments, capture=()):  # every segment's K/V written and its length advanced, then a failure
        real(segments, capture)
        raise RuntimeError("forward failed")

    monkeypatch.setattr(target, "forward_many", fails_late)
    with pytest.raises(RuntimeError, match="forward failed"):
        oracle.step()
    monkeypatch.setattr(target, "forward_many", real)
    got = drain(oracle, seqs)
    assert [got[s.id] for s in seqs] == alone
    assert_pool_empty(oracle)


def submitted(engine: Engine) -> tuple[EngineWorker, list[Job]]:
    """A worker on `engine` running JOBS, long enough to be caught mid-generation (call inside a running loop)."""
    worker = EngineWorker(engine, ServerMetrics().bind("m"), max_queue=8, log_interval=3600)
    jobs = [Job(f"r{i}", engine.encode(p), Request(**dict(kw, max_new_tokens=400)), deadline=time.monotonic() + 60)
            for i, (p, kw) in enumerate(JOBS)]
    for j in jobs:
        worker.submit(j)
    return worker, jobs


def test_a_dead_worker_leaves_nothing_in_the_engine(oracle):
    async def run() -> list:
        worker, jobs = submitted(oracle)
        steps = [0]

        def dies(*_: object) -> None:  # a bug outside any one request: the thread dies mid-generation
            steps[0] += 1
            if steps[0] == 3:
                raise RuntimeError("worker bug")

        worker._window.maybe_log = dies
        outcomes = [await asyncio.wait_for(j.events.get(), 60) for j in jobs]
        worker.close()
        return outcomes

    outcomes = asyncio.run(run())
    assert all(isinstance(o, Failed) and o.status == "error" for o in outcomes)
    assert_pool_empty(oracle)


def test_a_closed_worker_leaves_nothing_in_the_engine(oracle):
    async def run() -> None:
        worker, _ = submitted(oracle)
        await asyncio.sleep(0.2)
        await asyncio.to_thread(worker.close)

    asyncio.run(run())
    assert_pool_empty(oracle)


def test_cached_tokens_count_the_first_admission_only(tiny_engine):
    engine = Engine(tiny_engine.target, tiny_engine.drafter, tiny_engine.tokenizer, Path(tiny_engine.source),
                    max_model_len=tiny_engine.max_model_len, max_prefill_tokens=128)
    prompt = [10 + (7 * i) % 300 for i in range(300)]
    seq = engine.sequence(prompt, method="ddtree", budget=8, max_new_tokens=8, ignore_eos=True)
    engine.add(seq)
    engine.step()  # 128 of 300 prefilled
    assert seq.decoder.cache.length == 128
    engine.scheduler.preempt(seq)  # its 128 tokens' blocks are registered as it leaves
    drain(engine, [seq])
    assert seq.stats.cached_tokens == 0  # it found them itself: no other request's prefix was reused
    assert_pool_empty(engine)


def test_a_resumed_scored_request_scores_nothing_again(tiny_engine, monkeypatch):
    engine = Engine(tiny_engine.target, tiny_engine.drafter, tiny_engine.tokenizer, Path(tiny_engine.source),
                    max_model_len=tiny_engine.max_model_len)
    want = engine.generate("def add(a, b):", method="ddtree", budget=8, max_new_tokens=24, ignore_eos=True,
                           logprobs=1, prompt_logprobs=1)
    seq = engine.sequence("def add(a, b):", method="ddtree", budget=8, max_new_tokens=24, ignore_eos=True,
                          logprobs=1, prompt_logprobs=1)
    engine.add(seq)
    for _ in range(3):
        engine.step()
    assert seq.started
    engine.scheduler.preempt(seq)
    scored = []
    real = Decoder.prefill_segment
    monkeypatch.setattr(Decoder, "prefill_segment",
                        lambda self, n, s=False: scored.append(s) or real(self, n, s))
    steps = []
    for _ in range(200):
        steps += list(seq.outbox)
        seq.outbox.clear()
        if not engine.busy:
            break
        engine.step()
    assert scored and not any(scored), "the resumed prefill scored the prompt again (full-vocab logits)"
    assert seq.completion.count == len(want.token_ids)
    assert_pool_empty(engine)


def test_a_long_prompt_holds_back_neither_a_short_one_nor_drafting(tiny_engine):
    engine = Engine(tiny_engine.target, tiny_engine.drafter, tiny_engine.tokenizer, Path(tiny_engine.source),
                    max_model_len=tiny_engine.max_model_len, max_prefill_tokens=64)
    decoding = engine.sequence("def add(a, b):", method="ddtree", budget="auto", max_new_tokens=200,
                               ignore_eos=True)
    engine.add(decoding)
    while not decoding.started:
        engine.step()
    long = engine.sequence([10 + (11 * i) % 300 for i in range(1200)], method="ar", max_new_tokens=4, ignore_eos=True)
    short = engine.sequence("x = 1\n", method="ar", max_new_tokens=4, ignore_eos=True)
    engine.add(long)
    engine.step()
    engine.add(short)
    steps = 0
    while not short.started:
        engine.step()
        steps += 1
    assert steps <= 2 and long.decoder.prefilling, "the short prompt waited behind the long one's prefill"
    before = len(decoding.stats.rounds)
    while long.decoder.prefilling:
        engine.step()
    middle = decoding.stats.rounds[before:-1]
    assert middle and any(r.drafted for r in middle), "auto decoded undrafted beside a long prompt's middle"
    engine.abort(decoding)
    drain(engine, [long, short])
    assert_pool_empty(engine)


def test_a_transformers_queue_holds_no_caches(tiny_pair):
    engine = Engine.load(*tiny_pair, target_backend="transformers")
    seqs = [engine.sequence(p, method="ddtree", budget=8, max_new_tokens=6, ignore_eos=True)
            for p in ("def add(a, b):", "x = 1", "for i in", "class A:")]
    for s in seqs:
        engine.add(s)
    assert all(s.decoder.cache is None for s in seqs), "a queued request allocated its caches"
    engine.step()
    assert sum(s.decoder.cache is not None for s in seqs) == 1  # one runs at a time on this backend
    drain(engine, seqs)
    assert all(s.decoder.cache is None and s.finished for s in seqs), "a finished request kept its caches"
