"""The per-request `auto` policy: whether to draft this round, and the tree size that maximises expected
tok/s (the model in ddscope.policy.cost's docstring)."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ddscope.policy.cost import VerifyCost
from ddscope.policy.learn import Acceptance, Learned, average, clipped
from ddscope.speculative.lookup import LOOKUP_MAX
from ddscope.speculative.proposers import MAX_AUTO_BUDGET
from ddscope.speculative.stats import RoundStats
from ddscope.speculative.tree import DraftTree, Steer, grow, per_depth

# Decayed count of plain rounds (0.95 a round) below which `auto` runs one plain round: about every 60
# rounds, so that what a plain round costs and commits is measured, not assumed.
PLAIN_EVIDENCE = 0.05
# The share of a probe gap, its last rounds, whose plain roots sample the target's own law (a softmax and a top-4).
LAW_SHARE = 8
# The farthest a drafter may reach back for `auto` to pause its features: a probe then waits this many rounds.
PAUSE_REACH = 1024
# Nodes grown past the best size so far before a lone sequence's growth stops: past its peak the expected tok/s
# only falls (chances fall, costs rise), save for bumps in the measured cost curve.
PAST_PEAK = 4
# The weight of a plain round in the slow averages of what plain rounds commit and cost: about the last 10.
PLAIN_WEIGHT = 0.1
# Drafting, once stopped, resumes only where drafted rounds commit this much faster than plain ones (it goes on
# down to `skip_below` of them): near break-even a resumed drafter flapped, and each resume restarted the probes'
# backoff, a run of drafted rounds (docs/journal.md, "auto's hysteresis", 2026-12-07).
RESUME_ABOVE = 1.1


class Rates:
    """Expected tokens a ms of each prefix of a tree's nodes, told their log-chances in pop order: (1 + the first
    n chances) / (draft + verify of n + 1 tokens, `verify` the cost curve and `ratio` its learned correction)."""

    def __init__(self, verify: list[float], ratio: Callable[[int], float], draft_ms: float, none: bool = False):
        self.verify, self.ratio, self.draft_ms = verify, ratio, draft_ms
        self.n, self.accepted = 0, 1.0
        self.best, self.best_rate = (0, 1.0 / (draft_ms + verify[0] * ratio(1))) if none else (1, 0.0)

    def add(self, log_chance: float) -> int:
        """Take the next node; return how many nodes the best prefix is behind."""
        self.n += 1
        self.accepted += math.exp(log_chance)
        rate = self.accepted / (self.draft_ms + self.verify[self.n] * self.ratio(self.n + 1))
        if rate > self.best_rate:
            self.best, self.best_rate = self.n, rate
        return self.n - self.best


class AutoBudget:
    """Per-generation policy: `drafts` and `tree` before each verify, `observe` after.

    When recent drafted rounds commit tokens clearly more slowly than plain rounds would (below
    `skip_below` of their rate: a drafter out of its distribution, or a loop that prompt lookup alone
    drafts whole, so the drafter adds nothing but its cost), it stops drafting and probes
    with a draft after 1, 2, 4 ... `probe_every` plain rounds; a probe that pays resumes drafting. None is
    sent while plain rounds commit nearly a block (a loop lookup drafts whole), more than a draft can add,
    nor while the target's own law at plain roots says no drafter could pay (`_perfect_drafter_pays`);
    the rule does not use step times, so a stall cannot shut a good drafter out. The gap
    carries over to the next request: a probe costs a draft and a tree (a few plain rounds' time), so
    restarting at 1 cost each short sampled request about a tenth.
    Near break-even it keeps drafting: a drafted round also measures the drafter, so it sees at once
    when the text turns predictable, while a plain round learns nothing about the drafter.
    """

    def __init__(self, cost: VerifyCost, learned: Learned | None = None, probe_every: int = 128,
                 warmup: int = 4, skip_below: float = 0.9, block: int = LOOKUP_MAX + 1, reach: int | None = None):
        self.cost, self.probe_every, self.warmup, self.skip_below = cost, probe_every, warmup, skip_below
        self.block = block  # the most a drafted round commits: the drafter's block
        self.learned = learned or Learned()
        self.since_draft = 0
        self.probed: float | None = None  # this sequence's latest drafted round's tokens a ms (a probe of its text)
        # The drafter's reach back from a block (None: all context). Within it, features can be paused while the
        # target's law rules drafting out, and a probe waits until the reach holds fresh ones again.
        self.reach = reach if reach is not None and reach <= PAUSE_REACH else None
        self.paused = self.reach is not None and self.learned.ruled_out
        self.resume_at: int | None = None  # the context from which a probe, let through, has features to draft on
        self.last_choice = MAX_AUTO_BUDGET
        self._chosen: list[tuple[int, float, bool]] = []  # per chosen node: parent, drafter log-p, top-1
        self._prepared: DraftTree | None = None
        self.size: int | None = None  # this round's size, when a batch's budget chose it

    @property
    def acceptance(self) -> Acceptance:
        return self.learned.acceptance

    def drafts(self, ctx: int, lookup: tuple[float, int] = (0.0, 0)) -> bool:
        """`lookup`: what a plain round's prompt-lookup branch would add, (expected accepted tokens, length)."""
        if self.resume_at is not None:  # a draft let through waits for the drafter's reach to hold features
            if ctx < self.resume_at:
                return False
            self.resume_at = None
            return True
        if not self._wants_draft(ctx, lookup):
            return False
        if self.paused:  # features resume now: from this round on
            self.paused, self.resume_at = False, ctx + self.reach
            return False
        return True

    @property
    def captures(self) -> bool:
        """Whether this round's target features are kept for the drafter."""
        return not self.paused

    def _wants_draft(self, ctx: int, lookup: tuple[float, int]) -> bool:
        m = self.learned
        if m.drafted_rounds >= self.warmup and m.plain_evidence < PLAIN_EVIDENCE:
            return False  # a plain round now and then, so that what one costs is measured, not assumed
        # A measured drafter cannot pay where the target's own law rules any drafter out (until the next probe due).
        if m.drafted_rounds < self.warmup or (not m.ruled_out and self._drafting_pays(ctx, *lookup)):
            m.probe_gap, m.drafting = 1, True
            return True
        m.drafting = False
        if self.since_draft >= m.probe_gap and 1 + lookup[0] < self.skip_below * self.block:
            m.probe_gap = min(2 * m.probe_gap, self.probe_every)
            m.ruled_out = not self._perfect_drafter_pays(ctx)
            if not m.ruled_out:
                return True
            self.since_draft = 0  # the target alone rules drafting out, as a probe that did not pay would
            self.paused = self.reach is not None  # and no draft needs this round's features
        return False

    @property
    def quiet(self) -> bool:
        """Whether this round has nothing to weigh: the target's law ruled every drafter out, and the rounds that
        sample it again, before the next probe falls due, are still ahead. `drafts` would say no; the proposer then
        runs the round as `ar` does (no lookup, `pass_quietly` for `observe`): the bookkeeping cost 2-3 % of a demo
        step (docs/performance.md, bar K). The law's rounds measure the rest: lookup, and a plain round's cost."""
        return self.learned.ruled_out and self.resume_at is None and not self.wants_law_top

    def pass_quietly(self) -> None:
        """`observe` for a quiet round."""
        self.learned.plain_evidence = 0.95 * self.learned.plain_evidence + 1
        self.since_draft += 1

    @property
    def wants_law_top(self) -> bool:
        """Sample the target's law at plain roots in the last eighth of a probe gap, before the probe is due."""
        gap = self.learned.probe_gap
        return self.resume_at is None and self.since_draft >= gap - max(1, gap // LAW_SHARE)

    def _perfect_drafter_pays(self, ctx: int) -> bool:
        """Whether even a drafter that knew the target's law could beat plain rounds here: a node is accepted
        with the target's probability of its token, so such a drafter's best tree is best-first over the
        target's top probabilities (those sampled at plain roots, taken as every depth's). Where the target
        itself is this unsure (sampling a flat distribution), no probe is sent."""
        top, m = self.learned.law_top, self.learned
        if top is None:
            return True
        logps = [math.log(max(p, 1e-9)) for p in top]
        ranks = list(range(len(logps)))
        perfect = grow(0, MAX_AUTO_BUDGET, self.block - 1, lambda tree, node: (logps, ranks), lambda d, v, r: v[r])
        _, rate = self._best_prefix(perfect.scores[1:], ctx, self._draft_ms(ctx))
        return rate > self.skip_below / (self.cost.at(ctx, 1) * (m.plain_ratio or m.cost.at(1)))

    def _drafting_pays(self, ctx: int, lookup_adds: float, lookup_len: int) -> bool:
        """Whether drafted rounds commit faster than plain ones would (down to `skip_below` of them while drafting
        goes on, RESUME_ABOVE to resume it): this round's (the lookup branch its chances would size), or plain
        rounds as measured over the stretches of text they ran on, whichever is the faster (a branch that just
        missed at a seam of a repeating text is back at full length rounds later). Both rates are learned across
        requests alike: what a drafted round commits is the text's as much."""
        m = self.learned
        tokens = 1 + lookup_len
        plain_ms = self.cost.at(ctx, tokens) * (m.plain_ratio or m.cost.at(tokens))
        plain = (1 + lookup_adds) / plain_ms
        if m.plain_ms:  # measured (and not on a clock that charged it nothing)
            plain = max(plain, m.plain_committed / m.plain_ms)
        if m.drafting:
            return m.committed / m.drafted_ms > self.skip_below * plain
        # A resume needs a probe of this text to pay too: the averages hold the texts drafting paid on before.
        return self.probed is not None and min(m.committed / m.drafted_ms, self.probed) > RESUME_ABOVE * plain

    def candidates(self) -> int:
        """Nodes worth building: half again the last choice, so a growing optimum is found within rounds."""
        return min(MAX_AUTO_BUDGET, max(16, self.last_choice * 3 // 2 + 4))

    def prepare(self, root: int, logprobs: torch.Tensor, steer: Steer | None = None,
                ctx: int | None = None) -> list[float]:
        """Build the candidate tree (best-first on calibrated acceptance chances; under a grammar, of legal
        tokens) ahead of `tree`; return its nodes' log-chances, in pop order, for a batch's budget to size it
        (`size` then set). Given `ctx` (a sequence alone: it sizes its own tree), growth stops PAST_PEAK nodes
        past the best expected tok/s: the rest would never be verified, and under a grammar each costs a fill."""
        budget = self.candidates()
        children = (steer or per_depth)(logprobs, budget)
        enough = None
        if ctx is not None:
            rates = self._rates(ctx, budget)
            enough = lambda log_chance: rates.add(log_chance) >= PAST_PEAK  # noqa: E731
        self._prepared = grow(root, budget, logprobs.shape[0], children, self.acceptance.scorer(), enough)
        return self._prepared.scores[1:]

    def tree(self, root: int, logprobs: torch.Tensor, ctx: int, steer: Steer | None = None) -> DraftTree:
        """The candidate tree's prefix with the best expected tok/s (or of the size a batch's budget chose)."""
        if self._prepared is None:
            self.prepare(root, logprobs, steer, ctx)
        full = self._prepared
        n = self.size if self.size is not None else self._size(full.scores[1:], ctx)
        self._prepared, self.size = None, None
        self._chosen = [(full.parents[i], full.logps[i], full.ranks[i] == 0) for i in range(1, n + 1)]
        return full.prefix(n)

    def _size(self, log_chances: list[float], ctx: int) -> int:
        """argmax over B of (1 + expected accepted tokens) / expected step ms."""
        self.last_choice, _ = self._best_prefix(log_chances, ctx, self._draft_ms(ctx))
        return self.last_choice

    def _draft_ms(self, ctx: int) -> float:
        return self.learned.draft_ms or self.cost.at(ctx, 1)  # before any draft: a forward's worth

    def branch(self, log_chances: list[float], ctx: int) -> int:
        """A plain round's prompt-lookup branch: the prefix of its tokens (log-chances) with the best expected
        tok/s, none where its chances do not pay for the rows (a 2-token forward ran 1.7x a 1-token one at 5k
        tokens: sampled text that lookup seldom hits)."""
        return self._best_prefix(log_chances, ctx, 0.0, none=True)[0]

    def _rates(self, ctx: int, nodes: int, draft_ms: float | None = None, none: bool = False) -> Rates:
        return Rates(self.cost.curve(ctx, nodes + 1), self.learned.cost.at,
                     self._draft_ms(ctx) if draft_ms is None else draft_ms, none)

    def _best_prefix(self, log_chances: list[float], ctx: int, draft_ms: float,
                     none: bool = False) -> tuple[int, float]:
        """(argmax over n, max) of Rates: n >= 1 unless `none`."""
        rates = self._rates(ctx, len(log_chances), draft_ms, none)
        for log_chance in log_chances:
            rates.add(log_chance)
        return rates.best, rates.best_rate

    def observe(self, rnd: RoundStats, path: list[int]) -> None:
        if rnd.batch > 1:  # its times are a batch's (BatchBudget's to learn): only the acceptance is news
            if rnd.drafted:
                self._observe_acceptance(path)
            return
        m = self.learned
        m.plain_evidence = 0.95 * m.plain_evidence + (not rnd.drafted)
        if rnd.law_top is not None:  # one root's law is noisy: a slow average
            old = m.law_top or rnd.law_top
            m.law_top = [0.9 * a + 0.1 * b for a, b in zip(old, rnd.law_top)]
        if not rnd.drafted:  # its cost is news (a prompt-lookup branch may have been verified)
            ratio = rnd.step_ms / self.cost.at(rnd.ctx_len, rnd.nodes + 1)
            m.plain_ratio = average(m.plain_ratio, clipped(ratio, m.plain_ratio))
            m.plain_committed = average(m.plain_committed, rnd.committed, PLAIN_WEIGHT)
            m.plain_ms = average(m.plain_ms, clipped(rnd.step_ms, m.plain_ms), PLAIN_WEIGHT)
            self.since_draft += 1
            return
        self.since_draft = 0
        m.drafted_rounds += 1
        m.committed = average(m.committed, rnd.committed)
        m.drafted_ms = average(m.drafted_ms, clipped(rnd.step_ms, m.drafted_ms))
        self.probed = rnd.committed / rnd.step_ms if rnd.step_ms else math.inf  # a clock that charged nothing
        m.draft_ms = average(m.draft_ms, rnd.draft_ms)
        m.cost.update(rnd.nodes + 1, rnd.step_ms - rnd.draft_ms, self.cost.at(rnd.ctx_len, rnd.nodes + 1))
        self._observe_acceptance(path)

    def _observe_acceptance(self, path: list[int]) -> None:
        on_path = set(path)  # a token is tested only if its parent was accepted
        self.acceptance.update([(logp, top1, i in on_path) for i, (parent, logp, top1)
                                in enumerate(self._chosen, start=1) if parent in on_path])
