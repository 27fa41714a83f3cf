"""The numbers every analysis shares: a measured point, the robust line step_ms(ctx) = a + b*ctx fitted
through points (Huber), and the errors an analysis raises."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HUBER_K = 1.345          # the usual 95%-efficiency tuning constant
R2_MIN = 0.5             # below this the line explains less step-time variance than it leaves


class AnalysisError(ValueError):
    """Input that cannot be analysed, with a message that says why."""


class NothingMeasured(AnalysisError):
    """No request produced a measurement: the one case that exits 1."""


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
