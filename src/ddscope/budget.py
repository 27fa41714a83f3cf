"""Adaptive DDTree budget (`budget="auto"`): each round, the tree size that maximises expected tok/s.

expected tokens(B) = 1 + alpha * sum of the B best node probabilities (best-first pop order, so every
    prefix of the pop order is itself the optimal B-node tree); alpha rescales the drafter's
    confidence to the acceptance actually observed in recent rounds.
step time(B)       = overhead + beta * verify(ctx, B + 1); verify is calibrated once per model and
    device on a (context, nodes) grid, beta tracks drift (load, thermal) online.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from ddscope.model import Target
from ddscope.stats import RoundStats

NODE_GRID = (1, 2, 4, 8, 16, 24, 32, 48, 65)
CTX_GRID = (0, 512, 1024, 2048, 4096, 6144, 8192, 16384, 32768)
MAX_AUTO_BUDGET = NODE_GRID[-1] - 1


def smooth(ms: np.ndarray) -> np.ndarray:
    """A power law in nodes per context row (log-log least squares), monotone in both axes.

    One slow outlier must not flatten the curve: a running maximum would carry it to every larger
    tree and make them look free, which is what the policy then picks.
    """
    logn = np.log(np.array(NODE_GRID, float))
    fitted = []
    for row in np.log(ms):
        slope, icept = np.polyfit(logn, row, 1)
        fitted.append(np.exp(icept + max(slope, 0.0) * logn))
    return np.maximum.accumulate(np.array(fitted), axis=0)


class VerifyCost:
    """Milliseconds of one target forward of `n` tokens over `ctx` cached tokens (bilinear in the grid)."""

    def __init__(self, ctx: list[int], nodes: list[int], ms: list[list[float]]):
        self.ctx, self.nodes, self.ms = np.array(ctx, float), np.array(nodes, float), np.array(ms, float)

    def curve(self, ctx: int) -> np.ndarray:
        """Cost of every n in 1..max(nodes) at this context."""
        at_ctx = np.array([np.interp(ctx, self.ctx, self.ms[:, j]) for j in range(len(self.nodes))])
        return np.interp(np.arange(1, self.nodes[-1] + 1), self.nodes, at_ctx)

    def to_dict(self) -> dict:
        return {"ctx": self.ctx.tolist(), "nodes": self.nodes.tolist(), "ms": self.ms.tolist()}

    @classmethod
    @torch.inference_mode()
    def calibrate(cls, target: Target, max_ctx: int, repeats: int = 5) -> "VerifyCost":
        """Time forwards on a scratch cache; attention cost depends on its length, not its contents."""
        ctx_grid = [c for c in CTX_GRID if c < max_ctx] + [max_ctx]
        cache = target.new_cache(max_ctx + NODE_GRID[-1])
        dev = target.lm_head.weight.device
        ms = []
        for ctx in ctx_grid:
            row = []
            for n in NODE_GRID:
                tokens = torch.zeros(n, dtype=torch.long, device=dev)
                mask = torch.ones(n, ctx + n, dtype=torch.bool, device=dev)
                times = []
                for _ in range(repeats + 1):  # first run warms up
                    cache.length = ctx
                    t0 = time.perf_counter()
                    target(tokens, torch.arange(ctx, ctx + n, device=dev), cache, mask)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1000)
                row.append(min(times[1:]))  # the least-disturbed run: other load only adds time
            ms.append(row)
        return cls(ctx_grid, list(NODE_GRID), smooth(np.array(ms)).tolist())

    @classmethod
    def cached(cls, target: Target, max_ctx: int, key: str) -> "VerifyCost":
        """Calibrate once per (model, device, dtype, threads); reuse the file afterwards."""
        root = Path(os.environ.get("DDSCOPE_CACHE", Path.home() / ".cache" / "ddscope"))
        p = target.lm_head.weight
        ident = f"{key}|{p.device}|{p.dtype}|{torch.get_num_threads()}|{max_ctx}|{NODE_GRID}"
        path = root / f"verify-cost-{hashlib.sha1(ident.encode()).hexdigest()[:16]}.json"
        if path.is_file():
            return cls(**json.loads(path.read_text()))
        cost = cls.calibrate(target, max_ctx)
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cost.to_dict()))
        tmp.replace(path)
        return cost


class AutoBudget:
    """Per-generation policy: `drafts` and `choose` before each verify, `observe` after it.

    When recent drafted rounds commit tokens more slowly than plain rounds would (a drafter out of
    its distribution), it stops drafting, and drafts again every `probe_every` rounds to re-check.
    """

    def __init__(self, cost: VerifyCost, window: int = 16, probe_every: int = 16):
        self.cost, self.probe_every = cost, probe_every
        self.rounds: deque[tuple[float, float, float, float, float]] = deque(maxlen=window)
        self.drafted: deque[tuple[int, float]] = deque(maxlen=window)  # (committed, step ms)
        self.plain: deque[float] = deque(maxlen=window)  # step ms of rounds without a draft
        self.since_draft = 0
        self._predicted = (0.0, 0.0)

    def drafts(self, ctx: int) -> bool:
        if len(self.drafted) < 4 or self.since_draft + 1 >= self.probe_every:
            return True
        _, beta, _ = self._corrections()
        plain_ms = float(np.median(self.plain)) if self.plain else beta * float(self.cost.curve(ctx)[0])
        committed, step_ms = (sum(x) for x in zip(*self.drafted))
        return committed / step_ms > 1.0 / plain_ms

    def _corrections(self) -> tuple[float, float, float]:
        """(alpha, beta, overhead ms) from the recent rounds; neutral before any."""
        if not self.rounds:
            return 1.0, 1.0, 0.0
        acc, pred_acc, verify, pred_verify, overhead = (np.array(x).sum() for x in zip(*self.rounds))
        alpha = float(np.clip((acc + 0.5) / (pred_acc + 0.5), 0.05, 5.0))
        beta = float(np.clip(verify / max(pred_verify, 1e-6), 0.2, 5.0))
        return alpha, beta, overhead / len(self.rounds)

    def choose(self, node_logprobs: list[float], ctx: int) -> int:
        probs = np.exp(np.array(node_logprobs[:MAX_AUTO_BUDGET], float))
        alpha, beta, overhead = self._corrections()
        gain = 1.0 + alpha * np.cumsum(probs)
        verify = self.cost.curve(ctx)[1:len(probs) + 1]  # B nodes + the root
        best = int(np.argmax(gain / (overhead + beta * verify)))
        self._predicted = (float(np.sum(probs[:best + 1])), float(verify[best]))
        return best + 1

    def observe(self, rnd: RoundStats) -> None:
        if rnd.nodes == 0:  # a plain round: only its cost is news
            self.plain.append(rnd.step_ms)
            self.since_draft += 1
            return
        self.since_draft = 0
        self.drafted.append((rnd.committed, rnd.step_ms))
        pred_acc, pred_verify = self._predicted
        overhead = rnd.draft_ms + rnd.tree_ms + rnd.commit_ms
        self.rounds.append((rnd.committed - 1, pred_acc, rnd.verify_ms, pred_verify, overhead))
