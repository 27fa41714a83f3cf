"""The numbers every analysis shares: a measured point, the robust line step_ms(ctx) = a + b*ctx fitted
through points (Huber), and acceptance by category (avg_commit per workload and context or position, with a
bootstrap interval, because acceptance is workload-dependent and one number per run hides which workload moved)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddscope.bench.errors import AnalysisError

HUBER_K = 1.345          # the usual 95%-efficiency tuning constant
R2_MIN = 0.5             # below this the line explains less step-time variance than it leaves


@dataclass
class Point:
    label: str
    prompt_tokens: float
    tok_per_s: float
    avg_commit: float | None
    n: int = 1
    tok_per_s_sd: float = 0.0
    avg_commit_sd: float = 0.0
    step_ms_sd: float = 0.0
    engine_step_ms: float | None = None
    log_lines: int | None = None  # server log lines behind avg_commit, over the repeats
    server_avg_commit: float | None = None  # the server's own figure, where it differs from the delivered one
    nodes_per_step: float | None = None  # tokens the target verified per step (tree nodes with the root), where said
    grammar_ms: float | None = None  # structured outputs: the grammar's time a step, where the server says
    summary: str = "median"  # "pooled": a run of different prompts, its tokens and decode time over its steps

    @property
    def step_ms(self) -> float | None:
        return 1000.0 * self.avg_commit / self.tok_per_s if self.avg_commit else None


@dataclass
class Fit:
    a_ms: float
    b_ms_per_token: float
    r2: float | None
    n_points: int

    def step_ms(self, ctx: float) -> float:
        return self.a_ms + self.b_ms_per_token * ctx

    @property
    def poor(self) -> bool:
        """A line through 3+ contexts that explains under R2_MIN of the step-time variance."""
        return self.r2 is not None and self.n_points >= 3 and self.r2 < R2_MIN

    def tok_per_s(self, ctx: float, commit: float) -> float:
        """The prediction tok/s(ctx, commit) = commit / step(ctx)."""
        return 1000.0 * commit / self.step_ms(ctx)


def robust_fit(x: list[float], y: list[float], iterations: int = 50) -> Fit:
    """Huber IRLS line fit (resists a stray slow request) with the ordinary R^2 of the final line."""
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    if len(xs) == 0:
        raise AnalysisError("no points to fit")
    if len(np.unique(xs)) < 2:  # one context: a flat line through the median
        return Fit(float(np.median(ys)), 0.0, None, len(xs))
    design = np.column_stack([np.ones_like(xs), xs])
    weights = np.ones_like(xs)
    coef = np.zeros(2)
    for _ in range(iterations):
        sw = np.sqrt(weights)
        new, *_ = np.linalg.lstsq(design * sw[:, None], ys * sw, rcond=None)
        converged = np.allclose(new, coef, rtol=1e-10, atol=1e-12)
        coef = new
        resid = ys - design @ coef
        scale = 1.4826 * np.median(np.abs(resid))  # MAD about zero: a shifted line still has spread
        if converged or scale <= 1e-12 * max(1.0, float(np.abs(ys).max())):
            break
        cut = HUBER_K * scale
        weights = np.minimum(1.0, cut / np.maximum(np.abs(resid), 1e-300))
    resid = ys - design @ coef
    ss_tot = float(((ys - ys.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return Fit(float(coef[0]), float(coef[1]), r2, len(xs))


# ---- acceptance by category ----------------------------------------------------------------------------


def bootstrap_mean(values: list[float], draws: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """The mean and its 95% percentile-bootstrap interval."""
    x = np.asarray(values, float)
    if len(x) == 0:
        return math.nan, math.nan, math.nan
    means = np.random.default_rng(seed).choice(x, (draws, len(x))).mean(axis=1)
    return float(x.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def category_matrix(cells: dict[tuple[str, Any], list[float]]) -> list[dict[str, Any]]:
    """avg_commit per (category, column) with its bootstrap interval over the steps in the cell."""
    out = []
    for (category, column), commits in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        mean, lo, hi = bootstrap_mean(commits)
        out.append({"category": category, "column": column, "avg_commit": mean, "ci95": [lo, hi],
                    "steps": len(commits)})
    return out


def sweep_matrix(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sweep's matrix over workload and context: resampling the steps' commits where the server gave them
    per step, else the requests' avg_commit. Empty for one workload."""
    if len({r["label"] for r in rows}) < 2:
        return []
    cells: dict[tuple[str, Any], list[float]] = {}
    for r in rows:
        if r.get("concurrency", 1) != 1 or not r.get("avg_commit"):
            continue
        values = r.get("commits") or [r["avg_commit"]]
        cells.setdefault((r["label"], int(float(r["prompt_tokens"]))), []).extend(values)
    return category_matrix(cells)
