"""Target and drafter token choice: greedy, or temperature / top-k / top-p sampling. The sampling fields' defaults
and checks have one home, ddscope.speculative.sampling_fields."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

from ddscope.speculative.sampling_fields import GREEDY_BELOW, default


@dataclass(frozen=True)
class SamplingParams:
    """How the target and drafter choose a token: the sampling fields of a checked Request (`of`)."""
    temperature: float = default("temperature")
    top_p: float = default("top_p")
    top_k: int = default("top_k")  # 0 or -1 disables top-k
    min_p: float = default("min_p")  # keep tokens of at least min_p x the likeliest one's probability; 0: off

    @classmethod
    def of(cls, request: Any) -> SamplingParams:
        """The sampling fields of `request` (an engine Request), by name."""
        return cls(**{f.name: getattr(request, f.name) for f in fields(cls)})

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def untruncated(self) -> bool:
        """Whether this sampler keeps every token (no min-p, top-k or top-p): masking a row then only shifts its
        log-probs, so a draw over a legal set is the row's own draw wherever that is legal."""
        return self.min_p <= 0 and self.top_k <= 0 and self.top_p >= 1

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the distribution this sampler draws from (tempered, then filtered)."""
        logits = logits.float() / (self.temperature if not self.greedy else 1.0)
        if self.min_p > 0:  # vLLM's order: min_p on the tempered probabilities, before top-k and top-p
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < self.min_p * probs.amax(-1, keepdim=True), float("-inf"))
        if self.top_k > 0 and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) >= self.top_p  # keep the smallest set reaching top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits.log_softmax(-1)


class TokenLogprob(NamedTuple):
    logprob: float  # the token's
    top: list[tuple[int, float]]  # the top N as (id, log-prob)
    rank: int  # 1 + the tokens likelier than it (vLLM's: v1/sample/ops/logprobs.py)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each row's log-prob of its token and its `top` likeliest, from the raw log-softmax of the logits:
    before temperature, filters and biases, as vLLM's default `logprobs_mode` (raw_logprobs)."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])
    ranks = (lp >= chosen).sum(-1).tolist()
    chosen = chosen[:, 0].tolist()
    if not top:
        return [TokenLogprob(c, [], r) for c, r in zip(chosen, ranks)]
    values, ids = lp.topk(top, dim=-1)
    return [TokenLogprob(c, list(zip(i, v)), r) for c, i, v, r in zip(chosen, ids.tolist(), values.tolist(), ranks)]


def first_max(scores: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, the first index on ties; `max` because it is the faster of the two on CPU."""
    return scores.max(-1).indices


class Noise:
    """The Exp(1) noise of `choose`, one row per generated index, drawn in index order from the request's
    generator. So the token at index i depends only on the seed, i and the tokens before it, never on the
    tree that reached it: a seeded request gives the same output under every method, budget and policy,
    and whatever ran before it. Each node uses the row of the index it predicts (siblings share one)."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator
        self.first = 0  # the index of rows[0]; earlier rows are never asked for again
        self.rows: list[torch.Tensor] = []

    def at(self, index: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        """[len(index), vocab]: each index's row. Indices never go below the lowest asked for before."""
        while self.first + len(self.rows) <= max(index):
            # -log(1 - U) is Exp(1), and cheaper on CPU than torch's exponential_ (docs/journal.md)
            e = torch.rand(vocab, device=device, generator=self.generator).neg_().log1p_().neg_()
            self.rows.append(e.clamp_min_(torch.finfo(e.dtype).tiny))  # E == 0 would make log E -inf
        low = min(index)
        del self.rows[:low - self.first]
        self.first = low
        return torch.stack([self.rows[i - low] for i in index])
