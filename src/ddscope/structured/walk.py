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
round and shared by every node whose fill gave it. The verify reuses the masks the tree's growth built; greedy, it
reads only the rows of the path it walks (`first_legal_max`), as a sampled one does where its sampler keeps every
token: a row whose own choice the grammar admits (a check: an accept and a rollback, about a microsecond) takes it
unmasked, so the last node, and every `ar` step, fills only where the target's choice is refused. The masks and
their candidates: ddscope.structured.masks.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ddscope.speculative.sampling import first_max
from ddscope.speculative.tree import Children, DraftTree
from ddscope.structured.backend import Compiled
from ddscope.structured.masks import Candidates, DraftRows, Mask


@dataclass
class GrammarCost:
    """What the grammar cost a round: the backend's fills, the distinct masks built from them, and the time spent
    in the matcher, in masking and in the masked candidates."""
    masks: int = 0
    fills: int = 0
    ms: float = 0.0


class Stopwatch:
    """The time spent inside its `with` blocks (never nested), in ms: cheaper than a generator's context."""
    __slots__ = ("ms", "_t0")

    def __init__(self) -> None:
        self.ms, self._t0 = 0.0, 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.ms += 1000 * (time.perf_counter() - self._t0)


class GrammarState:
    def __init__(self, compiled: Compiled, vocab: int, steer: bool = True):
        self.matcher = compiled.matcher()
        self.steer = steer  # drafts grown under the grammar; False: masked at the verify only (vLLM's way)
        self.vocab = vocab
        self.bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        self._bits = self.bitmask.numpy()[0]  # the same memory, as numpy reads it
        self.path: tuple[int, ...] = ()  # tokens the matcher holds past the committed output (the cursor)
        self.free_from: int | None = None  # index in `path` where the grammar ended: no constraint past it
        self.masks: dict[tuple[int, ...], Mask | None] = {}  # this round's, by path
        self.shared: dict[bytes, Mask] = {}  # this round's, by bitmask
        self._nothing = np.zeros(vocab, dtype=np.float32)  # a row no mask takes from
        self._added, self._rows = np.zeros((0, vocab), dtype=np.float32), torch.empty(0)  # mask_rows' buffers
        self.cost = GrammarCost()
        self._timed = Stopwatch()

    @property
    def ended(self) -> bool:
        """The committed output completed the grammar (its stop token accepted)."""
        return self.matcher.is_terminated() and not self.path

    def mask(self, path: Sequence[int]) -> Mask | None:
        """The legal set after the committed output and `path`; None: anything (the grammar ended before). Raises
        IllegalPath if the grammar refuses a token of `path` itself."""
        key = tuple(path)
        if key not in self.masks:
            self.masks[key] = self._fill(path)
        return self.masks[key]

    def allowed(self, path: Sequence[int]) -> np.ndarray | None:
        """Bool [vocab]: the tokens legal after `path` (None: anything); IllegalPath as `mask`."""
        mask = self.mask(path)
        return None if mask is None else mask.legal

    def legal(self, path: Sequence[int]) -> bool:
        try:
            self._goto(path)
            return True
        except IllegalPath:
            return False

    def mask_rows(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """`logits` with each row's illegal tokens at -inf; rows whose own path is illegal (a node the walk can
        never reach) are left as they are."""
        with self._timed:
            masks = [self._mask_or_none(p) for p in paths]
            if all(m is None for m in masks):
                return logits
            n = len(masks)
            if self._added.shape[0] < n:  # kept across rounds: fresh megabytes a round cost page faults
                self._added, self._rows = np.zeros((n, self.vocab), dtype=np.float32), torch.empty(n, self.vocab)
            added = np.stack([self._nothing if m is None else m.added for m in masks], out=self._added[:n])
            # An addition, not masked_fill: that branches on every element, at 5x the time on an irregular mask.
            if logits.device.type == "cpu":
                return torch.add(logits.float(), torch.from_numpy(added), out=self._rows[:n])
            return logits.float() + torch.from_numpy(added).to(logits.device)

    def first_legal_max(self, row: torch.Tensor, path: Sequence[int], first: int | None = None) -> int:
        """A row's first max over the tokens legal after `path` (as `mask_rows`, then the first max): the verify
        walks a tree's accepted path this way, its rows a greedy one's logits or a sampled one's scores (its
        log-probs minus its noise's log). The row's own first max (`first`, where found already: one call over
        every row), where legal, is the masked row's too (it beats every legal token and precedes its ties), so
        only a refused one costs a masked row, or a fill."""
        with self._timed:
            key = tuple(path)
            first = int(first_max(row)) if first is None else first
            if self.admits(key, first):
                return first
            mask = self._mask_or_none(key)
            return first if mask is None else mask.first_max(row)

    def admits(self, path: tuple[int, ...], token: int) -> bool:
        """Whether `token` may follow `path` (a legal path): read off its mask where filled, else checked."""
        mask = self.masks.get(path, False)
        if mask is not False:
            return mask is None or mask.allows(token)
        try:
            self._goto(path + (token,))
            return True
        except IllegalPath:
            return False

    def forced(self, most: int) -> list[int]:
        """The tokens the grammar forces next (each the only legal one after those before it), at most `most`:
        certain, whatever the target, so a round verifies them without a drafter."""
        path: list[int] = []
        with self._timed:
            self._goto(())
            if not self.matcher.forces():  # nothing forced: no fill (xgrammar's may take 100 us)
                return path
            while len(path) < most and (mask := self.mask(path)) is not None and mask.count == 1:
                path.append(int(mask.ids[0]))
        return path

    def children(self, logprobs: torch.Tensor, k: int) -> Children:
        """Each node's `k` likeliest legal tokens (Mask.best), for best-first growth under the grammar; nodes
        with the same legal set at the same depth share one list."""
        with self._timed:
            draft = DraftRows(logprobs, k)

        paths: dict[int, tuple[int, ...]] = {0: ()}  # the growing tree's, each from its parent's

        def of(tree: DraftTree, node: int) -> Candidates:
            with self._timed:
                if node not in paths:
                    paths[node] = paths[tree.parents[node]] + (tree.tokens[node],)
                try:
                    mask = self.mask(paths[node])
                except IllegalPath:  # a grafted node past an illegal token: it grows nothing
                    return [], []
                depth = tree.depths[node]
                return draft.best(depth, k) if mask is None else mask.best(draft, depth, k)
        return of

    def prune(self, tree: DraftTree) -> DraftTree:
        """The tree without the nodes the grammar refuses (and their subtrees): no verify row is spent on them.
        A node is tested against its parent's mask (grown nodes were drawn from it: only grafted ones can fail)."""
        with self._timed:
            paths, kept = [tuple(p) for p in tree.paths()], {0}
            for i in range(1, len(paths)):  # parents precede children: `kept` holds the parent if it stays
                if tree.parents[i] in kept and self.admits(paths[tree.parents[i]], tree.tokens[i]):
                    kept.add(i)
        return tree.keep(sorted(kept))

    def advance(self, tokens: list[int]) -> None:
        """Commit `tokens` (a round's, chosen under the masks): the matcher's state from here on."""
        with self._timed:
            self._goto(tokens)
            self.path, self.free_from = (), None  # held for good; past the grammar's end, nothing to hold
            self.masks.clear()
            self.shared.clear()

    def take_cost(self) -> GrammarCost:
        cost, self.cost = self.cost, GrammarCost()
        cost.ms, self._timed.ms = self._timed.ms, 0.0
        return cost

    def _mask_or_none(self, path: Sequence[int]) -> Mask | None:
        try:
            return self.mask(path)
        except IllegalPath:
            return None

    def _fill(self, path: Sequence[int]) -> Mask | None:
        """The node's fill, and its Mask: the round's one for this bitmask if another node built it already."""
        self._goto(path)
        if self.matcher.is_terminated():
            return None
        self.matcher.fill(self.bitmask)
        self.cost.fills += 1
        key = self._bits.tobytes()
        if key not in self.shared:
            self.shared[key] = Mask(key, self.vocab)
            self.cost.masks += 1
        return self.shared[key]

    def _goto(self, path: Sequence[int]) -> None:
        """Move the cursor to `path`: roll back to the prefix it shares with the current one, accept the rest."""
        path = tuple(path)
        held = len(self.path) if self.free_from is None else self.free_from
        n = min(held, len(path))
        shared = n if self.path[:n] == path[:n] else next(i for i in range(n) if self.path[i] != path[i])
        if held > shared:
            self.matcher.rollback(held - shared)
        self.free_from = None
        for i in range(shared, len(path)):
            if self.matcher.is_terminated():  # asked first: xgrammar logs a warning for each token past its end
                self.free_from = i  # the grammar ended: the rest of the path is free
                break
            if not self.matcher.accept(path[i]):
                self.path = path[:i]
                raise IllegalPath(path[i])
        self.path = path


class IllegalPath(ValueError):
    """A path holds a token the grammar refuses at its place."""
