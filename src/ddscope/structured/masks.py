"""A round's legal sets as the tree's growth reads them: each distinct bitmask unpacked once (`Mask`), and the
`k` likeliest legal tokens after a node, the drafter's log-probs renormalised over the set (`Mask.best`), from the
drafter's rows of the round (`DraftRows`). All of it numpy on the host: a torch call costs several microseconds
before it does anything, as much as a node's whole fill."""
from __future__ import annotations

import math

import numpy as np
import torch

Candidates = tuple[list[float], list[int]]
# A legal set this large reads its candidates off the drafter's likeliest tokens at a depth, found once a round;
# a smaller one is scanned whole (its ids are few).
LARGE_SET = 256
COVERED = 0.95  # ... where those legal among them hold this share of the legal mass, or all the candidates asked for


class DraftRows:
    """A round's drafter log-probs as the masks read them, on the host: each depth's likeliest tokens (the
    candidates of a large legal set, and the drafter's own past the grammar's end) and its probabilities (a legal
    set's mass), found for every depth at the first ask: a tree that asks at all reaches several depths, and one
    batched op costs about what two rows' cost alone."""

    def __init__(self, logprobs: torch.Tensor, k: int):
        self.rows, self.kept = logprobs.float().cpu(), min(logprobs.shape[1], k + 16)  # likeliest a depth
        self.logp = self.rows.numpy()
        self._top: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def top(self, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The depth's likeliest tokens, best first, and their log-probs."""
        ids, vals, _ = self._tables()
        return ids[depth], vals[depth]

    def probs(self, depth: int) -> np.ndarray:
        return self._tables()[2][depth]

    def _tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._top is None:
            vals, ids = torch.topk(self.rows, self.kept, dim=-1)
            self._top = ids.numpy(), vals.numpy(), self.rows.exp().numpy()
        return self._top

    def best(self, depth: int, k: int) -> Candidates:
        ids, vals = self.top(depth)
        return finite(vals[:k], ids[:k])


class Mask:
    """One legal set of a round, shared by every node whose fill gave it."""

    def __init__(self, bits: np.ndarray, vocab: int):
        # bit i of word w is token 32 w + i: on a little-endian host, bit i % 8 of byte 4 w + i // 8
        self.legal = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].view(bool)
        self.count = int(np.count_nonzero(self.legal))
        self._ids: np.ndarray | None = None
        self._weights: np.ndarray | None = None
        self._added: np.ndarray | None = None
        self.candidates: dict[int, Candidates] = {}  # by depth: the masked drafter's best

    @property
    def added(self) -> np.ndarray:
        """float32 [vocab]: 0 where legal, -inf where not, to add to a row of logits."""
        if self._added is None:
            self._added = np.full(len(self.legal), -np.inf, dtype=np.float32)
            self._added[self.legal] = 0.0
        return self._added

    @property
    def ids(self) -> np.ndarray:
        """The legal token ids, ascending."""
        if self._ids is None:
            self._ids = np.flatnonzero(self.legal)
        return self._ids

    def best(self, draft: DraftRows, depth: int, k: int) -> Candidates:
        """The `k` likeliest legal tokens at `depth`, the drafter's log-probs renormalised over the legal set (a
        forced token has log-p 0)."""
        if depth not in self.candidates:
            self.candidates[depth] = self._from_top(draft, depth, k) or self._scanned(draft, depth, k)
        return self.candidates[depth]

    def _from_top(self, draft: DraftRows, depth: int, k: int) -> Candidates | None:
        """A large set's candidates from the depth's likeliest tokens: those legal among them, where they hold all
        `k` or nearly all the legal mass (a legal token ranked below them is then too unlikely to be grown); None
        otherwise, or where that mass is too small to weigh in single precision."""
        if self.count < LARGE_SET:
            return None
        top, _ = draft.top(depth)
        tokens = top[self.legal[top]][:k]
        if self._weights is None:
            self._weights = self.legal.astype(np.float32)
        probs = draft.probs(depth)
        mass = float(np.dot(probs, self._weights))
        if not len(tokens) or not mass > 1e-30 or (len(tokens) < k and probs[tokens].sum() < COVERED * mass):
            return None
        return finite(draft.logp[depth, tokens] - math.log(mass), tokens)

    def _scanned(self, draft: DraftRows, depth: int, k: int) -> Candidates:
        """The candidates of the whole legal set (small, or too little of it among the drafter's best)."""
        ids = self.ids
        vals = draft.logp[depth][ids]
        if len(ids) > 4 * k:  # a large set: its k best found first, then ordered
            best = np.argpartition(vals, len(vals) - k)[-k:]
            order = best[np.argsort(-vals[best], kind="stable")]
        else:
            order = np.argsort(-vals, kind="stable")[:k]
        peak = float(vals[order[0]]) if len(order) else -math.inf
        if not math.isfinite(peak):
            return [], []
        return finite(vals[order] - (peak + math.log(float(np.exp(vals - peak).sum()))), ids[order])


def finite(vals: np.ndarray, tokens: np.ndarray) -> Candidates:
    """The candidates (best first) the drafter's law leaves possible: its top-k or top-p may have put the last
    ones at -inf."""
    n = len(vals)
    while n and not math.isfinite(vals[n - 1]):
        n -= 1
    return vals[:n].tolist(), tokens[:n].tolist()
