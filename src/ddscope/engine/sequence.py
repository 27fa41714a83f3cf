"""One request's state as the scheduler sees it: its decoding, its completion rules, its pages of the
pool, and the Steps it has produced that nobody has read yet."""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ddscope.models.kv_pool import Pages
from ddscope.speculative.completion import Completion
from ddscope.speculative.decoder import SCORE_ROWS, Decoder
from ddscope.speculative.proposers import Proposer
from ddscope.speculative.sampling import TokenLogprob
from ddscope.speculative.stats import GenerationStats, RoundStats


@dataclass
class Step:
    token_ids: list[int]
    text: str
    round: RoundStats | None  # None for the first token, which the prefill chose
    stats: GenerationStats  # running totals of this generation, final on the last step
    finish_reason: str | None = None
    matched_stop: int | str | None = None  # on "stop": the EOS id, stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first Step, when asked for


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    def __init__(self, prompt: list[int], decoder: Decoder, completion: Completion, stats: GenerationStats,
                 pages: Pages, prompt_logprobs: int | None = None, priority: int = 0):
        self.id = next(_ids)
        self.prompt, self.decoder, self.completion, self.stats = prompt, decoder, completion, stats
        self.prompt_logprobs = prompt_logprobs  # top N scored per prompt token (echo), or None
        self.priority = priority  # admission order: lower first, then arrival (vLLM's priority policy)
        self.pages = pages  # shared with the decoder's caches
        self.caches: Callable[[], tuple[Any, Any]] | None = None  # makes the decoder's caches at admission
        self.status = Status.WAITING
        self.outbox: deque[Step] = deque()
        self.preemptions = 0
        self.arrival = time.monotonic()
        self.error: Exception | None = None  # why a step failed it

    @property
    def scored(self) -> bool:
        """Whether its prefill scores the prompt: a fresh one with prompt logprobs asked for (a resumed one
        has them already)."""
        return self.prompt_logprobs is not None and not self.started

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def length(self) -> int:
        """Positions its target cache holds: the context committed so far."""
        return self.decoder.cache.length

    @property
    def prefilling(self) -> bool:
        return self.decoder.prefilling

    @property
    def tokens(self) -> list[int]:
        """Prompt and committed tokens."""
        return self.decoder.tokens

    @property
    def proposer(self) -> Proposer:
        return self.decoder.proposer

    @property
    def started(self) -> bool:
        """Whether it has generated a token (a preempted one resumes rather than restarts)."""
        return len(self.tokens) > len(self.prompt)

    @property
    def max_length(self) -> int:
        """The most positions it can reach: its prompt and every token it may generate."""
        return len(self.prompt) + self.completion.max_new

    def lookahead(self) -> int:
        """Slots past the committed context a round may write: the tree, and the drafter's block."""
        d = self.decoder
        block = d.drafter.block_size if d.drafter is not None and d.proposer.uses_drafter else 1
        return max(1 + d.proposer.max_nodes(block), block)

    def chunk_limit(self, budget: int) -> int:
        """Prefill tokens it may run this step: a scored prefill's rows are bounded (its logits are kept)."""
        return min(budget, SCORE_ROWS) if self.scored else budget

    def deliver(self, new: list[int], rnd: RoundStats | None) -> None:
        """Tokens a step chose for it, through its completion rules, as one Step in its outbox."""
        c, d = self.completion, self.decoder
        done = c.count
        kept = c.extend(new)
        if rnd is not None:
            rnd.committed = len(kept)
            self.stats.rounds.append(rnd)
        logprobs = d.logprobs[done:done + len(kept)] if d.top_logprobs is not None else None
        first = rnd is None and self.prompt_logprobs is not None
        self.outbox.append(Step(kept, c.release(), rnd, self.stats, c.finish_reason, c.matched_stop, logprobs,
                                d.prompt_logprobs if first else None))
        if c.finish_reason:
            self.status = Status.FINISHED
