"""A round's legal sets as the tree's growth reads them: each distinct bitmask unpacked once (`Mask`), and the
`k` likeliest legal tokens after a node, the drafter's log-probs renormalised over the set (`Mask.best`), from the
drafter's rows of the round (`DraftRows`). All of it on the host: a torch call costs several microseconds before it
does anything, as much as a node's whole fill; a small set's candidates are one call of kernels.c's
(`legal_top_f32`, the same tokens as its numpy twin, which runs where kernels.c is not loaded), numpy's being a
dozen calls of a microsecond each."""
from __future__ import annotations

import math

import numpy as np
import torch

from ddscope.models import native
from ddscope.speculative.sampling import first_max

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
        self.rows, self.kept = logprobs.float().cpu().contiguous(), min(logprobs.shape[1], k + 16)  # likeliest a depth
        self.logp = self.rows.numpy()
        self._top: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._scan: tuple[np.ndarray, np.ndarray, int, int] | None = None  # legal_top_f32's outputs, their addresses

    def legal_top(self, bits: bytes, vocab: int, depth: int, k: int) -> Candidates | None:
        """kernels.c's `legal_top_f32`: the `k` likeliest tokens of the legal set `bits` (a grammar's bitmask over
        `vocab` tokens) at `depth`, renormalised over it; None where kernels.c is not loaded."""
        lib = native.library()
        if lib is None:
            return None
        if self._scan is None:
            ids, vals = np.empty(self.kept, dtype=np.int64), np.empty(self.kept, dtype=np.float32)
            self._scan = ids, vals, ids.ctypes.data, vals.ctypes.data
        ids, vals, ids_at, vals_at = self._scan
        row = self.rows.data_ptr() + depth * self.rows.stride(0) * 4
        n = lib.legal_top_f32(bits, row, min(vocab, self.rows.shape[1]), min(k, self.kept), ids_at, vals_at)
        return vals[:n].tolist(), ids[:n].tolist()

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

    def __init__(self, bits: bytes, vocab: int):
        self.bits, self.vocab = bits, vocab  # the fill's bitmask: bit i of word w is token 32 w + i
        words = np.frombuffer(bits, dtype=np.uint32)
        past = (int(words[-1]) >> vocab % 32).bit_count() if vocab % 32 else 0  # the last word's bits past vocab
        self.count = int(np.bitwise_count(words).sum()) - past
        self._legal: np.ndarray | None = None
        self._ids: np.ndarray | None = None
        self._weights: np.ndarray | None = None
        self._added: np.ndarray | None = None
        self.candidates: dict[int, Candidates] = {}  # by depth: the masked drafter's best

    def first_max(self, row: torch.Tensor) -> int:
        """The first max of a row of logits over this set: a small set's ids read on the host, a large one's row
        masked by addition."""
        if self.count < LARGE_SET and row.device.type == "cpu":
            ids = self.ids
            return int(ids[np.argmax(row.float().numpy()[ids])])
        best = int(first_max(row.float() + torch.from_numpy(self.added).to(row.device)))
        # every legal token at -inf (a law against the grammar, e.g. min_tokens where only the stop is legal): the
        # grammar's first legal token, as a small set's argmax gives
        return best if self.allows(best) else int(self.ids[0])

    def allows(self, token: int) -> bool:
        return bool(self.bits[token >> 3] >> (token & 7) & 1)  # little-endian words: token's bit in byte token / 8

    @property
    def legal(self) -> np.ndarray:
        """bool [vocab]: the legal tokens (little-endian words: token 32 w + i is bit i % 8 of byte 4 w + i // 8)."""
        if self._legal is None:
            self._legal = np.unpackbits(np.frombuffer(self.bits, dtype=np.uint8), bitorder="little")[:self.vocab]
            self._legal = self._legal.view(bool)
        return self._legal

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
        """The candidates of the whole legal set (small, or too little of it among the drafter's best): kernels.c's,
        or its numpy twin."""
        found = draft.legal_top(self.bits, self.vocab, depth, k)
        return found if found is not None else self.scanned(draft.logp[depth], k)

    def scanned(self, logp: np.ndarray, k: int) -> Candidates:
        """`legal_top_f32`'s numpy twin over one row of log-probs."""
        if k <= 0:
            return [], []
        ids = self.ids
        vals = logp[ids]
        best = np.arange(len(ids))
        if len(ids) > 4 * k:  # a large set: its k best found first (a tie at the cut: the lower ids), then ordered
            cut = vals[np.argpartition(vals, len(vals) - k)[len(vals) - k]]
            above = np.flatnonzero(vals > cut)
            best = np.concatenate([above, np.flatnonzero(vals == cut)[:k - len(above)]])
        order = best[np.lexsort((best, -vals[best]))][:k]  # best first, a tie: the lower id
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
