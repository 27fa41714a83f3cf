"""The adaptive budget trades expected accepted tokens against calibrated verify cost."""
import numpy as np
import pytest

from ddscope.budget import MAX_AUTO_BUDGET, AutoBudget, VerifyCost
from ddscope.stats import RoundStats


def cost(slope_per_node: float, slope_per_ctx: float = 0.0) -> VerifyCost:
    ctx, nodes = [0, 4096], [1, 16, 32, 64, 96]
    return VerifyCost(ctx, nodes, [[1 + slope_per_node * n + slope_per_ctx * c * n for n in nodes] for c in ctx])


def confident(n: int = 95) -> list[float]:
    return (np.arange(1, n + 1) * np.log(0.95)).tolist()  # node i accepted with probability 0.95^i


def test_free_verification_takes_the_whole_tree():
    assert AutoBudget(cost(0.0)).choose(confident(), ctx=0) == MAX_AUTO_BUDGET


def test_costly_verification_takes_a_small_tree():
    assert AutoBudget(cost(5.0)).choose(confident(), ctx=0) <= 4


def test_longer_context_shrinks_the_tree():
    policy = AutoBudget(cost(0.02, slope_per_ctx=2e-5))
    short, long = policy.choose(confident(), ctx=0), policy.choose(confident(), ctx=4096)
    assert long < short


def test_observed_rejections_shrink_the_tree():
    policy = AutoBudget(cost(0.02))
    before = policy.choose(confident(), ctx=0)
    for _ in range(16):  # the drafter was confident but nothing was ever accepted
        policy.choose(confident(), ctx=0)
        policy.observe(RoundStats(0, before, committed=1, verify_ms=2.0))
    assert policy.choose(confident(), ctx=0) < before


def test_curve_interpolates_and_is_monotone():
    c = cost(0.1, 1e-4)
    curve = c.curve(2048)
    assert curve.shape == (96,) and np.all(np.diff(curve) >= 0)
    assert curve[15] == pytest.approx(1 + 0.1 * 16 + 1e-4 * 2048 * 16)  # n=16, halfway in context


def test_stops_drafting_when_plain_rounds_are_faster_and_probes_again():
    policy = AutoBudget(cost(0.02), probe_every=5)
    for _ in range(4):  # drafted rounds commit 1 token per 10 ms; a plain round takes 4 ms
        assert policy.drafts(0)
        policy.choose(confident(), ctx=0)
        policy.observe(RoundStats(0, 8, committed=1, draft_ms=5.0, verify_ms=5.0))
    decisions = []
    for _ in range(10):
        decisions.append(policy.drafts(0))
        if decisions[-1]:
            policy.choose(confident(), ctx=0)
            policy.observe(RoundStats(0, 8, committed=1, draft_ms=5.0, verify_ms=5.0))
        else:
            policy.observe(RoundStats(0, 0, committed=1, verify_ms=4.0))
    assert decisions == [False] * 4 + [True] + [False] * 4 + [True]


def test_keeps_drafting_when_it_pays():
    policy = AutoBudget(cost(0.02))
    for _ in range(8):
        policy.choose(confident(), ctx=0)
        policy.observe(RoundStats(0, 16, committed=6, draft_ms=5.0, verify_ms=5.0))
    policy.observe(RoundStats(0, 0, committed=1, verify_ms=4.0))
    assert policy.drafts(0)


def test_auto_skips_drafts_for_a_useless_drafter_and_stays_lossless(tiny_engine):
    prompt = [5, 6, 7, 8]
    ref = tiny_engine.generate(prompt, max_new_tokens=120, method="ar", ignore_eos=True)
    out = tiny_engine.generate(prompt, max_new_tokens=120, method="ddtree", budget="auto", ignore_eos=True)
    assert out.token_ids == ref.token_ids
    nodes = [r.nodes for r in out.stats.rounds]
    assert 0 in nodes and any(nodes), "the random drafter should be dropped, with periodic probes"
