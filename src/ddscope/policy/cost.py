"""The cost side of `auto` (budget="auto"): each round, the tree size that maximises expected tok/s.

expected tokens(B) = 1 + sum of the B best nodes' acceptance chances (best-first pop order, so every
    prefix of the pop order is itself the optimal B-node tree); a node's chance is the product of
    its tokens' conditional chances, each the drafter's probability recalibrated against what the
    target accepted (`Acceptance`).
step time(B)       = draft + verify(ctx, B + 1); verify is calibrated once per model and device on a
    (context, nodes) grid; the measured/predicted ratio of both terms is learned online per tree
    size (`SizeRatio`), which also absorbs drift (load, thermal).

This module holds the verify cost: calibrated once per model and device, and cached on disk.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

import ddscope.models
from ddscope.models.target import Target
from ddscope.speculative.lookup import LOOKUP_MAX
from ddscope.speculative.proposers import MAX_AUTO_BUDGET
from ddscope.util.atomic import atomic_write_text

NODE_GRID = (1, 2, 4, 8, 16, 24, 32, 48, MAX_AUTO_BUDGET + 1)
CTX_GRID = (0, 512, 1024, 2048, 4096, 6144, 8192, 16384, 32768)

log = logging.getLogger(__name__)


def ctx_grid(max_ctx: int) -> list[int]:
    """The contexts a calibration for `max_ctx` measures."""
    return [c for c in CTX_GRID if c < max_ctx] + [max_ctx]


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
        self._ctx = [float(c) for c in ctx]  # bisected every round: a list, not an array
        every_n = np.arange(1, self.nodes[-1] + LOOKUP_MAX + 1)  # a lookup branch may come on top of a tree
        slope = (self.ms[:, -1] - self.ms[:, -2]) / (self.nodes[-1] - self.nodes[-2])  # past the grid: linear
        self._rows = [np.where(every_n > self.nodes[-1], row[-1] + s * (every_n - self.nodes[-1]),
                               np.interp(every_n, self.nodes, row)).tolist()
                      for row, s in zip(self.ms, slope)]  # [ctx][n - 1]
        self._slope = slope.tolist()

    def at(self, ctx: int, n: int) -> float:
        """Cost of one forward of `n` tokens at this context (called every round: plain Python); linear past
        the grid (a batch's forward)."""
        j, f = self._bracket(ctx)
        a, b = self._row(j, n), self._row(j + 1, n)
        return a + f * (b - a)

    def _row(self, j: int, n: int) -> float:
        row = self._rows[j]
        return row[n - 1] if n <= len(row) else row[-1] + self._slope[j] * (n - len(row))

    def curve(self, ctx: int, upto: int | None = None) -> list[float]:
        """Cost of every n in 1..max(nodes) (or 1..`upto`) at this context (called every round: one blend of
        two rows)."""
        j, f = self._bracket(ctx)
        return [a + f * (b - a) for a, b in zip(self._rows[j][:upto], self._rows[j + 1][:upto])]

    def _bracket(self, ctx: int) -> tuple[int, float]:
        """(j, f): this context lies `f` of the way from grid row j to row j + 1, clamped to the grid."""
        if len(self._ctx) == 1:
            return -1, 0.0  # rows j and j + 1 are both the only one
        j = min(max(bisect.bisect_right(self._ctx, ctx) - 1, 0), len(self._ctx) - 2)
        return j, min(max((ctx - self._ctx[j]) / (self._ctx[j + 1] - self._ctx[j]), 0.0), 1.0)

    def to_dict(self) -> dict:
        return {"ctx": self.ctx.tolist(), "nodes": self.nodes.tolist(), "ms": self.ms.tolist()}

    @classmethod
    @torch.inference_mode()
    def calibrate(cls, target: Target, max_ctx: int, repeats: int = 5) -> "VerifyCost":
        """Time forwards on a scratch cache; attention cost depends on its length, not its contents."""
        contexts = ctx_grid(max_ctx)
        cache = target.new_cache(max_ctx + NODE_GRID[-1])
        dev = target.lm_head.weight.device
        ms = []
        for ctx in contexts:
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
        return cls(contexts, list(NODE_GRID), smooth(np.array(ms)).tolist())

    @classmethod
    def cached(cls, target: Target, max_ctx: int, key: str) -> "VerifyCost":
        """Calibrate once per (model, device, dtype, threads, forward's code); reuse the file afterwards. The
        code is ddscope.models' sources: a change to a kernel or its dispatch changes what a forward costs, so
        an older calibration is not read. The file is shared by every process on the machine: one that holds
        no usable calibration is measured again and overwritten, and one that cannot be written is left
        alone; neither fails a request."""
        root = Path(os.environ.get("DDSCOPE_CACHE", Path.home() / ".cache" / "ddscope"))
        p = target.lm_head.weight
        ident = f"{key}|{p.device}|{p.dtype}|{torch.get_num_threads()}|{max_ctx}|{NODE_GRID}|{_forward_code()}"
        path = root / f"verify-cost-{hashlib.sha1(ident.encode()).hexdigest()[:16]}.json"
        cost = cls.read(path, max_ctx)
        if cost is None:
            cost = cls.calibrate(target, max_ctx)
            cost.write(path)
        return cost

    @classmethod
    def read(cls, path: Path, max_ctx: int) -> "VerifyCost | None":
        """The calibration in `path`; None where there is none on this grid (missing, torn by a crash,
        unreadable, another layout)."""
        try:
            doc = json.loads(path.read_text())
            ms = np.array(doc["ms"], float)
            usable = (doc["ctx"] == ctx_grid(max_ctx) and doc["nodes"] == list(NODE_GRID)
                      and ms.shape == (len(doc["ctx"]), len(NODE_GRID)) and np.isfinite(ms).all() and (ms > 0).all())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as e:  # ValueError: JSON torn or not numbers
            log.warning("verify-cost cache %s is unreadable (%s): calibrating again", path, e)
            return None
        if not usable:
            log.warning("verify-cost cache %s holds no calibration for this grid: calibrating again", path)
            return None
        return cls(doc["ctx"], doc["nodes"], doc["ms"])

    def write(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(self.to_dict()))
        except OSError as e:  # a read-only or full disk: this process keeps its calibration in memory
            log.warning("cannot write the verify-cost cache %s (%s)", path, e)


def _forward_code() -> str:
    """A digest of the sources a target's forward runs (ddscope.models: its Python and kernels.c)."""
    models = Path(ddscope.models.__file__).parent
    digest = hashlib.sha1()
    for path in sorted(models.glob("*.py")) + sorted(models.glob("*.c")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
