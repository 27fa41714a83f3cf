"""Decoding strategies as proposers: each turns the drafter's block into the tree to verify.

`ar` verifies the root alone, `dflash` the drafter's greedy chain, `ddtree` a best-first tree.
The engine loop (verify, walk, commit) is the same for all three.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ddscope.sampling import SamplingParams
from ddscope.tree import DraftTree, best_first, chain, root_only


class Proposer(Protocol):
    uses_drafter: bool

    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int) -> DraftTree:
        ...


class AR:
    uses_drafter = False

    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int) -> DraftTree:
        return root_only(root)


class DFlash:
    uses_drafter = True

    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int) -> DraftTree:
        return chain(root, draft_logits.argmax(-1).tolist())


class DDTree:
    uses_drafter = True

    def __init__(self, budget: int):
        self.budget = budget

    def tree(self, root: int, draft_logits: torch.Tensor | None, sampling: SamplingParams, ctx_len: int) -> DraftTree:
        return best_first(root, sampling.log_probs(draft_logits), self.budget)
