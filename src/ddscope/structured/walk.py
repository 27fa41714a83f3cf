"""One sequence's grammar (structured outputs): the legal tokens at any node of a draft tree.

A backend's matcher (ddscope.structured.backend) holds the committed output; a cursor walks it to a node's path (rolling back to the shared
prefix, then accepting the rest), so every node is masked by its own state, as `ar` masks one token at a time.
Only `advance` moves the committed state, after a round's tokens are chosen: a rejected branch or a preempted
sequence never leaves its mark. Past the end of the grammar (its stop token accepted: only with ignore_eos
does decoding go on) nothing is constrained, as vLLM leaves the bitmask unfilled for a terminated grammar.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ddscope.speculative.tree import Children, DraftTree
from ddscope.structured.backend import Compiled

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass
class GrammarCost:
    """What the grammar cost a round: masks filled and the time spent in the matcher and masking."""
    masks: int = 0
    ms: float = 0.0


class GrammarState:
    def __init__(self, compiled: Compiled, vocab: int, steer: bool = True):
        self.matcher = compiled.matcher()
        self.steer = steer  # drafts grown under the grammar; False: masked at the verify only (vLLM's way)
        self.vocab = vocab
        self.bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        self.path: list[int] = []  # tokens the matcher holds past the committed output (the cursor)
        self.free_from: int | None = None  # index in `path` where the grammar ended: no constraint past it
        self.masks: dict[tuple[int, ...], torch.Tensor | None] = {}  # this round's, by path
        self.cost = GrammarCost()

    @property
    def ended(self) -> bool:
        """The committed output completed the grammar (its stop token accepted)."""
        return self.matcher.is_terminated() and not self.path

    def allowed(self, path: list[int]) -> torch.Tensor | None:
        """Bool [vocab]: the tokens legal after the committed output and `path`; None: anything (the grammar
        ended before). Raises IllegalPath if the grammar refuses a token of `path` itself."""
        key = tuple(path)
        if key not in self.masks:
            t0 = time.perf_counter()
            self.masks[key] = self._fill(path)
            self.cost.ms += 1000 * (time.perf_counter() - t0)
        return self.masks[key]

    def legal(self, path: list[int]) -> bool:
        try:
            self._goto(path)
            return True
        except IllegalPath:
            return False

    def mask_rows(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """`logits` with each row's illegal tokens at -inf; rows whose own path is illegal (a node the walk can
        never reach) are left as they are."""
        rows = [(i, self._allowed_or_none(p)) for i, p in enumerate(paths)]
        rows = [(i, m) for i, m in rows if m is not None]
        if not rows:
            return logits
        t0 = time.perf_counter()
        index = torch.tensor([i for i, _ in rows], device=logits.device)
        banned = ~torch.stack([m for _, m in rows]).to(logits.device)
        logits = logits.float().clone()
        logits[index] = logits[index].masked_fill(banned, float("-inf"))
        self.cost.ms += 1000 * (time.perf_counter() - t0)
        return logits

    def children(self, logprobs: torch.Tensor, k: int) -> Children:
        """Each node's `k` likeliest legal tokens, the drafter's log-probs renormalised over the legal set (a
        forced token has log-p 0), for best-first growth under the grammar."""
        def of(tree: DraftTree, node: int) -> tuple[list[float], list[int]]:
            try:
                mask = self.allowed(tree.path(node))
            except IllegalPath:  # a grafted node past an illegal token: it grows nothing
                return [], []
            row = logprobs[tree.depths[node]]
            if mask is not None:
                row = row.masked_fill(~mask[:row.shape[0]].to(row.device), float("-inf"))
                row = row - row.logsumexp(-1)
            vals, idx = torch.topk(row, min(k, row.shape[0]))
            keep = vals.isfinite()
            return vals[keep].tolist(), idx[keep].tolist()
        return of

    def prune(self, tree: DraftTree) -> DraftTree:
        """The tree without the nodes the grammar refuses (and their subtrees): no verify row is spent on them."""
        paths = tree.paths()
        return tree.keep([i for i, p in enumerate(paths) if i == 0 or self.legal(p)])

    def advance(self, tokens: list[int]) -> None:
        """Commit `tokens` (a round's, chosen under the masks): the matcher's state from here on."""
        t0 = time.perf_counter()
        self._goto(tokens)
        self.path, self.free_from = [], None  # held for good; past the grammar's end, nothing to hold
        self.masks.clear()
        self.cost.ms += 1000 * (time.perf_counter() - t0)

    def take_cost(self) -> GrammarCost:
        cost, self.cost = self.cost, GrammarCost()
        return cost

    def _allowed_or_none(self, path: list[int]) -> torch.Tensor | None:
        try:
            return self.allowed(path)
        except IllegalPath:
            return None

    def _fill(self, path: list[int]) -> torch.Tensor | None:
        self._goto(path)
        if self.matcher.is_terminated():
            return None
        self.matcher.fill(self.bitmask)
        self.cost.masks += 1
        return ((self.bitmask[0, :, None] >> _BITS) & 1).view(-1)[:self.vocab].bool()

    def _goto(self, path: list[int]) -> None:
        """Move the cursor to `path`: roll back to the prefix it shares with the current one, accept the rest."""
        held = len(self.path) if self.free_from is None else self.free_from
        shared = 0
        while shared < min(held, len(path)) and self.path[shared] == path[shared]:
            shared += 1
        if held > shared:
            self.matcher.rollback(held - shared)
        self.path, self.free_from = self.path[:shared], None
        for token in path[shared:]:
            if self.matcher.is_terminated():
                self.free_from = len(self.path)
                self.path += path[len(self.path):]
                return
            if not self.matcher.accept(token):
                raise IllegalPath(token)
            self.path.append(token)


class IllegalPath(ValueError):
    """A path holds a token the grammar refuses at its place."""
