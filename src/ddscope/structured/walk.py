"""One sequence's grammar (structured outputs): the legal tokens at any node of a draft tree.

A backend's matcher (ddscope.structured.backend) holds the committed output; a cursor walks it to a node's path
(rolling back to the shared prefix, then accepting the rest), so every node is masked by its own state, as `ar`
masks one token at a time. Only `advance` moves the committed state, after a round's tokens are chosen: a
rejected branch or a preempted sequence never leaves its mark. Past the end of the grammar (its stop token
accepted: only with ignore_eos does decoding go on) nothing is constrained, as vLLM leaves the bitmask unfilled
for a terminated grammar.

Many nodes of a tree share a legal set: siblings inside a free string, a string's successive characters, the
branches after the same key. A node's fill (the backend's, microseconds) reads its state; everything built from it
(the token mask, the masked candidates at each depth, the verify's row) is built once per distinct bitmask in a
round and shared by every node whose fill gave it. The verify reuses the masks the tree's growth built.
"""
from __future__ import annotations

import time
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from ddscope.speculative.tree import Children, DraftTree
from ddscope.structured.backend import Compiled

Candidates = tuple[list[float], list[int]]


@dataclass
class GrammarCost:
    """What the grammar cost a round: the backend's fills, the distinct masks built from them, and the time spent
    in the matcher, in masking and in the masked candidates."""
    masks: int = 0
    fills: int = 0
    ms: float = 0.0


@dataclass
class Mask:
    """One legal set of a round, shared by every node whose fill gave it."""
    legal: torch.Tensor  # bool [vocab]
    ids: torch.Tensor    # the legal token ids, ascending
    candidates: dict[int, Candidates] = field(default_factory=dict)  # by depth: the masked drafter's best

    def best(self, logprobs: torch.Tensor, depth: int, k: int) -> Candidates:
        """The `k` likeliest legal tokens at `depth`, the drafter's log-probs renormalised over the legal set (a
        forced token has log-p 0)."""
        if depth not in self.candidates:
            row = logprobs[depth].index_select(0, self.ids)
            vals, at = torch.topk(row - row.logsumexp(0), min(k, len(self.ids)))
            self.candidates[depth] = finite(vals.tolist(), self.ids[at].tolist())
        return self.candidates[depth]


def finite(vals: list[float], tokens: list[int]) -> Candidates:
    """The candidates the drafter's law leaves possible (its top-k or top-p may have put others at -inf)."""
    keep = [i for i, v in enumerate(vals) if math.isfinite(v)]
    return [vals[i] for i in keep], [tokens[i] for i in keep]


class GrammarState:
    def __init__(self, compiled: Compiled, vocab: int, steer: bool = True):
        self.matcher = compiled.matcher()
        self.steer = steer  # drafts grown under the grammar; False: masked at the verify only (vLLM's way)
        self.vocab = vocab
        self.bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        self.path: list[int] = []  # tokens the matcher holds past the committed output (the cursor)
        self.free_from: int | None = None  # index in `path` where the grammar ended: no constraint past it
        self.masks: dict[tuple[int, ...], Mask | None] = {}  # this round's, by path
        self.shared: dict[bytes, Mask] = {}  # this round's, by bitmask
        self.cost = GrammarCost()

    @property
    def ended(self) -> bool:
        """The committed output completed the grammar (its stop token accepted)."""
        return self.matcher.is_terminated() and not self.path

    @contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.cost.ms += 1000 * (time.perf_counter() - t0)

    def mask(self, path: list[int]) -> Mask | None:
        """The legal set after the committed output and `path`; None: anything (the grammar ended before). Raises
        IllegalPath if the grammar refuses a token of `path` itself."""
        key = tuple(path)
        if key not in self.masks:
            self.masks[key] = self._fill(path)
        return self.masks[key]

    def allowed(self, path: list[int]) -> torch.Tensor | None:
        """Bool [vocab]: the tokens legal after `path` (None: anything); IllegalPath as `mask`."""
        mask = self.mask(path)
        return None if mask is None else mask.legal

    def legal(self, path: list[int]) -> bool:
        try:
            self._goto(path)
            return True
        except IllegalPath:
            return False

    def mask_rows(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """`logits` with each row's illegal tokens at -inf; rows whose own path is illegal (a node the walk can
        never reach) are left as they are."""
        with self._timed():
            rows = [(i, self._allowed_or_none(p)) for i, p in enumerate(paths)]
            rows = [(i, m) for i, m in rows if m is not None]
            if not rows:
                return logits
            index = torch.tensor([i for i, _ in rows], device=logits.device)
            banned = ~torch.stack([m for _, m in rows]).to(logits.device)
            logits = logits.float().clone()
            logits[index] = logits[index].masked_fill(banned, float("-inf"))
        return logits

    def children(self, logprobs: torch.Tensor, k: int) -> Children:
        """Each node's `k` likeliest legal tokens (Mask.best), for best-first growth under the grammar; nodes
        with the same legal set at the same depth share one list."""
        free: dict[int, Candidates] = {}  # past the grammar's end: the drafter's own best, by depth

        def of(tree: DraftTree, node: int) -> Candidates:
            with self._timed():
                try:
                    mask = self.mask(tree.path(node))
                except IllegalPath:  # a grafted node past an illegal token: it grows nothing
                    return [], []
                depth = tree.depths[node]
                if mask is not None:
                    return mask.best(logprobs, depth, k)
                if depth not in free:
                    vals, idx = torch.topk(logprobs[depth], min(k, logprobs.shape[1]))
                    free[depth] = finite(vals.tolist(), idx.tolist())
                return free[depth]
        return of

    def prune(self, tree: DraftTree) -> DraftTree:
        """The tree without the nodes the grammar refuses (and their subtrees): no verify row is spent on them.
        A node is tested against its parent's mask (grown nodes were drawn from it: only grafted ones can fail)."""
        with self._timed():
            paths, kept = tree.paths(), {0}
            for i in range(1, len(paths)):  # parents precede children: `kept` holds the parent if it stays
                if tree.parents[i] in kept and self._allows(paths[tree.parents[i]], tree.tokens[i]):
                    kept.add(i)
        return tree.keep(sorted(kept))

    def advance(self, tokens: list[int]) -> None:
        """Commit `tokens` (a round's, chosen under the masks): the matcher's state from here on."""
        with self._timed():
            self._goto(tokens)
            self.path, self.free_from = [], None  # held for good; past the grammar's end, nothing to hold
            self.masks.clear()
            self.shared.clear()

    def take_cost(self) -> GrammarCost:
        cost, self.cost = self.cost, GrammarCost()
        return cost

    def _allows(self, path: list[int], token: int) -> bool:
        """Whether `token` may follow `path` (a legal path)."""
        mask = self.mask(path)
        return mask is None or bool(mask.legal[token])

    def _allowed_or_none(self, path: list[int]) -> torch.Tensor | None:
        try:
            return self.allowed(path)
        except IllegalPath:
            return None

    def _fill(self, path: list[int]) -> Mask | None:
        """The node's fill, and its Mask: the round's one for this bitmask if another node built it already."""
        self._goto(path)
        if self.matcher.is_terminated():
            return None
        self.matcher.fill(self.bitmask)
        self.cost.fills += 1
        key = self.bitmask.numpy().tobytes()
        if key not in self.shared:
            # bit i of word w is token 32 w + i: on a little-endian host, bit i % 8 of byte 4 w + i // 8
            legal = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")[:self.vocab].astype(bool)
            self.shared[key] = Mask(torch.from_numpy(legal), torch.from_numpy(np.flatnonzero(legal)))
            self.cost.masks += 1
        return self.shared[key]

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
