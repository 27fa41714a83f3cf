"""Decoding strategies as proposers: each turns the drafter's block into the tree to verify.

`ar` verifies the root alone, `dflash` the drafter's greedy chain, `ddtree` a best-first tree.
The engine loop (verify, walk, commit) is the same for all three.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ddscope.budget import AutoBudget
from ddscope.sampling import SamplingParams, first_max
from ddscope.stats import RoundStats
from ddscope.tree import DraftTree, best_first, chain, root_only


class Proposer(ABC):
    uses_drafter = True

    def drafts(self, ctx_len: int) -> bool:
        """Whether to run the drafter this round."""
        return self.uses_drafter

    @abstractmethod
    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int) -> DraftTree:
        """The tree to verify this round, rooted at the last committed token."""

    def observe(self, rnd: RoundStats, path: list[int]) -> None:
        """Feedback after each round (its stats and accepted node indices); only adaptive proposers use it."""


class AR(Proposer):
    uses_drafter = False

    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int) -> DraftTree:
        return root_only(root)


class DFlash(Proposer):
    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int) -> DraftTree:
        return chain(root, first_max(draft_logits).tolist())


class DDTree(Proposer):
    def __init__(self, budget: int | AutoBudget):
        self.policy = budget if isinstance(budget, AutoBudget) else None
        self.budget = "auto" if self.policy else budget

    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int) -> DraftTree:
        if draft_logits is None:  # the policy skipped drafting: verify the root alone
            return root_only(root)
        logprobs = sampling.log_probs(draft_logits)
        if self.policy is None:
            return best_first(root, logprobs, self.budget)
        return self.policy.tree(root, logprobs, ctx_len)

    def drafts(self, ctx_len: int) -> bool:
        return self.policy is None or self.policy.drafts(ctx_len)

    def observe(self, rnd: RoundStats, path: list[int]) -> None:
        if self.policy is not None:
            self.policy.observe(rnd, path)
