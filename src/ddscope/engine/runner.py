"""One step of the batch: every drafting sequence's block in one drafter pass, then each tree, then every
tree and prefill chunk in one target forward, then each sequence's commit. A step that prefills a long
chunk runs lean: its `auto` sequences verify their roots and prompt-lookup branches, undrafted. Phases are
timed for the whole step; each sequence's round reports the step it shared (its step time is the batch's)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ddscope.engine.scheduler import Batch
from ddscope.engine.sequence import Sequence
from ddscope.engine.threads import step_threads, torch_threads
from ddscope.models.drafter import Draft, Drafter
from ddscope.models.hf_target import TargetLike
from ddscope.policy.auto import AutoBudget
from ddscope.policy.batch import BatchBudget
from ddscope.speculative.decoder import Clock
from ddscope.speculative.stats import RoundStats
from ddscope.speculative.tree import DraftTree


@dataclass
class StepReport:
    """What one step did, for the server's metrics and logs."""
    sequences: int
    decodes: int
    prefill_tokens: int
    tokens: int  # rows in the target forward
    draft_ms: float
    tree_ms: float
    verify_ms: float
    commit_ms: float
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # each left with its cache rewound


# Prefill tokens from which a step drafts for no `auto` sequence: the new request's first token waits for the
# whole step, and beside a long chunk the drafts and trees cost more than they commit (docs/server.md, Lean
# prefill steps, measures it).
LEAN_PREFILL = 256


@dataclass
class _Plan:
    """A step before its forward: the drafts made, the trees sized and the segments to run."""
    t: list[float]  # clock at the start, after drafting, after planning
    shared: BatchBudget | None
    auto_drafts: bool
    drafted: set[Sequence]
    trees: list[DraftTree]
    chunks: list[Any]  # the prefill segments, in batch.prefills' order
    segments: list[Any]  # the chunks, then the trees'


@dataclass
class _Ran:
    """What a step's forward produced, for its commits."""
    plan: _Plan
    outs: list[Any]  # the forward's outputs, in plan.segments' order
    shape: list[tuple[int, int]]  # (rows, context) of each segment
    rows: int
    t3: float  # clock after the forward


class Runner:
    def __init__(self, target: TargetLike, drafter: Drafter | None, prefill_threads: int | None = None):
        self.target, self.drafter = target, drafter
        self.budget: BatchBudget | None = None  # sizes `auto` trees together once the verify cost is calibrated
        self.prefill_threads = prefill_threads  # for large steps; None: the idle CPUs at each (ddscope.engine.threads)
        self.clock = Clock(target.lm_head.weight.device)

    def step(self, batch: Batch) -> StepReport:
        new_tokens = sum(n for _, n in batch.prefills)
        threads = step_threads(new_tokens, batch.size, self.prefill_threads)
        with torch_threads(threads):
            return self._step(batch, new_tokens, threads)

    def _step(self, batch: Batch, new_tokens: int, threads: int) -> StepReport:
        """All or nothing per sequence: a failure before the commits rewinds every cache and raises; one in a
        sequence's commit rewinds that sequence's caches and reports it failed, and the others commit."""
        marks = {s: _mark(s) for s in self._all(batch)}
        try:
            ran = self._forward(batch, self._plan(batch, new_tokens))
        except Exception:
            for seq, mark in marks.items():
                _rewind(seq, mark)
            raise
        guard = _Guard([], marks)
        commits = self._commit(batch, ran, guard)
        t4 = self.clock()
        self._deliver(batch, ran, commits, t4, threads, guard)
        t0, t1, t2 = ran.plan.t
        return StepReport(batch.size, len(batch.decodes), new_tokens, ran.rows, t1 - t0, t2 - t1, ran.t3 - t2,
                          t4 - ran.t3, guard.failures)

    def _plan(self, batch: Batch, new_tokens: int) -> _Plan:
        """Draft the sequences that draft this step, size `auto` trees together, and plan every segment."""
        t0 = self.clock()
        auto = [s for s in batch.decodes if _policy(s) is not None]
        shared = self.budget if len(batch.decodes) > 1 and auto and self.budget is not None else None
        lean = new_tokens >= LEAN_PREFILL and any(_first_token(s, n) for s, n in batch.prefills)
        auto_drafts = shared.drafts(len(batch.decodes)) and not lean if shared else False
        drafting = [s for s in batch.decodes if not (lean and s in auto) and (
            auto_drafts if shared and s in auto else s.proposer.drafts(s.length, s.tokens))]
        drafts = dict(zip(drafting, self._draft(drafting)))
        t1 = self.clock()
        if shared:
            self._size_trees(shared, batch, auto, drafts, t1 - t0)
        plans = [s.decoder.plan(drafts.get(s)) for s in batch.decodes]
        chunks = [s.decoder.prefill_segment(n, s.scored) for s, n in batch.prefills]
        return _Plan([t0, t1, self.clock()], shared, auto_drafts, set(drafts), [t for t, _ in plans], chunks,
                     chunks + [seg for _, seg in plans])

    def _forward(self, batch: Batch, plan: _Plan) -> _Ran:
        """One target forward over every tree and prefill chunk."""
        keeps = any(s.decoder.capturing for s in batch.decodes) or any(s.decoder.capture for s, _ in batch.prefills)
        capture = self.drafter.cfg.target_layer_ids if keeps else ()
        shape = [(len(seg.tokens), seg.cache.length) for seg in plan.segments]
        outs = self.target.forward_many(plan.segments, capture) if plan.segments else []
        return _Ran(plan, outs, shape, sum(rows for rows, _ in shape), self.clock())

    def _commit(self, batch: Batch, ran: _Ran, guard: _Guard) -> tuple[dict, dict]:
        """Each sequence's commit, under the guard: (decodes' committed tokens and paths, prefills' first tokens)."""
        plan = ran.plan
        decode_outs = ran.outs[len(plan.chunks):]
        committed = {s: guard(s, s.decoder.commit, tree, out) for s, tree, out in zip(batch.decodes, plan.trees,
                                                                                       decode_outs)}
        firsts = {s: guard(s, s.decoder.prefilled, seg, out, s.prompt_logprobs if s.scored else None)
                  for (s, _), seg, out in zip(batch.prefills, plan.chunks, ran.outs)}
        return committed, firsts

    def _deliver(self, batch: Batch, ran: _Ran, commits: tuple[dict, dict], t4: float, threads: int,
                 guard: _Guard) -> None:
        """Each round's stats and tokens to its sequence, under the guard; the shared budget learns the step."""
        (committed, firsts), plan = commits, ran.plan
        t0, t1, t2 = plan.t
        t3 = ran.t3
        done = [(s, tree, committed[s]) for s, tree in zip(batch.decodes, plan.trees) if not guard.failed(s)]
        if plan.shared:
            plan.shared.observe(len(batch.decodes), plan.auto_drafts, sum(len(c[0]) for _, _, c in done), t4 - t0,
                                t3 - t2, plan.shared.predict(ran.shape), chosen=not batch.prefills)
        for seq, tree, (new, path) in done:
            guard(seq, self._deliver_round, seq, tree, new, path, seq in plan.drafted, (t0, t1, t2, t3, t4),
                  batch.size)
        for seq, _ in batch.prefills:
            if guard.failed(seq):
                continue
            seq.stats.prefill_ms += t4 - t0
            seq.stats.prefill_threads = max(seq.stats.prefill_threads, threads)
            if firsts[seq] is not None:
                seq.stats.from_prefill = 1
                guard(seq, seq.deliver, [firsts[seq]], None)

    def _draft(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        if not seqs:
            return []
        return self.drafter.draft_many(self.target, [
            Draft(s.tokens[-1], s.length, s.decoder.draft_cache, s.decoder.cache) for s in seqs])

    def _size_trees(self, shared: BatchBudget, batch: Batch, auto: list[Sequence], drafts: dict,
                    draft_ms: float) -> None:
        """Every `auto` sequence's tree size (when it drafted) and prompt-lookup branch length for this step,
        chosen together (BatchBudget)."""
        trees = [_policy(s).prepare(s.tokens[-1], s.decoder.sampling.log_probs(drafts[s]), s.decoder.steer)
                 if s in drafts else [] for s in auto]
        branches = [s.proposer.branch_chances(s.tokens) for s in auto]
        others = [s for s in batch.decodes if s not in auto]
        fixed = [(n, s.length) for s, n in batch.prefills]
        fixed += [(1 + s.proposer.max_nodes(self.drafter.block_size) * (s in drafts), s.length)
                  for s in others]
        sizes, lengths = shared.sizes(trees, branches, [s.length for s in auto], fixed, draft_ms,
                                      len(others))
        for s, n, length in zip(auto, sizes, lengths):
            if s in drafts:
                _policy(s).size = n
            s.proposer.branch = length

    def _deliver_round(self, seq: Sequence, tree: DraftTree, new: list[int], path: list[int], drafted: bool,
                       t: tuple[float, ...], batch: int) -> None:
        t0, t1, t2, t3, t4 = t
        start = seq.length - len(path)
        rnd = RoundStats(start, tree.size, len(new), t1 - t0, t2 - t1, t3 - t2, t4 - t3, (t1 - t0) + (t3 - t2),
                         drafted, batch)
        if seq.decoder.grammar is not None:
            cost = seq.decoder.grammar.take_cost()
            rnd.grammar_masks, rnd.grammar_fills, rnd.grammar_ms = cost.masks, cost.fills, cost.ms
        rnd.law_top, seq.decoder.law_top = seq.decoder.law_top, None
        seq.proposer.observe(rnd, path, new)
        seq.deliver(new, rnd)

    @staticmethod
    def _all(batch: Batch) -> list[Sequence]:
        return batch.decodes + [s for s, _ in batch.prefills]



T = TypeVar("T")
Mark = tuple[int, int | None]


def _mark(seq: Sequence) -> Mark:
    d = seq.decoder
    return d.cache.length, d.draft_cache.length if d.draft_cache is not None else None


def _rewind(seq: Sequence, mark: Mark) -> None:
    """Back to the lengths before the step: whatever it wrote past them is never read, and is overwritten."""
    d = seq.decoder
    d.cache.length = mark[0]
    if d.draft_cache is not None:
        d.draft_cache.length = mark[1]


class _Guard:
    """Runs one sequence's part of a step; a failure rewinds that sequence and is recorded, nothing more."""

    def __init__(self, failed: list[tuple[Sequence, Exception]], marks: dict[Sequence, Mark]):
        self.failures, self.marks = failed, marks

    def __call__(self, seq: Sequence, fn: Callable[..., T], *args: Any) -> T | None:
        if self.failed(seq):
            return None
        try:
            return fn(*args)
        except Exception as e:
            _rewind(seq, self.marks[seq])
            self.failures.append((seq, e))
            return None

    def failed(self, seq: Sequence) -> bool:
        return any(s is seq for s, _ in self.failures)


def _first_token(seq: Sequence, chunk: int) -> bool:
    """Whether this chunk ends a fresh prefill, whose first token (the request's TTFT) waits for the step."""
    d = seq.decoder
    return not d.resumed and d.cache.length + chunk == d.prefill_end


def _policy(seq: Sequence) -> AutoBudget | None:
    """The sequence's `auto` policy, if it decodes with one."""
    return getattr(seq.proposer, "policy", None)
