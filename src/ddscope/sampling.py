"""Target and drafter token choice: greedy, or temperature / top-k / top-p sampling."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the distribution this sampler draws from (filtered, tempered)."""
        logits = logits.float() / (self.temperature if not self.greedy else 1.0)
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) >= self.top_p  # keep the smallest set reaching top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits.log_softmax(-1)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> list[int]:
        """One token per row: argmax when greedy, else a sample from that row's distribution."""
        if self.greedy:
            return logits.argmax(-1).tolist()
        probs = self.log_probs(logits).exp()
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1).tolist()
