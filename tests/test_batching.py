"""Continuous batching is lossless: every response equals the same request run alone, whatever else is in
the batch, when it joins, whether its prefill is chunked and whether it is preempted and recomputed.
Drafters here are really accepted (the demo pair, the oracle), and that is asserted too."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.engine import Engine
from ddscope.models.kv_pool import KVPool, Pages
from ddscope.models.kv_pool import KVCache
from ddscope.models.target import Segment
from support.pool_check import assert_pool_empty
from support.tolerance import assert_same_sums, sums_depth

REQUESTS = [  # (prompt, kwargs): different lengths, methods, samplers and stops
    ("def add(a, b):", dict(method="ddtree", max_new_tokens=40, ignore_eos=True)),
    ("import os\nimport sys\n" * 20, dict(method="dflash", max_new_tokens=56, ignore_eos=True)),
    ("class Stack:\n    def", dict(method="ddtree", budget="auto", max_new_tokens=64, ignore_eos=True)),
    ("# sort a list\n" * 60, dict(method="ddtree", max_new_tokens=32, temperature=0.8, seed=7, ignore_eos=True)),
    ("x = 1\n", dict(method="ar", max_new_tokens=24, ignore_eos=True)),
    ("def main():\n", dict(method="ddtree", max_new_tokens=48, stop=["\n\n"], logprobs=2)),
    ("for i in range(10):", dict(method="dflash", max_new_tokens=40, temperature=0.8, seed=3, ignore_eos=True)),
    ("print('hi')\n" * 30, dict(method="ddtree", budget=8, max_new_tokens=48, min_tokens=4)),
]


def _alone(engine: Engine, requests: list[tuple[str, dict]] = REQUESTS) -> list[dict]:
    return [_summary(engine.generate(p, **kw)) for p, kw in requests]


def _summary(g) -> dict:
    return dict(ids=g.token_ids, text=g.text, finish=g.finish_reason, usage=(g.prompt_tokens, len(g.token_ids)),
                logprobs=_rounded(g.logprobs))


def _rounded(logprobs: list | None) -> list | None:
    """Log-probs to 4 places: a batch computes the same rows among others' (last-bit differences)."""
    return [(round(lp, 4), [(t, round(x, 4)) for t, x in top]) for lp, top, _ in logprobs] if logprobs else None


def _together(engine: Engine, join_every: int = 2, requests: list[tuple[str, dict]] = REQUESTS
              ) -> tuple[list[dict], list]:
    """All of `requests` through one engine, one joining every `join_every` steps while the others decode;
    returns their summaries and the steps' reports."""
    seqs = [engine.sequence(p, **kw) for p, kw in requests]
    steps: dict[int, list] = {s.id: [] for s in seqs}
    reports, pending = [], list(seqs)
    for n in range(10_000):
        if pending and n % join_every == 0:
            engine.add(pending.pop(0))
        if not engine.busy and not pending:
            break
        if engine.busy:
            reports.append(engine.step())
        for s in seqs:
            while s.outbox:
                steps[s.id].append(s.outbox.popleft())
    return [_from_steps(steps[s.id]) for s in seqs], reports


def _from_steps(steps: list) -> dict:
    ids = [t for s in steps for t in s.token_ids]
    lps = [lp for s in steps for lp in s.logprobs] if steps[-1].logprobs is not None else None
    return dict(ids=ids, text="".join(s.text for s in steps), finish=steps[-1].finish_reason,
                usage=(steps[-1].stats.prompt_tokens, len(ids)),
                logprobs=_rounded(lps),
                avg_commit=steps[-1].stats.to_dict()["avg_commit"])


def _assert_equal(got: list[dict], want: list[dict]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert {k: g[k] for k in w} == w, REQUESTS[i]


def test_the_batched_forward_equals_each_sequence_alone(tiny_engine):
    """A prefill chunk over a cached head, a tree and a single token, in one forward over paged caches,
    give each sequence's own forward's logits and features."""
    target, g = tiny_engine.target, tiny_engine.target.cfg.geometry
    pool = KVPool(g, None, 0, 16, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    heads = [torch.randint(5, 200, (n,), generator=gen) for n in (70, 9, 130)]
    news = [torch.randint(5, 200, (n,), generator=gen) for n in (20, 6, 1)]
    masks = [None, torch.ones(6, 15, dtype=torch.bool).tril(9), None]
    alone, segs = [], []
    for i, (head, new, mask) in enumerate(zip(heads, news, masks)):
        ref = KVCache(g, 256, torch.device("cpu"), torch.float32)
        target(head, torch.arange(len(head)), ref)
        pos = torch.arange(len(head), len(head) + len(new))
        alone.append(target(new, pos, ref, mask, capture=(1, 2)))
        pages = Pages()
        pages.extend([15 - 3 * i - j for j in range(3)] if i != 1 else [2 * i + j for j in range(3)])
        cache = pool.target_cache(pages)
        target(head, torch.arange(len(head)), cache)
        segs.append(Segment(new, pos, cache, mask))
    outs = target.forward_many(segs, capture=(1, 2))
    depth = sums_depth(g, 256)
    for a, b in zip(alone, outs):
        assert_same_sums(b.logits, a.logits, depth)
        assert_same_sums(b.features, a.features, depth)


@pytest.fixture(scope="module")
def demo() -> Engine:
    return Engine.load(budget=32)  # trees of a fixed size: the pool tests below count on their rows


def test_eight_requests_joining_mid_flight_equal_their_isolated_runs(demo):
    want = _alone(demo)
    got, reports = _together(demo)
    _assert_equal(got, want)
    assert max(r.sequences for r in reports) >= 6  # they really ran together
    drafted = [g for g, (_, kw) in zip(got, REQUESTS) if kw["method"] != "ar" and "temperature" not in kw]
    assert min(g["avg_commit"] for g in drafted) > 1.5  # drafts were accepted


def test_oracle_drafters_in_a_batch_are_accepted_and_lossless(demo):
    oracle = oracle_engine(demo, accuracy=0.7)
    want = _alone(oracle)
    got, _ = _together(oracle, join_every=1)
    _assert_equal(got, want)
    assert sum(g["avg_commit"] for g in got) / len(got) > 3


def test_lookup_branches_win_rows_in_the_batchs_budget_and_change_nothing(demo, monkeypatch):
    """`auto` requests on text that repeats, together: the batch's budget gives prompt-lookup branches rows
    (a length above 0 chosen for some), and every output still equals its isolated run."""
    loops = [(text * reps, dict(method="ddtree", budget="auto", max_new_tokens=n, ignore_eos=True))
             for text, reps, n in (("print('hi')\n", 30, 48), ("x = 1\n", 40, 40),
                                   ("def f():\n    return 1\n", 20, 56), ("# sort a list\n", 60, 32))]
    want = _alone(demo, loops)
    chosen: list[list[int]] = []
    sizes = demo.runner.budget.sizes

    def spy(*args):
        out = sizes(*args)
        chosen.append(out[1])
        return out

    monkeypatch.setattr(demo.runner.budget, "sizes", spy)
    got, reports = _together(demo, join_every=1, requests=loops)
    _assert_equal(got, want)
    assert max(r.sequences for r in reports) == len(loops) and chosen
    assert any(n > 0 for lengths in chosen for n in lengths)
    assert min(g["avg_commit"] for g in got) > 1.5


def test_a_step_with_a_long_prefill_drafts_for_no_auto_sequence_and_changes_nothing(demo):
    """Three `auto` requests decode; a 600-token prompt joins. The step that prefills it verifies their roots
    (and lookup branches) undrafted, the steps after it draft again, and every output equals its run alone."""
    from ddscope.engine.runner import LEAN_PREFILL
    decoding = [(p, dict(method="ddtree", budget="auto", max_new_tokens=48, ignore_eos=True))
                for p in ("def add(a, b):", "class Stack:\n    def", "for i in range(10):")]
    long = demo.tokenizer.decode(demo.encode("import json\nimport re\n" * 200)[:600])  # no other test's head
    requests = decoding + [(long, dict(method="ddtree", budget="auto", max_new_tokens=16, ignore_eos=True))]
    seqs = [demo.sequence(p, **kw) for p, kw in requests]
    for s in seqs[:3]:
        demo.add(s)
    while any(s.decoder.prefilling or not s.stats.rounds for s in seqs[:3]):
        demo.step()
    demo.add(seqs[3])
    rounds = len(seqs[0].stats.rounds)
    report = demo.step()
    assert report.prefill_tokens >= LEAN_PREFILL and report.decodes == 3
    assert not any(s.stats.rounds[-1].drafted for s in seqs[:3])  # the lean step
    while demo.busy:
        demo.step()
    assert any(r.drafted for r in seqs[0].stats.rounds[rounds + 1:])  # drafting again after it
    got = [_from_steps(list(s.outbox)) for s in seqs]
    _assert_equal(got, _alone(demo, requests))  # after: the long prompt was not in the prefix cache above
    assert min(g["avg_commit"] for g in got[:3]) > 1.2 and sum(g["avg_commit"] for g in got[:3]) / 3 > 1.5  # accepted


def test_chunked_prefill_runs_beside_decoding_and_changes_nothing(demo):
    want = _alone(demo)
    chunked = Engine(demo.target, demo.drafter, demo.tokenizer, Path(demo.source), demo.config, max_prefill_tokens=64)
    got, reports = _together(chunked)
    _assert_equal(got, want)
    assert any(r.prefill_tokens == 64 and r.decodes for r in reports)  # a chunk beside decoding sequences


def test_a_pool_too_small_for_the_load_preempts_and_outputs_are_unchanged(demo):
    """A pool of one max-length sequence and a little more: sequences are preempted and recomputed, never
    dropped, and their outputs do not change."""
    want = _alone(demo)
    small = Engine(demo.target, demo.drafter, demo.tokenizer, Path(demo.source), demo.config, max_model_len=400,
                   kv_cache_mb=8)
    got, _ = _together(small, join_every=1)
    _assert_equal(got, want)
    assert small.scheduler.preemptions > 0
    assert_pool_empty(small)


def test_a_pool_smaller_than_one_sequence_is_refused(demo):
    with pytest.raises(ValueError, match="kv_cache_mb=1 holds"):
        Engine(demo.target, demo.drafter, demo.tokenizer, Path(demo.source), demo.config, max_model_len=4096,
               kv_cache_mb=1)
