"""One step of the batch: every drafting sequence's block in one drafter pass, then each tree, then every
tree and prefill chunk in one target forward, then each sequence's commit. A step that prefills a long
chunk runs lean: its `auto` sequences verify their roots and prompt-lookup branches, undrafted. Phases are
timed for the whole step; each sequence's round reports the step it shared (its step time is the batch's)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ddscope.budget import AutoBudget, BatchBudget
from ddscope.decoding import Clock
from ddscope.drafter import Draft, Drafter
from ddscope.hf_target import TargetLike
from ddscope.scheduler import Batch
from ddscope.sequence import Sequence
from ddscope.stats import RoundStats
from ddscope.threads import step_threads, torch_threads
from ddscope.tree import DraftTree


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


# Prefill tokens from which a step drafts for no `auto` sequence: the new request's first token waits for the
# whole step, and beside a long chunk the drafts and trees cost more than they commit (docs/server.md, Lean
# prefill steps: at c=8, TTFT p50 192 against 227 ms at equal tok/s).
LEAN_PREFILL = 256


class Runner:
    def __init__(self, target: TargetLike, drafter: Drafter | None, prefill_threads: int | None = None):
        self.target, self.drafter = target, drafter
        self.budget: BatchBudget | None = None  # sizes `auto` trees together once the verify cost is calibrated
        self.prefill_threads = prefill_threads  # for large steps; None: the idle CPUs at each (ddscope.threads)
        self.clock = Clock(target.lm_head.weight.device)

    def step(self, batch: Batch) -> StepReport:
        new_tokens = sum(n for _, n in batch.prefills)
        threads = step_threads(new_tokens, batch.size, self.prefill_threads)
        with torch_threads(threads):
            return self._step(batch, new_tokens, threads)

    def _step(self, batch: Batch, new_tokens: int, threads: int) -> StepReport:
        t0 = self.clock()
        auto = [s for s in batch.decodes if _policy(s) is not None]
        shared = self.budget if len(batch.decodes) > 1 and auto and self.budget is not None else None
        lean = new_tokens >= LEAN_PREFILL
        auto_drafts = shared.drafts(len(batch.decodes)) and not lean if shared else False
        drafting = [s for s in batch.decodes if not (lean and s in auto) and (
            auto_drafts if shared and s in auto else s.decoder.proposer.drafts(s.decoder.cache.length))]
        drafts = dict(zip(drafting, self._draft(drafting)))
        t1 = self.clock()
        if shared:
            self._size_trees(shared, batch, auto, drafts, t1 - t0)
        plans = [s.decoder.plan(drafts.get(s)) for s in batch.decodes]
        chunks = [s.decoder.prefill_segment(n, s.scored) for s, n in batch.prefills]
        t2 = self.clock()
        segments = chunks + [seg for _, seg in plans]
        capture = self.drafter.cfg.target_layer_ids if any(s.decoder.capture for s in self._all(batch)) else ()
        shape = [(len(seg.tokens), seg.cache.length) for seg in segments]  # (rows, context) of the forward
        outs = self.target.forward_many(segments, capture) if segments else []
        t3 = self.clock()
        committed = [s.decoder.commit(tree, out) for s, (tree, _), out in zip(batch.decodes, plans, outs[len(chunks):])]
        firsts = [s.decoder.prefilled(seg, out, s.prompt_logprobs)
                  for (s, _), seg, out in zip(batch.prefills, chunks, outs)]
        t4 = self.clock()
        if shared:
            shared.observe(len(batch.decodes), auto_drafts, sum(len(new) for new, _ in committed), t4 - t0, t3 - t2,
                           shared.predict(shape), chosen=not batch.prefills)
        for seq, (tree, _), (new, path) in zip(batch.decodes, plans, committed):
            self._deliver_round(seq, tree, new, path, seq in drafts, (t0, t1, t2, t3, t4), batch.size)
        for (seq, _), first in zip(batch.prefills, firsts):
            seq.stats.prefill_ms += t4 - t0
            seq.stats.prefill_threads = max(seq.stats.prefill_threads, threads)
            if first is not None:
                seq.stats.from_prefill = 1
                seq.deliver([first], None)
        return StepReport(batch.size, len(batch.decodes), new_tokens, sum(len(s.tokens) for s in segments),
                          t1 - t0, t2 - t1, t3 - t2, t4 - t3)

    def _draft(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        if not seqs:
            return []
        return self.drafter.draft_many(self.target, [
            Draft(s.decoder.tokens[-1], s.decoder.cache.length, s.decoder.draft_cache, s.decoder.cache) for s in seqs])

    def _size_trees(self, shared: BatchBudget, batch: Batch, auto: list[Sequence], drafts: dict,
                    draft_ms: float) -> None:
        """Every `auto` sequence's tree size (when it drafted) and prompt-lookup branch length for this step,
        chosen together (BatchBudget)."""
        trees = [_policy(s).prepare(s.decoder.tokens[-1], s.decoder.sampling.log_probs(drafts[s])) if s in drafts
                 else [] for s in auto]
        branches = [s.decoder.proposer.branch_chances(s.decoder.tokens) for s in auto]
        others = [s for s in batch.decodes if s not in auto]
        fixed = [(n, s.decoder.cache.length) for s, n in batch.prefills]
        fixed += [(1 + s.decoder.proposer.max_nodes(self.drafter.block_size) * (s in drafts), s.decoder.cache.length)
                  for s in others]
        sizes, lengths = shared.sizes(trees, branches, [s.decoder.cache.length for s in auto], fixed, draft_ms,
                                      len(others))
        for s, n, length in zip(auto, sizes, lengths):
            if s in drafts:
                _policy(s).size = n
            s.decoder.proposer.branch = length

    def _deliver_round(self, seq: Sequence, tree: DraftTree, new: list[int], path: list[int], drafted: bool,
                       t: tuple[float, ...], batch: int) -> None:
        t0, t1, t2, t3, t4 = t
        start = seq.decoder.cache.length - len(path)
        rnd = RoundStats(start, tree.size, len(new), t1 - t0, t2 - t1, t3 - t2, t4 - t3, (t1 - t0) + (t3 - t2),
                         drafted, batch)
        seq.decoder.proposer.observe(rnd, path, new)
        seq.deliver(new, rnd)

    @staticmethod
    def _all(batch: Batch) -> list[Sequence]:
        return batch.decodes + [s for s, _ in batch.prefills]



def _policy(seq: Sequence) -> AutoBudget | None:
    """The sequence's `auto` policy, if it decodes with one."""
    return getattr(seq.decoder.proposer, "policy", None)
