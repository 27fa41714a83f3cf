"""Continuous batching: which sequences run in the next step, and with how many prefill tokens.

Between steps, sequences join (by priority, lower first, then arrival, while `max_num_seqs` and the
free blocks allow) and leave. Each step first gives every decoding sequence room for its round,
preempting the lowest-priority, newest running sequence when the pool is out of blocks (it frees its
blocks and later recomputes its context, as vLLM v1 does: its output is unchanged, since a token
depends only on the tokens before it and the request's seed). Then prefills share at most
`max_prefill_tokens` a step, shortest remaining first, so a long prompt neither stalls everyone's
decode nor holds back a short one that arrives behind it. A sequence is admitted only when the pool
can hold its whole prefill.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ddscope.engine.block_manager import BlockManager, OutOfBlocks
from ddscope.engine.sequence import Sequence, Status


@dataclass
class Batch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk tokens)

    @property
    def size(self) -> int:
        return len(self.decodes) + len(self.prefills)


class Scheduler:
    def __init__(self, blocks: BlockManager | None, max_num_seqs: int, max_prefill_tokens: int):
        self.blocks = blocks  # None: a backend without a pool (transformers), one sequence at a time
        self.max_num_seqs = max_num_seqs if blocks is not None else 1
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: list[Sequence] = []  # in admission order: (priority, arrival)
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_rank)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        for seq in list(self.running):
            if seq.status is Status.RUNNING and not seq.prefilling:
                if self._make_room(seq, seq.length + seq.lookahead()):
                    batch.decodes.append(seq)
        while self.waiting and len(self.running) < self.max_num_seqs and self._admit(self.waiting[0]):
            self.running.append(self.waiting.pop(0))
            # a resumed sequence whose whole context was cached decodes from the next step
        batch.prefills = self._chunks([s for s in self.running if s.prefilling])
        return batch

    def _chunks(self, prefilling: list[Sequence]) -> list[tuple[Sequence, int]]:
        """The step's prefill budget, shortest remaining first so a short prompt is not held behind a long one;
        the oldest (first admitted) is served first with up to half of it, so it is never starved."""
        budget, grants = self.max_prefill_tokens, dict.fromkeys(prefilling, 0)
        order = prefilling[:1] + sorted(prefilling, key=_remaining)
        for i, seq in enumerate(order):
            cap = budget // 2 if i == 0 and len(prefilling) > 1 else budget
            give = max(0, min(cap, seq.chunk_limit(self.max_prefill_tokens) - grants[seq],
                              _remaining(seq) - grants[seq]))
            grants[seq] += give
            budget -= give
        return [(seq, n) for seq, n in grants.items() if n > 0]

    def _make_room(self, seq: Sequence, slots: int) -> bool:
        """Grow `seq`'s pages to `slots`, preempting the newest running sequences as needed; False when `seq`
        itself was the newest and is preempted."""
        if self.blocks is None:
            return True
        while True:
            try:
                self.blocks.grow(seq.pages, slots)
                return True
            except OutOfBlocks:
                victim = max(reversed(self.running), key=lambda s: s.priority)  # ties: the newest admitted
                self.preempt(victim)
                if victim is seq:
                    return False

    def _admit(self, seq: Sequence) -> bool:
        """Start `seq`'s prefill (fresh, or resumed after preemption) on blocks for all of it; False, holding
        nothing, when the pool cannot take it now."""
        d = seq.decoder
        if d.cache is None:
            d.attach(*seq.caches())
        d.begin(None if seq.started else seq.prompt)
        cached = 0
        if self.blocks is not None:
            if not seq.scored:
                cached = self.blocks.match(seq.pages, d.tokens[:d.prefill_end], d.features_from if d.capture else None)
            try:
                self.blocks.grow(seq.pages, d.prefill_end + seq.lookahead(), seq.max_length + seq.lookahead())
            except OutOfBlocks:
                self.blocks.release(seq.pages)
                return False
        d.cache.length = cached
        if seq.preemptions == 0:  # usage counts what its first admission found; later, its own blocks
            seq.stats.cached_tokens = cached
        seq.status = Status.RUNNING
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it first, to recompute its context when blocks free up."""
        self.running.remove(seq)
        self.release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        bisect.insort(self.waiting, seq, key=_rank)

    def finish(self, seq: Sequence, keep: bool = True) -> None:
        """A sequence that ended (or was aborted) leaves, its full blocks kept for the prefix cache unless not
        `keep` (a failed step may have left them holding what no prefix spells)."""
        if seq in self.running:
            self.running.remove(seq)
            self.release(seq, keep)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        if self.blocks is None:  # a transformers cache is the sequence's own memory: freed now
            seq.decoder.attach(None, None)

    def release(self, seq: Sequence, keep: bool = True) -> None:
        if self.blocks is not None:
            if keep:
                self.register(seq)
            self.blocks.release(seq.pages)

    def register(self, seq: Sequence) -> None:
        """Offer `seq`'s full blocks of committed tokens to the prefix cache."""
        d = seq.decoder
        if self.blocks is not None and seq.pages.table:
            self.blocks.register(seq.pages, d.tokens, d.cache.length,
                                 (d.features_from, d.features_to) if d.capture else None)


def _rank(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.id


def _remaining(seq: Sequence) -> int:
    return seq.decoder.prefill_end - seq.length
