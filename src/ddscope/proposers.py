"""Decoding strategies as proposers: each turns the drafter's block into the tree to verify.

`ar` verifies the root alone, `dflash` the drafter's greedy chain, `ddtree` a best-first tree.
The engine loop (verify, walk, commit) is the same for all three.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ddscope.budget import AutoBudget
from ddscope.lookup import LOOKUP_MAX, Lookup
from ddscope.sampling import SamplingParams, first_max
from ddscope.stats import RoundStats
from ddscope.tree import DraftTree, best_first, chain, root_only


class Proposer(ABC):
    uses_drafter = True

    def drafts(self, ctx_len: int) -> bool:
        """Whether to run the drafter this round."""
        return self.uses_drafter

    @abstractmethod
    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int,
             history: list[int] = ()) -> DraftTree:
        """The tree to verify this round, rooted at the last committed token (`history`'s last)."""

    def observe(self, rnd: RoundStats, path: list[int]) -> None:
        """Feedback after each round (its stats and accepted node indices); only adaptive proposers use it."""


class AR(Proposer):
    uses_drafter = False

    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int,
             history: list[int] = ()) -> DraftTree:
        return root_only(root)


class DFlash(Proposer):
    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int,
             history: list[int] = ()) -> DraftTree:
        return chain(root, first_max(draft_logits).tolist())


class DDTree(Proposer):
    """The drafter's best-first tree, plus a prompt-lookup branch (ddscope.lookup) when the text has one.

    The branch is as long as recent rounds earned: `2 x` the decayed mean of lookup tokens accepted, plus 1,
    up to LOOKUP_MAX. So a loop gets whole blocks. Where lookup has stopped paying (sampling, text that
    does not repeat), its next token is proposed but not verified: the target's choice at the root, which
    every round makes, says whether it would have been accepted, so a loop that begins is seen within a
    round at no verify cost. (A verified 1-token probe doubles what a plain round of `auto` verifies: a
    2-token forward over 3.3k cached tokens took 1.35x a 1-token one on the 2-core AMD EPYC here.)
    `auto` weighs the branch as what a round without the drafter would commit, once `TRUSTED_AFTER`
    rounds have measured it.
    """

    TRUSTED_AFTER = 4

    def __init__(self, budget: int | AutoBudget, lookup: bool = True):
        self.policy = budget if isinstance(budget, AutoBudget) else None
        self.budget = "auto" if self.policy else budget
        self.lookup = Lookup() if lookup else None
        self.lookup_gain = 1.0  # decayed mean of lookup tokens accepted per round
        self.rounds = 0
        self._grafted: set[int] = set()
        self._unverified: tuple[int, int] | None = None  # (history index, lookup's token for it), not grafted

    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int,
             history: list[int] = ()) -> DraftTree:
        if draft_logits is None:  # the policy skipped drafting
            tree = root_only(root)
        elif self.policy is None:
            tree = best_first(root, sampling.log_probs(draft_logits), self.budget)
        else:
            tree = self.policy.tree(root, sampling.log_probs(draft_logits), ctx_len)
        self._grafted, self.rounds = set(), self.rounds + 1
        if self.lookup is not None and history:
            self._score_unverified(history)
            length = self._branch_length()
            branch = self.lookup.propose(history, max(length, 1))
            if length:
                self._grafted = tree.graft(branch)
            elif branch:
                self._unverified = (len(history), branch[0])
        return tree

    def _score_unverified(self, history: list[int]) -> None:
        """Last round's unverified lookup token, against what that round committed after its root."""
        if self._unverified is not None:
            at, token = self._unverified
            self._unverified = None
            self._learn(int(history[at] == token))

    def _learn(self, accepted: int) -> None:
        self.lookup_gain = 0.7 * self.lookup_gain + 0.3 * accepted

    def _branch_length(self) -> int:
        """What recent rounds earned; 0 once lookup stopped paying (then its next token goes unverified)."""
        return 0 if self.lookup_gain < 0.2 else min(LOOKUP_MAX, int(2 * self.lookup_gain + 1))

    def drafts(self, ctx_len: int) -> bool:
        if self.policy is None:
            return True
        if self.lookup is None or self.rounds < self.TRUSTED_AFTER:
            return self.policy.drafts(ctx_len)
        return self.policy.drafts(ctx_len, (self.lookup_gain, self._branch_length()))

    def observe(self, rnd: RoundStats, path: list[int]) -> None:
        if self.lookup is not None and self._unverified is None:  # an unverified token is scored next round
            self._learn(len(self._grafted.intersection(path)))
        if self.policy is not None:
            self.policy.observe(rnd, path)
