"""Acceptance by category: avg_commit per (workload, context or position) with a bootstrap interval, because
acceptance is workload-dependent and one number per run hides which workload moved."""
from __future__ import annotations

import math
from typing import Any

import numpy as np


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
