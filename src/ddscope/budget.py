"""Adaptive DDTree budget (`budget="auto"`): each round, the tree size that maximises expected tok/s.

expected tokens(B) = 1 + sum of the B best nodes' acceptance chances (best-first pop order, so every
    prefix of the pop order is itself the optimal B-node tree); a node's chance is the product of
    its tokens' conditional chances, each the drafter's probability recalibrated against what the
    target accepted (`Acceptance`).
step time(B)       = draft + verify(ctx, B + 1); verify is calibrated once per model and device on a
    (context, nodes) grid; the measured/predicted ratio of both terms is learned online per tree
    size (`SizeRatio`), which also absorbs drift (load, thermal).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ddscope.model import Target
from ddscope.stats import RoundStats
from ddscope.tree import DraftTree, grow, top_k

NODE_GRID = (1, 2, 4, 8, 16, 24, 32, 48, 65)
CTX_GRID = (0, 512, 1024, 2048, 4096, 6144, 8192, 16384, 32768)
MAX_AUTO_BUDGET = NODE_GRID[-1] - 1


def smooth(ms: np.ndarray) -> np.ndarray:
    """A power law in nodes per context row (log-log least squares), monotone in both axes.

    One slow outlier must not flatten the curve: a running maximum would carry it to every larger
    tree and make them look free, which is what the policy then picks.
    """
    logn = np.log(np.array(NODE_GRID, float))
    fitted = []
    for row in np.log(ms):
        slope, icept = np.polyfit(logn, row, 1)
        fitted.append(np.exp(icept + max(slope, 0.0) * logn))
    return np.maximum.accumulate(np.array(fitted), axis=0)


class VerifyCost:
    """Milliseconds of one target forward of `n` tokens over `ctx` cached tokens (bilinear in the grid)."""

    def __init__(self, ctx: list[int], nodes: list[int], ms: list[list[float]]):
        self.ctx, self.nodes, self.ms = np.array(ctx, float), np.array(nodes, float), np.array(ms, float)
        every_n = np.arange(1, self.nodes[-1] + 1)
        self._rows = np.array([np.interp(every_n, self.nodes, row) for row in self.ms])  # [ctx, every n]

    def curve(self, ctx: int) -> np.ndarray:
        """Cost of every n in 1..max(nodes) at this context (called every round: kept to one blend)."""
        j = min(max(bisect.bisect_right(self.ctx, ctx) - 1, 0), len(self.ctx) - 2)
        if len(self.ctx) == 1:
            return self._rows[0]
        f = min(max((ctx - self.ctx[j]) / (self.ctx[j + 1] - self.ctx[j]), 0.0), 1.0)
        return (1 - f) * self._rows[j] + f * self._rows[j + 1]

    def to_dict(self) -> dict:
        return {"ctx": self.ctx.tolist(), "nodes": self.nodes.tolist(), "ms": self.ms.tolist()}

    @classmethod
    @torch.inference_mode()
    def calibrate(cls, target: Target, max_ctx: int, repeats: int = 5) -> "VerifyCost":
        """Time forwards on a scratch cache; attention cost depends on its length, not its contents."""
        ctx_grid = [c for c in CTX_GRID if c < max_ctx] + [max_ctx]
        cache = target.new_cache(max_ctx + NODE_GRID[-1])
        dev = target.lm_head.weight.device
        ms = []
        for ctx in ctx_grid:
            row = []
            for n in NODE_GRID:
                tokens = torch.zeros(n, dtype=torch.long, device=dev)
                mask = torch.ones(n, ctx + n, dtype=torch.bool, device=dev)
                times = []
                for _ in range(repeats + 1):  # first run warms up
                    cache.length = ctx
                    t0 = time.perf_counter()
                    target(tokens, torch.arange(ctx, ctx + n, device=dev), cache, mask)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1000)
                row.append(min(times[1:]))  # the least-disturbed run: other load only adds time
            ms.append(row)
        return cls(ctx_grid, list(NODE_GRID), smooth(np.array(ms)).tolist())

    @classmethod
    def cached(cls, target: Target, max_ctx: int, key: str) -> "VerifyCost":
        """Calibrate once per (model, device, dtype, threads); reuse the file afterwards."""
        root = Path(os.environ.get("DDSCOPE_CACHE", Path.home() / ".cache" / "ddscope"))
        p = target.lm_head.weight
        ident = f"{key}|{p.device}|{p.dtype}|{torch.get_num_threads()}|{max_ctx}|{NODE_GRID}"
        path = root / f"verify-cost-{hashlib.sha1(ident.encode()).hexdigest()[:16]}.json"
        if path.is_file():
            return cls(**json.loads(path.read_text()))
        cost = cls.calibrate(target, max_ctx)
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cost.to_dict()))
        tmp.replace(path)
        return cost


CHANCE_EDGES = np.log([0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99])


class Acceptance:
    """P(the target accepts a draft token | its parent was accepted), from the drafter's probability.

    Drafters are miscalibrated: at T=0 a token the drafter gives 0.15 is accepted about a third of
    the time (acceptance needs only the argmax to match). So each (top-1 or sibling, probability
    bin) keeps decayed counts of such tokens verified and accepted, with `prior` pseudo-tokens at the
    drafter's own probability. It outlives a generation: calibration is a property of the pair.
    """

    def __init__(self, decay: float = 0.98, prior: float = 2.0):
        self.decay, self.prior = decay, prior
        self.verified = np.zeros((2, len(CHANCE_EDGES) + 1))
        self.accepted = np.zeros((2, len(CHANCE_EDGES) + 1))

    def log_chance(self, logp: np.ndarray) -> np.ndarray:
        """[depths, k] drafter log-probs in rank order (column 0 the top-1) -> calibrated log-chances.

        Kept non-increasing along each row: the tree builder relies on siblings coming in order.
        """
        cell = (np.minimum(np.arange(logp.shape[-1]), 1), np.searchsorted(CHANCE_EDGES, logp))
        q = (self.accepted[cell] + self.prior * np.exp(logp)) / (self.verified[cell] + self.prior)
        return np.log(np.maximum(np.minimum.accumulate(q, axis=-1), 1e-12))

    def update(self, logp: np.ndarray, top1: np.ndarray, accepted: np.ndarray) -> None:
        self.verified *= self.decay
        self.accepted *= self.decay
        cell = (np.where(top1, 0, 1), np.searchsorted(CHANCE_EDGES, logp))
        np.add.at(self.verified, cell, 1.0)
        np.add.at(self.accepted, cell, accepted)


class SizeRatio:
    """Measured over predicted, as a function of tokens verified (on NODE_GRID), decayed.

    Corrects what the offline calibration gets wrong by tree size: tree and commit work that grows
    with the tree, cache effects a calibration loop does not see (the drafter runs in between), and
    drift (load, thermal). A size without evidence falls back to the overall ratio (`prior` ms).
    """

    def __init__(self, prior: float = 10.0, decay: float = 0.95):
        self.prior, self.decay = prior, decay
        self.measured = np.zeros(len(NODE_GRID))
        self.predicted = np.zeros(len(NODE_GRID))

    def at(self, tokens: np.ndarray) -> np.ndarray:
        overall = (self.measured.sum() + self.prior) / (self.predicted.sum() + self.prior)
        ratio = (self.measured + self.prior * overall) / (self.predicted + self.prior)
        return np.interp(tokens, NODE_GRID, ratio)

    def update(self, tokens: int, measured: float, predicted: float) -> None:
        self.measured *= self.decay
        self.predicted *= self.decay
        j = min(bisect.bisect_right(NODE_GRID, tokens), len(NODE_GRID) - 1)  # split between grid j-1 and j
        f = min(max((tokens - NODE_GRID[j - 1]) / (NODE_GRID[j] - NODE_GRID[j - 1]), 0.0), 1.0)
        for i, w in ((j - 1, 1 - f), (j, f)):
            self.measured[i] += w * measured
            self.predicted[i] += w * predicted


@dataclass
class Learned:
    """What the policy learns about a (target, drafter, sampler) and keeps across requests."""

    acceptance: Acceptance = field(default_factory=Acceptance)
    cost: SizeRatio = field(default_factory=SizeRatio)  # ms of a step, drafting excluded


class AutoBudget:
    """Per-generation policy: `drafts` and `tree` before each verify, `observe` after.

    When recent drafted rounds commit tokens clearly more slowly than plain rounds would (below
    `skip_below` of their rate: a drafter out of its distribution), it stops drafting and probes
    with a draft after 1, 2, 4 ... `probe_every` plain rounds; a probe that pays resumes drafting.
    Near break-even it keeps drafting: a drafted round also measures the drafter, so it sees at once
    when the text turns predictable, while a plain round learns nothing about the drafter.
    """

    def __init__(self, cost: VerifyCost, learned: Learned | None = None, probe_every: int = 16,
                 warmup: int = 4, skip_below: float = 0.8):
        self.cost, self.probe_every, self.warmup, self.skip_below = cost, probe_every, warmup, skip_below
        self.learned = learned or Learned()
        # Exponential averages over recent rounds (None before the first): plain step ms; drafted
        # rounds' committed tokens, step ms and drafting ms.
        self.plain_ms: float | None = None
        self.committed = self.drafted_ms = self.draft_ms = None
        self.drafted_rounds = 0
        self.since_draft, self.probe_gap = 0, 1
        self.last_choice = MAX_AUTO_BUDGET
        self._chosen: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # parents, drafter log-p, top-1
        self._predicted_verify = 0.0  # calibrated ms for the chosen tree, before SizeRatio

    @property
    def acceptance(self) -> Acceptance:
        return self.learned.acceptance

    def drafts(self, ctx: int) -> bool:
        if self.drafted_rounds < self.warmup or self._drafting_pays(ctx):
            self.probe_gap = 1
            return True
        if self.since_draft >= self.probe_gap:
            self.probe_gap = min(2 * self.probe_gap, self.probe_every)
            return True
        return False

    def _drafting_pays(self, ctx: int) -> bool:
        plain_ms = self.plain_ms or float(self.cost.curve(ctx)[0] * self.learned.cost.at(1))
        return self.committed / self.drafted_ms > self.skip_below / plain_ms

    def candidates(self) -> int:
        """Nodes worth building: half again the last choice, so a growing optimum is found within rounds."""
        return min(MAX_AUTO_BUDGET, max(16, self.last_choice * 3 // 2 + 4))

    def tree(self, root: int, logprobs: torch.Tensor, ctx: int) -> DraftTree:
        """Best-first on calibrated acceptance chances; then the prefix with the best expected tok/s."""
        budget = self.candidates()
        drafted, idx = top_k(logprobs, budget)
        full = grow(root, self.acceptance.log_chance(drafted), idx, budget)
        n = self._size(np.cumsum(np.exp(full.scores[1:])), ctx)
        depths, ranks = np.array(full.depths[1:n + 1]), np.array(full.ranks[1:n + 1])
        self._chosen = np.array(full.parents[1:n + 1]), drafted[depths - 1, ranks], ranks == 0
        return full.prefix(n)

    def _size(self, accepted: np.ndarray, ctx: int) -> int:
        """argmax over B of (1 + expected accepted tokens) / expected step ms."""
        curve = self.cost.curve(ctx)
        verify = curve[1:len(accepted) + 1]
        draft = self.draft_ms or float(curve[0])  # before any draft: a forward's worth
        rate = (1.0 + accepted) / (draft + verify * self.learned.cost.at(np.arange(2, len(accepted) + 2)))
        n = int(np.argmax(rate)) + 1
        self.last_choice, self._predicted_verify = n, float(verify[n - 1])
        return n

    def observe(self, rnd: RoundStats, path: list[int]) -> None:
        if rnd.nodes == 0:  # a plain round: only its cost is news
            self.plain_ms = _average(self.plain_ms, rnd.step_ms)
            self.learned.cost.update(1, rnd.step_ms, float(self.cost.curve(rnd.ctx_len)[0]))
            self.since_draft += 1
            return
        self.since_draft = 0
        self.drafted_rounds += 1
        self.committed = _average(self.committed, rnd.committed)
        self.drafted_ms = _average(self.drafted_ms, rnd.step_ms)
        self.draft_ms = _average(self.draft_ms, rnd.draft_ms)
        self.learned.cost.update(rnd.nodes + 1, rnd.step_ms - rnd.draft_ms, self._predicted_verify)
        parents, drafted, top1 = self._chosen
        on_path = np.zeros(len(parents) + 1, dtype=bool)
        on_path[path] = True
        seen = on_path[parents]  # a token is tested only if its parent was accepted
        self.acceptance.update(drafted[seen], top1[seen], on_path[1:][seen].astype(float))


def _average(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new
