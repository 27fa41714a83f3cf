"""Decoding strategies as proposers: each turns the drafter's block into the tree to verify.

`ar` verifies the root alone, `dflash` the drafter's greedy chain, `ddtree` a best-first tree.
The engine loop (verify, walk, commit) is the same for all three.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Protocol

import torch

from ddscope.speculative.lookup import LOOKUP_MAX, Lookup
from ddscope.speculative.sampling import SamplingParams, first_max
from ddscope.speculative.stats import RoundStats
from ddscope.speculative.tree import DraftTree, Steer, best_first, chain, greedy_chain, root_only

MAX_AUTO_BUDGET = 64  # the largest tree an adaptive budget may build


class BudgetPolicy(Protocol):
    """An adaptive tree size (ddscope.policy.auto.AutoBudget): asked before each round, told after it."""

    def drafts(self, ctx: int, lookup: tuple[float, int] = (0.0, 0)) -> bool: ...

    def tree(self, root: int, logprobs: torch.Tensor, ctx: int, steer: Steer | None = None) -> DraftTree: ...

    def branch(self, log_chances: list[float], ctx: int) -> int: ...

    @property
    def wants_law_top(self) -> bool: ...

    @property
    def captures(self) -> bool: ...

    def observe(self, rnd: RoundStats, path: list[int]) -> None: ...

    @property
    def quiet(self) -> bool: ...

    def pass_quietly(self) -> None: ...


class Proposer(ABC):
    uses_drafter = True

    def drafts(self, ctx_len: int, history: list[int] = ()) -> bool:
        """Whether to run the drafter this round (`history`: the tokens so far, the last one the root)."""
        return self.uses_drafter

    @abstractmethod
    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int,
             history: list[int] = (), steer: Steer | None = None) -> DraftTree:
        """The tree to verify this round, rooted at the last committed token (`history`'s last); `steer`: a
        grammar's candidates at each node, so that drafts are grown of legal tokens only."""

    def max_nodes(self, block: int) -> int:
        """The most draft nodes a round verifies (what a sequence reserves cache slots for)."""
        return block - 1

    @property
    def wants_law_top(self) -> bool:
        """Whether this round's root, when verified alone, should report its law's top probabilities."""
        return False

    @property
    def captures(self) -> bool:
        """Whether this round's target features are kept for the drafter (`uses_drafter`'s, unless paused)."""
        return self.uses_drafter

    def observe(self, rnd: RoundStats, path: list[int], committed: list[int]) -> None:
        """Feedback after each round: its stats, accepted node indices and the tokens it committed (the
        target's own, whatever the tree); only adaptive proposers use it."""


class AR(Proposer):
    uses_drafter = False

    def max_nodes(self, block: int) -> int:
        return 0

    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int,
             history: list[int] = (), steer: Steer | None = None) -> DraftTree:
        return root_only(root)


class DFlash(Proposer):
    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int,
             history: list[int] = (), steer: Steer | None = None) -> DraftTree:
        if steer is not None:
            return greedy_chain(root, draft_logits.shape[0], steer(sampling.log_probs(draft_logits), 1))
        return chain(root, first_max(draft_logits).tolist())


class DDTree(Proposer):
    """The drafter's best-first tree, plus a prompt-lookup branch (ddscope.speculative.lookup) when the text has one.

    Beside a drafted tree alone, the branch is as long as recent rounds earned: `2 x` the decayed mean of
    lookup's score, plus 1, up to LOOKUP_MAX, so a loop gets whole blocks. A round scores lookup's whole
    proposal, grafted or not, against the tokens it committed (the target's own, whatever the tree): the tokens
    it got right before its first miss. So lookup is measured at no verify cost where it has stopped paying
    (sampling, text that does not repeat), and a loop the drafter already commits is seen within a round, not
    over the rounds a branch takes to grow. `auto` weighs the branch as what a round without the drafter would
    commit, once `TRUSTED_AFTER` rounds have measured it. In a round without the drafter, and in a batch, it
    sizes the branch itself: as much of lookup's whole proposal as its chances pay for in rows (alone: `branch`,
    against a plain round's cost; in a batch: BatchBudget, against every tree's nodes), not what the last rounds
    earned, since a round scores only as many tokens as it committed: a run of text lookup has right (a
    newline run in JSON, a loop) is taken in one or two rounds, not over rounds that double the branch. In
    `auto`'s quiet rounds (its `quiet`: the target's own law ruled drafting out) lookup neither proposes nor is
    scored.
    """

    TRUSTED_AFTER = 4

    def __init__(self, budget: int | BudgetPolicy, lookup: bool = True):
        self.policy = None if isinstance(budget, int) else budget
        self.budget = "auto" if self.policy else budget
        self.lookup = Lookup() if lookup else None
        self.lookup_gain = 1.0  # decayed mean of lookup's score a round
        # Decayed counts of the tokens lookup got right and of its misses: a token's chance, hits / (hits + misses).
        # A round that ran out of committed tokens before a miss counts no miss, so a branch verified short (or
        # not at all) does not read as a branch that misses.
        self.lookup_hits, self.lookup_misses = 1.0, 1.0
        self.rounds = 0
        self._proposal: list[int] = []  # lookup's continuation this round, grafted or not
        self._proposed_at = -1  # the history length `_proposal` continues
        self.branch: int | None = None  # this round's branch length, when a batch's budget chose it
        self._quiet = False  # this round is one in which the policy weighs nothing (`drafts` asked it)

    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int,
             history: list[int] = (), steer: Steer | None = None) -> DraftTree:
        if draft_logits is None:  # the policy skipped drafting
            tree = root_only(root)
        elif self.policy is None:
            logprobs = sampling.log_probs(draft_logits)
            tree = best_first(root, logprobs, self.budget, steer(logprobs, self.budget) if steer else None)
        else:
            tree = self.policy.tree(root, sampling.log_probs(draft_logits), ctx_len, steer)
        self.rounds += 1
        if self.lookup is not None and history and not self._quiet:
            if self.branch is not None:  # a batch's budget chose it from branch_chances
                length = self.branch
            elif draft_logits is None and self.policy is not None:
                length = self._plain_branch(history, ctx_len)[1]
            else:
                length = self._propose(history)
            if length:
                tree.graft(self._proposal[:length])
        self.branch = None
        return tree

    def branch_chances(self, history: list[int]) -> list[float]:
        """Log-chances of the tokens of lookup's whole proposal (none once lookup stopped paying), for a batch's
        budget to size against the trees' nodes (`branch` then set), and for `auto` to size a plain round's:
        each token in a row right with lookup's chance p (`lookup_hits`), so the k-th has p^k."""
        if self.lookup is None or not history or not self._propose(history):
            return []
        length = len(self._proposal)
        log_p = math.log(max(self.lookup_hits, 1e-9) / (self.lookup_hits + self.lookup_misses))
        return [k * log_p for k in range(1, length + 1)]

    def _plain_branch(self, history: list[int], ctx_len: int) -> tuple[float, int]:
        """A plain round's branch, as much of lookup's proposal as its rows pay for: (expected accepted tokens,
        length)."""
        chances = self.branch_chances(history)
        n = self.policy.branch(chances, ctx_len) if chances else 0
        return sum(math.exp(c) for c in chances[:n]), n

    def _propose(self, history: list[int]) -> int:
        """Lookup's continuation of `history` (once a round); returns the length of branch recent rounds earned."""
        if self._proposed_at != len(history):
            self._proposal, self._proposed_at = self.lookup.propose(history, LOOKUP_MAX), len(history)
        return min(len(self._proposal), self._branch_length())

    def max_nodes(self, block: int) -> int:
        return (MAX_AUTO_BUDGET if self.policy else self.budget) + LOOKUP_MAX

    @property
    def wants_law_top(self) -> bool:
        return self.policy is not None and self.policy.wants_law_top

    @property
    def captures(self) -> bool:
        return self.policy is None or self.policy.captures

    def _branch_length(self) -> int:
        """What recent rounds earned; 0 once lookup stopped paying (it is still scored, unverified)."""
        return 0 if self.lookup_gain < 0.2 else min(LOOKUP_MAX, int(2 * self.lookup_gain + 1))

    def drafts(self, ctx_len: int, history: list[int] = ()) -> bool:
        if self.policy is None:
            return True
        self._quiet = self.policy.quiet
        if self._quiet:
            return False
        if self.lookup is None or self.rounds < self.TRUSTED_AFTER:
            return self.policy.drafts(ctx_len)
        return self.policy.drafts(ctx_len, self._plain_branch(history, ctx_len))

    def observe(self, rnd: RoundStats, path: list[int], committed: list[int]) -> None:
        if self._quiet:
            self._quiet = False
            self.policy.pass_quietly()
            return
        if self.lookup is not None:
            hits = next((i for i, (a, b) in enumerate(zip(self._proposal, committed)) if a != b),
                        min(len(self._proposal), len(committed)))
            self.lookup_gain = 0.7 * self.lookup_gain + 0.3 * hits
            missed = hits < min(len(self._proposal), len(committed))
            self.lookup_hits, self.lookup_misses = 0.7 * self.lookup_hits + hits, 0.7 * self.lookup_misses + missed
            self._proposal, self._proposed_at = [], -1
        if self.policy is not None:
            self.policy.observe(rnd, path)
