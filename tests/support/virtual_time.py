"""Virtual time for tests of `budget="auto"`: time passes only in target forwards (native or transformers) and
drafts, at fixed prices.

`auto` decides from the step times the decoder's clock measures and the verify costs a calibration
measured; on a loaded 2-core machine both move, and tests that asserted its decisions flipped. Under
virtual time the clock reads the sum of the prices of what ran so far and the calibration is those
same prices, so every decision follows from the tokens alone, never from this machine's speed.

A draft costs a drafter's price whatever runs inside it: the test oracle (ddscope.bench.synthetic_models.OracleDrafter)
drafts with block - 1 target forwards, which a real drafter does not; priced so, it could at best break
even with plain rounds.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ddscope.bench.synthetic_models import OracleDrafter
from ddscope.engine import Engine, runner
from ddscope.models.drafter import Drafter
from ddscope.models.hf_target import HFTarget
from ddscope.models.target import Segment, Target
from ddscope.policy.batch import BatchBudget
from ddscope.policy.cost import NODE_GRID, VerifyCost
from ddscope.policy.learn import LearnedBySampler


@dataclass(frozen=True)
class Prices:
    """Milliseconds: a target forward of n tokens over ctx cached ones costs
    base + per_token * n + ctx * (per_ctx + per_ctx_token * n) (bilinear, so the calibration grid
    interpolates it exactly); a draft costs `draft`."""

    base: float
    per_token: float
    per_ctx: float
    per_ctx_token: float
    draft: float

    def forward(self, ctx: int, n: int) -> float:
        return self.base + self.per_token * n + ctx * (self.per_ctx + self.per_ctx_token * n)


# About what the pairs cost single-threaded on the 2-core CI machine (perf_counter, best of 15).
TINY = Prices(base=0.75, per_token=0.01, per_ctx=0.0002, per_ctx_token=0.00002, draft=0.33)
DEMO = Prices(base=1.9, per_token=0.1, per_ctx=0.00027, per_ctx_token=0.000054, draft=2.5)


class VirtualTime:
    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.monkeypatch, self.prices, self.now = monkeypatch, TINY, 0.0
        self.drafting = False

    def __call__(self) -> float:
        """The decoder's clock (decoding.Clock's place)."""
        return self.now

    def verify_cost(self, max_ctx: int) -> VerifyCost:
        """What a calibration would measure under these prices: exact, the prices being bilinear."""
        ctx = [0, max_ctx]
        return VerifyCost(ctx, list(NODE_GRID), [[self.prices.forward(c, n) for n in NODE_GRID] for c in ctx])

    def use(self, engine: Engine, prices: Prices = TINY) -> Engine:
        """Price `engine`'s forwards at `prices`, and let it start this test knowing nothing: no calibration
        and nothing learned from an earlier test's requests (both restored after the test)."""
        self.prices = prices
        self.monkeypatch.setattr(engine, "verify_cost", self.verify_cost(engine.max_model_len))
        self.monkeypatch.setattr(engine, "learned", LearnedBySampler())
        self.monkeypatch.setattr(engine.runner, "clock", self)
        self.monkeypatch.setattr(engine.runner, "budget", BatchBudget(engine.verify_cost))
        return engine

    def install(self) -> None:
        self.monkeypatch.setattr(runner, "Clock", lambda device: self)
        for target in (Target, HFTarget):  # the native target and the transformers one, alike
            self.monkeypatch.setattr(target, "forward_many", self._priced_forward(target.forward_many))
        for drafter in (Drafter, OracleDrafter):
            self.monkeypatch.setattr(drafter, "draft_many", self._priced_draft(drafter.draft_many))
        # an engine that calibrates while this test runs gets the prices, not a measurement
        self.monkeypatch.setattr(VerifyCost, "cached", classmethod(lambda cls, target, max_ctx, key:
                                                                   self.verify_cost(max_ctx)))

    def _priced_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def priced(target, segments: list[Segment], *args, **kwargs) -> Any:
            if not self.drafting:  # the oracle's target forwards are its draft's, priced there
                self.now += sum(self.prices.forward(s.cache.length, s.tokens.shape[0]) for s in segments)
            return forward(target, segments, *args, **kwargs)

        return priced

    def _priced_draft(self, draft: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def priced(drafter, *args, **kwargs) -> torch.Tensor:
            if self.drafting:  # the oracle's own drafter, inside its draft
                return draft(drafter, *args, **kwargs)
            self.drafting = True
            try:
                return draft(drafter, *args, **kwargs)
            finally:
                self.drafting = False
                self.now += self.prices.draft

        return priced
