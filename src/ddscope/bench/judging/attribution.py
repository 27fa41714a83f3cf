"""A regression attributed to its causes: acceptance, context scaling and other step cost (the
decomposition in ddscope.bench.judging.analyze's docstring), and the verdict that names them."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ddscope.bench.judging.fit import R2_MIN, Fit, Point

ON_PAR = math.log(1.03)  # gaps under 3%, about the run-to-run noise on a shared CPU, are on par
SHARE_MIN, SHARE_MAX = -1.0, 2.0  # beyond these, opposing terms cancel and a share reads as nonsense


@dataclass
class Attribution:
    label: str
    prompt_tokens: float
    tok_per_s: float
    avg_commit: float
    step_ms: float
    reference: str
    ref_prompt_tokens: float
    ref_tok_per_s: float
    ref_avg_commit: float
    ref_step_ms: float
    gap_log: float
    acceptance_log: float
    context_log: float
    residual_log: float
    acceptance_share: float | None
    step_share: float | None
    context_share: float | None
    residual_share: float | None
    step_vs_curve_pct: float
    warning: str | None = None  # why the shares are withheld (None: they are printed)
    verdict: str = ""


def _share(term: float, gap: float) -> float | None:
    return term / gap if abs(gap) > 1e-12 else None


def attribute(p: Point, fit: Fit, ref_ctx: float, ref_commit: float, ref_step: float,
              reference: str) -> Attribution:
    """The gap's terms and shares; shares set to None, with a warning, where they cannot be read."""
    step = p.step_ms
    assert p.avg_commit and step
    curve, ref_curve = fit.step_ms(p.prompt_tokens), fit.step_ms(ref_ctx)
    acc = math.log(ref_commit / p.avg_commit)
    ctx = math.log(curve / ref_curve)
    resid = math.log(step / curve) - math.log(ref_step / ref_curve)
    gap = acc + ctx + resid
    a = Attribution(
        label=p.label, prompt_tokens=p.prompt_tokens, tok_per_s=p.tok_per_s, avg_commit=p.avg_commit,
        step_ms=step, reference=reference, ref_prompt_tokens=ref_ctx,
        ref_tok_per_s=1000.0 * ref_commit / ref_step, ref_avg_commit=ref_commit, ref_step_ms=ref_step,
        gap_log=gap, acceptance_log=acc, context_log=ctx, residual_log=resid,
        acceptance_share=_share(acc, gap), step_share=_share(ctx + resid, gap),
        context_share=_share(ctx, gap), residual_share=_share(resid, gap),
        step_vs_curve_pct=100.0 * (step / curve - 1.0))
    a.warning = _share_warning(a, fit)
    if a.warning:
        a.acceptance_share = a.step_share = a.context_share = a.residual_share = None
    a.verdict = verdict(a)
    return a


def _share_warning(a: Attribution, fit: Fit) -> str | None:
    if fit.poor:
        return f"the step-time fit is poor (R^2 = {fit.r2:.2f} < {R2_MIN:g})"
    shares = (a.acceptance_share, a.step_share, a.context_share, a.residual_share)
    if any(s is not None and not SHARE_MIN <= s <= SHARE_MAX for s in shares):
        return (f"the terms pull in opposite directions (a share would fall outside "
                f"[{SHARE_MIN:.0%}, {SHARE_MAX:.0%}])")
    return None


def _pct(x: float | None) -> str:
    """A share in whole percent; a share that rounds to zero prints "0%", never "-0%"."""
    return "n/a" if x is None else f"{round(100.0 * x) + 0:.0f}%"


def verdict(a: Attribution) -> str:
    """Plain words, e.g. "slower by 48% (...), mostly acceptance: 82% of the gap is acceptance
    (3.10 vs 6.00 tokens/step); step time is 9% above the baseline curve"."""
    change = 100.0 * (a.tok_per_s / a.ref_tok_per_s - 1.0)
    head = (f"{abs(change):.0f}% ({a.tok_per_s:.1f} vs {a.ref_tok_per_s:.1f} tok/s at {a.prompt_tokens:.0f} "
            f"tokens, against {a.reference})")
    if abs(a.gap_log) < ON_PAR:
        return f"on par: within {head}"
    direction = "slower" if a.gap_log > 0 else "faster"
    if a.warning:
        return (f"{direction} by {head}; shares withheld: {a.warning}. Raw ratios: avg_commit "
                f"x{a.avg_commit / a.ref_avg_commit:.2f} ({a.avg_commit:.2f} vs {a.ref_avg_commit:.2f} tokens/step), "
                f"step time x{a.step_ms / a.ref_step_ms:.2f} ({a.step_ms:.2f} vs {a.ref_step_ms:.2f} ms), "
                f"fitted step x{math.exp(a.context_log):.2f}")
    terms = {"acceptance": a.acceptance_log, "context scaling": a.context_log, "other step cost": a.residual_log}
    cause = max(terms, key=lambda k: terms[k] * math.copysign(1.0, a.gap_log))
    parts = [(f"{_pct(a.acceptance_share)} of the gap is acceptance "
              f"({a.avg_commit:.2f} vs {a.ref_avg_commit:.2f} tokens/step)")]
    if a.context_log:
        parts.append(f"{_pct(a.context_share)} is context scaling (fitted step "
                     f"x{math.exp(a.context_log):.2f} from {a.ref_prompt_tokens:.0f} tokens)")
        parts.append(f"{_pct(a.residual_share)} is other step cost")
    parts.append(f"step time is {abs(a.step_vs_curve_pct):.0f}% "
                 f"{'above' if a.step_vs_curve_pct >= 0 else 'below'} the baseline curve")
    return f"{direction} by {head}, mostly {cause}: " + "; ".join(parts)
