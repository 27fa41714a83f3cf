"""Continuous batching: which sequences run in the next step, and with how many prefill tokens.

Between steps, sequences join (FIFO, while `max_num_seqs` and the free blocks allow) and leave. Each
step first gives every decoding sequence room for its round, preempting the newest running sequence
when the pool is out of blocks (it frees its blocks and later recomputes its context, as vLLM v1
does: its output is unchanged, since a token depends only on the tokens before it and the request's
seed). Then prefills run in chunks of at most `max_prefill_tokens` a step, so a long prompt does
not stall everyone's decode. A sequence is admitted only when the pool can hold its whole prefill.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ddscope.block_manager import BlockManager, OutOfBlocks
from ddscope.sequence import Sequence, Status


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
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        for seq in list(self.running):
            if seq.status is Status.RUNNING and not seq.decoder.prefilling:
                if self._make_room(seq, seq.decoder.cache.length + seq.lookahead()):
                    batch.decodes.append(seq)
        budget = self.max_prefill_tokens
        for seq in self.running:
            if seq.decoder.prefilling and budget > 0:
                chunk = min(seq.chunk_limit(budget), seq.decoder.prefill_end - seq.decoder.cache.length)
                batch.prefills.append((seq, chunk))
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self._admit(self.waiting[0]):
            seq = self.waiting.popleft()
            self.running.append(seq)
            if seq.decoder.prefilling:
                chunk = min(seq.chunk_limit(budget), seq.decoder.prefill_end - seq.decoder.cache.length)
                batch.prefills.append((seq, chunk))
                budget -= chunk
            # else: a resumed sequence whose whole context was cached decodes from the next step
        return batch

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
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    return False

    def _admit(self, seq: Sequence) -> bool:
        """Start `seq`'s prefill (fresh, or resumed after preemption) on blocks for all of it; False, holding
        nothing, when the pool cannot take it now."""
        d = seq.decoder
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
        if not seq.started:  # a resumed sequence's usage counts what its first prefill found cached
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
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """A sequence that ended (or was aborted) leaves, its full blocks kept for the prefix cache."""
        if seq in self.running:
            self.running.remove(seq)
            self.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def release(self, seq: Sequence) -> None:
        if self.blocks is not None:
            self.register(seq)
            self.blocks.release(seq.pages)

    def register(self, seq: Sequence) -> None:
        """Offer `seq`'s full blocks of committed tokens to the prefix cache."""
        d = seq.decoder
        if self.blocks is not None and seq.pages.table:
            self.blocks.register(seq.pages, d.tokens, d.cache.length, d.features_from if d.capture else None)
