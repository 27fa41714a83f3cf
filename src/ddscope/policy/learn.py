"""What `auto` learns online about a (target, drafter, sampler): acceptance against the drafter's
probabilities, measured over predicted step time by tree size, and the running averages both policies share."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

from ddscope.policy.cost import NODE_GRID
from ddscope.speculative.lookup import LOOKUP_MAX
from ddscope.speculative.sampling import SamplingParams
from ddscope.speculative.tree import Score

CHANCE_EDGES = [math.log(p) for p in (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)]


class Acceptance:
    """P(the target accepts a draft token | its parent was accepted), from the drafter's probability.

    Drafters are miscalibrated: at T=0 a token the drafter gives 0.15 is accepted about a third of
    the time (acceptance needs only the argmax to match). So each (top-1 or sibling, probability
    bin) keeps slowly decayed counts of such tokens tested and accepted, with `prior` pseudo-tokens
    at the drafter's own probability; it outlives a generation, as a property of the pair. On top,
    a fast logit `offset`, a damped Newton step per round, follows the regime of the moment (the
    text turning repetitive, or leaving the drafter's distribution).

    Plain Python on purpose: a handful of scalars per round, where numpy's per-call cost, with
    caches cold after the forwards, was most of the policy's time.
    """

    def __init__(self, decay: float = 0.98, prior: float = 2.0, step: float = 0.5, ridge: float = 2.0):
        self.decay, self.prior, self.step, self.ridge = decay, prior, step, ridge
        self.tested = [[0.0] * (len(CHANCE_EDGES) + 1) for _ in range(2)]  # [top-1, sibling][bin]
        self.accepted = [[0.0] * (len(CHANCE_EDGES) + 1) for _ in range(2)]
        self.offset = 0.0

    def logit(self, logp: float, top1: bool) -> float:
        """The binned estimate, before the offset."""
        c, b = 1 - top1, bisect.bisect_left(CHANCE_EDGES, logp)
        q = (self.accepted[c][b] + self.prior * math.exp(logp)) / (self.tested[c][b] + self.prior)
        q = min(max(q, 1e-6), 1 - 1e-6)
        return math.log(q / (1 - q))

    def scorer(self) -> Score:
        """Log-chance of the rank-r candidate among its siblings' log-ps, for `grow`; siblings kept in rank order."""
        logits: dict[tuple[int, int], float] = {}

        def score(d: int, drafted: list[float], r: int) -> float:
            key = id(drafted), r  # siblings share one list (per depth, or per node under a grammar)
            if key not in logits:  # rank r-1 of the same list was always asked for first
                x = self.logit(drafted[r], r == 0)
                logits[key] = min(x, logits[id(drafted), r - 1]) if r else x
            return -math.log1p(math.exp(-(logits[key] + self.offset)))

        return score

    def update(self, tested: list[tuple[float, bool, bool]]) -> None:
        """(drafter log-p, top-1, accepted) of each token the target tested this round."""
        if not tested:
            return
        grad, curv = self.ridge * self.offset, self.ridge
        for logp, top1, ok in tested:  # predicted before the counts learn this round
            s = 1.0 / (1.0 + math.exp(-(self.logit(logp, top1) + self.offset)))
            grad, curv = grad + s - ok, curv + s * (1 - s)
        self.offset = min(max(self.offset - self.step * grad / curv, -4.0), 4.0)
        for row in (*self.tested, *self.accepted):
            row[:] = [x * self.decay for x in row]
        for logp, top1, ok in tested:
            c, b = 1 - top1, bisect.bisect_left(CHANCE_EDGES, logp)
            self.tested[c][b] += 1.0
            self.accepted[c][b] += ok


class SizeRatio:
    """Measured over predicted, as a function of tokens verified (on NODE_GRID), decayed.

    Corrects what the offline calibration gets wrong by tree size: tree and commit work that grows
    with the tree, cache effects a calibration loop does not see (the drafter runs in between), and
    drift (load, thermal). A size without evidence falls back to the overall ratio (`prior` rounds).
    """

    def __init__(self, prior: float = 2.0, decay: float = 0.95):
        self.prior, self.decay = prior, decay
        self.ratios = [0.0] * len(NODE_GRID)   # decayed sums of measured/predicted per grid size
        self.weights = [0.0] * len(NODE_GRID)  # ... and of rounds
        self._by_tokens: list[float] | None = None

    def at(self, tokens: int) -> float:
        if self._by_tokens is None:
            overall = (sum(self.ratios) + self.prior) / (sum(self.weights) + self.prior)
            grid = [(r + self.prior * overall) / (w + self.prior) for r, w in zip(self.ratios, self.weights)]
            # past the grid (a lookup branch on the largest tree): the last size's ratio
            self._by_tokens = np.interp(np.arange(NODE_GRID[-1] + LOOKUP_MAX + 1), NODE_GRID, grid).tolist()
        return self._by_tokens[tokens]

    def update(self, tokens: int, measured: float, predicted: float) -> None:
        self.ratios = [x * self.decay for x in self.ratios]
        self.weights = [x * self.decay for x in self.weights]
        j = min(bisect.bisect_right(NODE_GRID, tokens), len(NODE_GRID) - 1)  # split between grid j-1 and j
        f = min(max((tokens - NODE_GRID[j - 1]) / (NODE_GRID[j] - NODE_GRID[j - 1]), 0.0), 1.0)
        for i, w in ((j - 1, 1 - f), (j, f)):
            self.ratios[i] += w * measured / predicted
            self.weights[i] += w
        self._by_tokens = None


@dataclass
class Learned:
    """What the policy learns about a (target, drafter, sampler) and keeps across requests: each new
    request starts from it, so one that begins where drafting does not pay spends no rounds finding out."""

    acceptance: Acceptance = field(default_factory=Acceptance)
    cost: SizeRatio = field(default_factory=SizeRatio)  # ms of a step, drafting excluded
    # Exponential averages over recent drafted rounds (None before the first): committed tokens, step ms
    # and drafting ms; and over plain rounds (no drafter; a prompt-lookup branch may still be verified),
    # measured ms over the calibration's for the tokens verified. Before a plain round is measured, that
    # ratio is the drafted rounds' (`cost`).
    committed: float | None = None
    drafted_ms: float | None = None
    draft_ms: float | None = None
    drafted_rounds: int = 0
    plain_ratio: float | None = None
    # Plain rounds' tokens and ms, averaged slowly: what they commit a ms over a text's stretches, where a
    # prompt-lookup branch's runs and the misses at their seams both count (None before the first).
    plain_committed: float | None = None
    plain_ms: float | None = None
    plain_evidence: float = 0.0  # plain rounds, decayed 0.95 a round
    probe_gap: int = 1  # plain rounds before the next probe, doubled per probe that did not pay
    drafting: bool = True  # drafted rounds last chosen to pay (False: plain rounds, probes between them)
    law_top: list[float] | None = None  # the target's top-4 probabilities at a plain round's root, averaged
    ruled_out: bool = False  # the last probe due found that not even a drafter that knew the target would pay



class LearnedBySampler:
    """What `auto` learned under each sampler, with or without lookup, free or grown under a grammar, kept across
    requests (the 16 latest)."""

    def __init__(self, keep: int = 16):
        self.keep = keep
        self.by_key: dict[tuple, Learned] = {}

    def under(self, sampling: SamplingParams, lookup: bool, steered: bool = False) -> Learned:
        key = (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, lookup, steered)
        if key not in self.by_key and len(self.by_key) >= self.keep:
            del self.by_key[next(iter(self.by_key))]
        return self.by_key.setdefault(key, Learned())


def clipped(ms: float, average: float | None) -> float:
    """A step time as evidence: at most twice the running average, so one stall (a page fault, another
    process) cannot flip the draft-or-not choice for the many rounds the average takes to recover."""
    return ms if average is None else min(ms, 2 * average)


def average(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new
