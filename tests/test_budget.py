"""The adaptive budget trades expected accepted tokens against calibrated verify cost."""
import math

import numpy as np
import pytest
import torch

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.policy.auto import AutoBudget
from ddscope.policy.batch import BatchBudget
from ddscope.policy.cost import NODE_GRID, VerifyCost
from ddscope.policy.learn import Acceptance, Learned, SizeRatio
from ddscope.speculative.lookup import LOOKUP_MAX
from ddscope.speculative.proposers import MAX_AUTO_BUDGET, DDTree
from ddscope.speculative.sampling import SamplingParams
from ddscope.speculative.stats import RoundStats
from ddscope.speculative.tree import DraftTree, per_depth


def cost(slope_per_node: float, slope_per_ctx: float = 0.0) -> VerifyCost:
    ctx, nodes = [0, 4096], [1, 16, 32, 64, 96]
    return VerifyCost(ctx, nodes, [[1 + slope_per_node * (n - 1) + slope_per_ctx * c * n for n in nodes] for c in ctx])


def drafter_logits(top1: float, depths: int = 15, vocab: int = 64) -> torch.Tensor:
    """Each depth: the top token has probability `top1`, the rest share what is left, decreasingly."""
    rest = torch.arange(vocab - 1, 0, -1, dtype=torch.float)
    probs = torch.cat([torch.tensor([top1]), (1 - top1) * rest / rest.sum()])
    return probs.log().expand(depths, vocab)


def round_tree(policy: AutoBudget, top1: float = 0.95, ctx: int = 0) -> DraftTree:
    return DDTree(policy).tree(0, drafter_logits(top1), SamplingParams(), ctx)


def test_free_verification_takes_the_whole_tree():
    assert round_tree(AutoBudget(cost(0.0))).size == MAX_AUTO_BUDGET


def test_costly_verification_takes_a_small_tree():
    assert round_tree(AutoBudget(cost(5.0))).size <= 4


def test_longer_context_shrinks_the_tree():
    policy = AutoBudget(cost(0.02, slope_per_ctx=1e-4))
    assert round_tree(policy, ctx=4096).size < round_tree(policy, ctx=0).size


def test_observed_rejections_shrink_the_tree():
    policy = AutoBudget(cost(0.02))
    before = round_tree(policy).size
    for _ in range(16):  # the drafter was confident but nothing was ever accepted
        nodes = round_tree(policy).size
        policy.observe(RoundStats(0, nodes, committed=1, verify_ms=2.0, drafted=True), path=[0])
    assert round_tree(policy).size < before


def test_underconfident_drafter_is_recalibrated_to_a_deep_chain():
    policy = AutoBudget(cost(0.02))
    assert max(round_tree(policy, top1=0.3).depths) < 4  # taken at its word, 0.3^d dies out fast
    for _ in range(30):  # ... but the target accepts every top-1 token
        tree = round_tree(policy, top1=0.3)
        path = top1_chain(tree)
        policy.observe(RoundStats(0, tree.size, committed=len(path), verify_ms=2.0, drafted=True), path=path)
    assert max(round_tree(policy, top1=0.3).depths) == 15


def top1_chain(tree: DraftTree) -> list[int]:
    """The accepted path when the target agrees with every top-ranked draft token."""
    path = [0]
    while (nxt := next((i for i, p in enumerate(tree.parents) if p == path[-1]), None)) is not None:
        path.append(nxt)
    return path


def test_size_ratio_learns_cost_per_tree_size_and_falls_back_to_the_overall_ratio():
    ratio = SizeRatio()
    assert ratio.at(1) == ratio.at(65) == 1.0
    for _ in range(40):
        ratio.update(65, measured=20.0, predicted=10.0)
        ratio.update(2, measured=5.0, predicted=5.0)
    small, unseen, big = ratio.at(2), ratio.at(16), ratio.at(65)
    assert small == pytest.approx(1.0, abs=0.15) and big > 1.8 and small < unseen < big


def test_underpriced_big_trees_shrink_once_measured():
    def settle(per_node_ms: float) -> int:
        policy = AutoBudget(cost(0.02))
        for _ in range(20):  # same drafter and acceptance; only the measured step cost differs
            tree = round_tree(policy, top1=0.6)
            path = top1_chain(tree)[:4]  # the target agrees for three tokens
            policy.observe(RoundStats(0, tree.size, committed=len(path), draft_ms=1.0,
                                      verify_ms=1 + per_node_ms * tree.size, drafted=True), path=path)
        return round_tree(policy, top1=0.6).size

    assert settle(per_node_ms=0.2) < settle(per_node_ms=0.02)  # ten times the calibrated price per node


def chances(acc: Acceptance, probs: list[float]) -> list[float]:
    score, drafted = acc.scorer(), np.log(probs).tolist()
    return [float(np.exp(score(0, drafted, r))) for r in range(len(probs))]


def test_acceptance_keeps_rank_order_and_learns_per_bin():
    acc = Acceptance()
    assert chances(acc, [0.3, 0.2, 0.1]) == pytest.approx([0.3, 0.2, 0.1])  # no evidence: the drafter's word
    for _ in range(50):
        acc.update([(np.log(0.3), True, True), (np.log(0.2), False, False)])
    top1, second, third = chances(acc, [0.3, 0.2, 0.1])
    assert top1 > 0.9 and second < 0.1 and third <= second


def test_acceptance_offset_follows_the_regime_of_the_moment():
    acc = Acceptance()
    for _ in range(8):  # the drafter's word holds on average ...
        acc.update([(np.log(0.5), True, True), (np.log(0.5), True, False)])
    steady = chances(acc, [0.5])[0]
    for _ in range(4):  # ... then the text turns predictable: everything is accepted
        acc.update([(np.log(0.5), True, True), (np.log(0.5), True, True)])
    assert acc.offset > 0.2 and chances(acc, [0.5])[0] > steady + 0.15


def test_curve_interpolates_and_is_monotone():
    c = cost(0.1, 1e-4)
    curve = c.curve(2048)
    assert len(curve) == 96 + LOOKUP_MAX and np.all(np.diff(curve) >= 0)  # a lookup branch may top a tree
    assert curve[-1] - curve[95] == pytest.approx(LOOKUP_MAX * (curve[95] - curve[94]))  # linear past the grid
    assert curve[15] == pytest.approx(1 + 0.1 * 15 + 1e-4 * 2048 * 16)  # n=16, halfway in context


def drafted(policy: AutoBudget, committed: int, step_ms: float = 10.0) -> None:
    nodes = round_tree(policy).size
    policy.observe(RoundStats(0, nodes, committed=committed, draft_ms=step_ms / 2, verify_ms=step_ms / 2, drafted=True),
                   path=list(range(min(committed, nodes + 1))))


def run_plain_or_drafted(policy: AutoBudget, rounds: int, committed: int) -> list[bool]:
    decisions = []
    for _ in range(rounds):
        decisions.append(policy.drafts(0))
        if decisions[-1]:
            drafted(policy, committed)
        else:
            policy.observe(RoundStats(0, 0, committed=1, verify_ms=4.0), path=[0])
    return decisions


def test_stops_drafting_when_plain_rounds_are_faster_and_probes_with_backoff():
    policy = AutoBudget(cost(0.02), probe_every=4)
    assert run_plain_or_drafted(policy, 4, committed=1) == [True] * 4  # warm-up: 1 token per 10 ms
    decisions = run_plain_or_drafted(policy, 16, committed=1)  # a plain round takes 4 ms
    probes_after = [len(gap) for gap in "".join("x" if d else "." for d in decisions).split("x")[:-1]]
    assert probes_after == [1, 2, 4, 4]


def test_a_probe_that_pays_resumes_drafting():
    policy = AutoBudget(cost(0.02))
    assert run_plain_or_drafted(policy, 5, committed=1)[-1] is False
    assert run_plain_or_drafted(policy, 8, committed=12) == [True] * 8  # a probe, then the drafter has its footing


def test_keeps_drafting_when_it_pays():
    policy = AutoBudget(cost(0.02))
    for _ in range(8):
        drafted(policy, committed=6)
    policy.observe(RoundStats(0, 0, committed=1, verify_ms=4.0), path=[0])
    assert policy.drafts(0)


def test_a_loop_that_lookup_drafts_whole_is_left_to_lookup():
    """Drafted rounds commit 16 tokens in 10 ms; a round without the drafter, whose lookup branch of 15 has
    been accepting 14 tokens a round, would commit 15 in the price of a 16-token verify: no draft then."""
    policy = AutoBudget(cost(0.02))
    for _ in range(8):
        drafted(policy, committed=16)
    policy.observe(RoundStats(0, 0, committed=1, verify_ms=4.0), path=[0])  # what a plain round costs
    assert policy._drafting_pays(0, 0.0, 0)  # against a plain round with no branch
    assert not policy._drafting_pays(0, 14.0, 15)
    assert policy._drafting_pays(0, 0.5, 2)


def test_a_seam_where_lookup_just_missed_brings_no_draft_back_while_plain_rounds_run_faster():
    """JSON the demo target writes under a grammar: runs of whitespace lookup drafts whole, misses at the structure
    between them. Drafted rounds commit 10 tokens in 4 ms; plain rounds, 8 in 1.2 ms then 1 in 0.5 ms, 5.3 a ms
    over both. Just after a miss lookup's recent score is low and a plain round looks like one token; the
    plain rounds' measured rate still says no draft. Without that measure, the seam would bring one back."""
    policy = AutoBudget(cost(0.02))
    for _ in range(8):
        drafted(policy, committed=10, step_ms=4.0)
    assert policy._drafting_pays(0, 0.2, 1)  # nothing measured of plain rounds but their cost
    for _ in range(10):
        policy.observe(RoundStats(0, 8, committed=8, verify_ms=1.2), path=[0])
        policy.observe(RoundStats(0, 0, committed=1, verify_ms=0.5), path=[0])
    assert not policy._drafting_pays(0, 0.2, 1)
    assert policy.learned.plain_committed / policy.learned.plain_ms > 4


def test_drafting_goes_on_near_break_even_but_resumes_only_where_it_clearly_pays():
    """Drafted and plain rounds both commit 2.5 tokens a ms: drafting goes on (down to `skip_below` of plain rounds),
    but once stopped it does not resume there (a resume restarts the probes' backoff: under a grammar it flapped,
    journal 2026-12-07); drafted rounds at 1.2x plain rounds' rate bring it back, where the sequence's latest probe
    (of the text at hand) did as well as the average (which remembers the texts before it)."""
    policy = AutoBudget(cost(0.02))
    for _ in range(8):
        drafted(policy, committed=10, step_ms=4.0)
    for _ in range(20):
        policy.observe(RoundStats(0, 0, committed=1, verify_ms=0.4), path=[0])
    m = policy.learned
    assert m.committed / m.drafted_ms == pytest.approx(m.plain_committed / m.plain_ms, rel=0.05)
    m.drafting = True
    assert policy._drafting_pays(0, 0.0, 0)
    m.drafting = False
    assert not policy._drafting_pays(0, 0.0, 0)
    m.drafted_ms /= 1.2
    policy.probed = 1.2 * m.plain_committed / m.plain_ms
    assert policy._drafting_pays(0, 0.0, 0)
    policy.probed /= 1.2  # this text's latest probe at par: the average alone brings no draft back
    assert not policy._drafting_pays(0, 0.0, 0)
    assert not AutoBudget(cost(0.02), m)._drafting_pays(0, 0.0, 0)  # nor in a sequence that has not probed


def test_no_probe_while_plain_rounds_commit_nearly_a_block():
    """Plain rounds whose lookup branch commits whole blocks leave a draft (16 tokens at most) nothing to
    add: no probe then. A branch that commits 4 tokens leaves room: probes."""
    policy = AutoBudget(cost(0.02), block=16)
    for _ in range(8):
        drafted(policy, committed=16)

    def plain_rounds(lookup: tuple[float, int], committed: int) -> list[bool]:
        decisions = []
        for _ in range(12):
            decisions.append(policy.drafts(0, lookup))
            if decisions[-1]:
                drafted(policy, committed=1)  # a probe that does not pay
            else:
                policy.observe(RoundStats(0, lookup[1], committed=committed, verify_ms=4.0), path=[0])
        return decisions

    assert not any(plain_rounds((14.5, LOOKUP_MAX), 16))
    assert any(plain_rounds((3.0, 7), 4))


def test_candidate_tree_follows_the_last_choice():
    policy = AutoBudget(cost(0.5))
    assert policy.candidates() == MAX_AUTO_BUDGET
    chosen = round_tree(policy).size
    assert chosen < 20 and policy.candidates() == max(16, chosen * 3 // 2 + 4)


def test_a_lone_sequence_stops_growing_past_its_best_size_and_chooses_as_the_whole_candidate_tree_would():
    from ddscope.policy.auto import PAST_PEAK
    logprobs = drafter_logits(0.6)
    policy = AutoBudget(cost(0.3))
    candidates = policy.candidates()
    whole = policy.prepare(0, logprobs)  # a batch's call: every candidate grown
    policy._prepared = None
    chosen = policy.tree(0, logprobs, 0)
    assert len(whole) == candidates and chosen.size == policy._size(whole, 0) < candidates - PAST_PEAK
    grown = []
    policy.prepare(0, logprobs, lambda lp, k: lambda tree, node: grown.append(node) or per_depth(lp, k)(tree, node),
                   ctx=0)
    assert len(policy._prepared.tokens) - 1 == chosen.size + PAST_PEAK  # no node past those asked for children
    assert len(grown) == chosen.size + PAST_PEAK


def test_auto_skips_drafts_for_a_useless_drafter_and_stays_lossless(tiny_engine, virtual_time):
    engine = virtual_time.use(tiny_engine)
    prompt = [5, 6, 7, 8]
    ref = engine.generate(prompt, max_new_tokens=120, method="ar", ignore_eos=True)
    out = engine.generate(prompt, max_new_tokens=120, method="ddtree", budget="auto", ignore_eos=True)
    assert out.token_ids == ref.token_ids
    drafted = [r.drafted for r in out.stats.rounds]  # not nodes: a lookup branch is verified without a draft
    assert sum(drafted) < len(drafted) / 4, "the random drafter should be dropped ..."
    assert sum(drafted[drafted.index(False):]) >= 3, "... with periodic probes"


def test_auto_drafts_for_an_accepted_drafter_and_stays_lossless(tiny_engine, virtual_time):
    """An oracle always right, at a real drafter's price (tests/support/virtual_time.py): drafting pays, and `auto`
    drafts all but the plain rounds it runs to measure them."""
    prompt = [5, 6, 7, 8]
    ref = tiny_engine.generate(prompt, max_new_tokens=120, method="ar", ignore_eos=True)
    out = virtual_time.use(oracle_engine(tiny_engine)).generate(prompt, max_new_tokens=120, method="ddtree",
                                                                budget="auto", ignore_eos=True)
    assert out.token_ids == ref.token_ids
    assert out.stats.to_dict()["avg_commit"] > 6  # of the block's 8: plain rounds commit 1


def test_a_new_request_starts_from_what_the_pair_learned():
    """Drafting did not pay on the last request under this sampler: the next one starts plain, with no
    warm-up rounds to find it out again; one where drafting paid starts drafting."""
    learned = Learned()
    run_plain_or_drafted(AutoBudget(cost(0.02), learned), 12, committed=1)
    assert run_plain_or_drafted(AutoBudget(cost(0.02), learned), 1, committed=1) == [False]
    good = Learned()
    run_plain_or_drafted(AutoBudget(cost(0.02), good), 8, committed=12)
    assert run_plain_or_drafted(AutoBudget(cost(0.02), good), 3, committed=12) == [True] * 3


def test_plain_rounds_are_measured_now_and_then():
    """A policy that keeps drafting still runs a plain round about every 60, so that what a plain round
    costs is measured rather than borrowed from the tree rounds' overhead."""
    policy = AutoBudget(cost(0.02))
    decisions = run_plain_or_drafted(policy, 200, committed=12)
    plain = [i for i, d in enumerate(decisions) if not d]
    assert 2 <= len(plain) <= 5 and all(b - a > 40 for a, b in zip(plain, plain[1:]))


def _linear_cost(base: float = 4.0, per_token: float = 0.1, per_ctx_token: float = 0.0) -> VerifyCost:
    ctx = [0, 4096]
    return VerifyCost(ctx, list(NODE_GRID), [[base + n * (per_token + c * per_ctx_token) for n in NODE_GRID]
                                            for c in ctx])


def test_the_batchs_trees_shrink_as_the_batch_grows():
    """The same candidates (chances 0.9, 0.8, ... along a chain) for every sequence: alone a sequence gets a
    deep tree; among 16 the step's rows cost more than most of those nodes commit, so each gets fewer."""
    chances = [math.log(max(0.9 - 0.05 * i, 0.01)) for i in range(40)]
    budget = BatchBudget(_linear_cost())
    alone = budget.sizes([chances], [[]], [100], [], draft_ms=2.0, commits=0)[0][0]
    together = budget.sizes([chances] * 16, [[]] * 16, [100] * 16, [], draft_ms=6.0, commits=0)[0]
    assert alone >= 10 and len(set(together)) == 1 and 0 < together[0] < alone
    # the best chances anywhere in the batch go first: a sequence whose drafts are poor gets fewer nodes
    poor = [c - 2.0 for c in chances]
    mixed = budget.sizes([chances, poor], [[], []], [100, 100], [], draft_ms=2.0, commits=0)[0]
    assert mixed[0] > mixed[1]


def test_lookup_branches_compete_with_the_trees_for_the_batchs_rows():
    """A branch whose tokens are likelier than a tree's nodes takes rows from the trees (its own sequence's
    and the others'); a branch that rarely hits gets none; in a plain step (no trees) a good branch is still
    verified, and among 16 sequences the rows' cost cuts every branch short."""
    budget = BatchBudget(_linear_cost())
    tree = [math.log(max(0.6 - 0.05 * i, 0.01)) for i in range(40)]
    loop = DDTree(8)
    loop.lookup_gain = 6.0  # a loop: about six hits a round
    loop.lookup_hits, loop.lookup_misses = 6.0, 1.0  # each token right 6 times in 7
    history = [1, 2, 3, 4, 5, 6, 7] * 4
    good = loop.branch_chances(history)
    assert len(good) == LOOKUP_MAX and good == sorted(good, reverse=True)  # lookup's whole proposal
    assert math.isclose(sum(math.exp(c) for c in good), 6.0 * (1 - (6 / 7) ** LOOKUP_MAX), rel_tol=1e-6)
    poor = [k * math.log(0.05) for k in range(1, 4)]
    sizes, lengths = budget.sizes([tree, tree], [good, poor], [100, 100], [], draft_ms=2.0, commits=0)
    alone, _ = budget.sizes([tree, tree], [[], []], [100, 100], [], draft_ms=2.0, commits=0)
    assert lengths[0] >= 8 and lengths[1] == 0
    assert sizes[0] <= alone[0] and sum(sizes) < sum(alone)  # the branch's rows came out of the trees
    _, plain = budget.sizes([[], []], [good, poor], [100, 100], [], draft_ms=0.0, commits=0)
    assert plain[0] >= 8 and plain[1] == 0
    _, crowded = budget.sizes([[]] * 16, [good] * 16, [100] * 16, [], draft_ms=0.0, commits=0)
    assert all(0 < n < plain[0] for n in crowded)
    # the length chosen is grafted; a fixed budget's drafted round grafts what the branch earned
    loop.branch = 3
    grafted = loop.tree(7, None, SamplingParams(), 27, history)
    assert grafted.tokens == [7, 1, 2, 3]
    assert len(loop.tree(7, None, SamplingParams(), 28, history + [1]).tokens) == 1 + loop._branch_length()


def test_a_plain_round_takes_as_much_of_a_run_as_lookups_chances_pay_for_not_what_rounds_earned():
    """Just past a seam (a miss cut the decayed score to about one token a round) lookup still has its run right
    nine times in ten: a plain `auto` round verifies most of the proposal, not the two tokens the score earned
    (a round scores only what it committed, so the score would take rounds to double back). Where lookup is
    seldom right, the same round verifies nothing of it."""
    policy = AutoBudget(_linear_cost(base=4.0, per_token=0.1))
    proposer = DDTree(policy)
    history = [5] * 40  # a run: lookup proposes LOOKUP_MAX more of it
    proposer.lookup_gain, proposer.lookup_hits, proposer.lookup_misses = 0.6, 9.0, 1.0
    assert proposer._propose(history) == 2  # what the rounds earned
    tree = proposer.tree(5, None, SamplingParams(), 100, history)
    assert tree.size >= 8 and tree.tokens == [5] * (1 + tree.size)
    proposer.lookup_hits, proposer.lookup_misses = 0.2, 9.8  # right one time in fifty
    assert proposer.tree(5, None, SamplingParams(), 100, history + [5]).size == 0


def test_the_batch_stops_drafting_where_plain_steps_commit_faster_and_probes_now_and_then():
    budget = BatchBudget(_linear_cost(), probe_every=8)
    decisions = []
    for _ in range(60):
        drafted = budget.drafts(16)
        decisions.append(drafted)
        rate = 0.5 if drafted else 1.0  # tokens per ms: plain wins at this size
        budget.observe(16, drafted, committed=int(rate * 20), step_ms=20.0, verify_ms=10.0, predicted_ms=10.0)
    assert decisions[0] is True  # drafting is measured first
    tail = decisions[20:]
    assert 0 < sum(tail) <= len(tail) // 4  # mostly plain, with drafted probes
    other = BatchBudget(_linear_cost(), probe_every=8)  # drafting wins: mostly drafted, plain probes
    decisions = []
    for _ in range(60):
        drafted = other.drafts(4)
        decisions.append(drafted)
        other.observe(4, drafted, committed=40 if drafted else 8, step_ms=20.0, verify_ms=10.0, predicted_ms=10.0)
    assert len(decisions[20:]) - 8 <= sum(decisions[20:]) < len(decisions[20:])
    # a step that also prefilled (its mode not the policy's choice, its time partly the chunk's) teaches
    # the cost prediction only
    rates, run = dict(other.rates), dict(other.run)
    other.observe(4, False, committed=4, step_ms=200.0, verify_ms=40.0, predicted_ms=10.0, chosen=False)
    assert other.rates == rates and other.run == run and other.ratio > 1.0


def test_a_plain_round_verifies_only_the_lookup_branch_its_chances_pay_for():
    """Where a verified token costs 0.7 of a plain forward (a long context), a branch that lookup seldom gets
    right is not verified at all, one it nearly always gets right is verified whole, and a middling one in
    part; where tokens are nearly free, even that one is verified whole."""
    costly, cheap = AutoBudget(_linear_cost(1.0, 0.7)), AutoBudget(_linear_cost(4.0, 0.01))
    chances = {p: [k * math.log(p) for k in range(1, 13)] for p in (0.2, 0.7, 0.995)}
    assert costly.branch(chances[0.2], 100) == 0
    assert 0 < costly.branch(chances[0.7], 100) < 12
    assert costly.branch(chances[0.995], 100) == 12
    assert cheap.branch(chances[0.2], 100) > 0 and cheap.branch(chances[0.7], 100) == 12
    assert cheap.branch([], 100) == 0


def test_lookups_chance_counts_no_miss_where_the_committed_tokens_ran_out():
    """A plain round commits one token: lookup's proposal right on it is a hit and no miss (what followed was
    never tested), so a loop's chance climbs while its branch goes unverified; a wrong first token is a miss."""
    from ddscope.speculative.stats import RoundStats

    proposer = DDTree(budget=4)
    history = [1, 2, 3, 4, 1, 2, 3]
    for token in (4, 1, 2, 3, 4, 1):  # the loop goes on, one committed token a round
        proposer.tree(history[-1], None, SamplingParams(), 0, history)
        proposer.observe(RoundStats(0, 0, 1), [0], [token])
        history.append(token)
    right = proposer.lookup_hits / (proposer.lookup_hits + proposer.lookup_misses)
    assert right > 0.9
    proposer.tree(history[-1], None, SamplingParams(), 0, history)
    proposer.observe(RoundStats(0, 0, 1), [0], [9])  # it proposed 2
    assert proposer.lookup_hits / (proposer.lookup_hits + proposer.lookup_misses) < right


def rounds_with_law(policy: AutoBudget, rounds: int, law_top: list[float],
                    ctx: int = 0) -> tuple[list[bool], int, list[bool]]:
    """Rounds from context `ctx` on, one token each, whose plain roots report the target's top-4 probabilities
    whenever the policy asks: (drafted or not, each round; how many were asked; features kept, each round)."""
    decisions, asked, kept = [], 0, []
    for i in range(rounds):
        decisions.append(policy.drafts(ctx + i))
        kept.append(policy.captures)
        if decisions[-1]:
            drafted(policy, 1)
        else:
            rnd = RoundStats(ctx + i, 0, committed=1, verify_ms=4.0)
            asked += policy.wants_law_top
            rnd.law_top = list(law_top) if policy.wants_law_top else None
            policy.observe(rnd, path=[0])
    return decisions, asked, kept


def test_no_probe_where_the_targets_own_law_rules_out_any_drafter():
    """A node is accepted with the target's probability of its token: where the target's top-4 hold 0.3, 0.1,
    0.05 and 0.05 (a flat law, sampled), even a drafter that knew it would commit under 0.6 tokens a round, at
    a draft's and a tree's cost, so after the warm-up no probe is sent; where the target is sure of its next
    token (0.97), probes go on with their back-off."""
    flat, sure = AutoBudget(cost(0.02), probe_every=16), AutoBudget(cost(0.02), probe_every=16)
    for policy, law in ((flat, [0.3, 0.1, 0.05, 0.05]), (sure, [0.97, 0.01, 0.01, 0.005])):
        assert rounds_with_law(policy, 4, law)[0] == [True] * 4  # warm-up
    decisions, asked, _ = rounds_with_law(flat, 96, [0.3, 0.1, 0.05, 0.05])
    assert not any(decisions[4:]) and flat.learned.probe_gap == 16
    assert asked < 96 // 4  # the law is read only near each gap's end
    assert sum(rounds_with_law(sure, 96, [0.97, 0.01, 0.01, 0.005])[0]) >= 5


def test_features_pause_where_drafting_is_ruled_out_and_a_probe_waits_for_the_drafters_reach():
    """With a drafter that reaches 20 positions back, `auto` stops keeping features once the target's law rules
    drafting out; when the law turns sure, features resume and the probe waits until the drafter's whole reach
    holds fresh ones (20 rounds of one token), then drafts. A drafter that sees all context never pauses."""
    flat, sure = [0.3, 0.1, 0.05, 0.05], [0.97, 0.01, 0.01, 0.005]
    policy, whole = AutoBudget(cost(0.02), probe_every=16, reach=20), AutoBudget(cost(0.02), probe_every=16)
    decisions, _, kept = rounds_with_law(policy, 4, flat, ctx=100)
    assert decisions == [True] * 4 and all(kept)  # warm-up
    decisions, _, _ = rounds_with_law(policy, 40, flat, ctx=104)
    assert not any(decisions) and not policy.captures
    assert AutoBudget(cost(0.02), policy.learned, reach=20).captures is False  # the next request starts paused
    decisions, _, kept = rounds_with_law(policy, 60, sure, ctx=144)
    first = decisions.index(True)
    resumed = kept.index(True)
    assert first - resumed >= 20 and all(kept[resumed:first + 1])
    rounds_with_law(whole, 44, flat)
    assert whole.captures and whole.learned.ruled_out


def test_rounds_where_the_law_rules_drafting_out_run_as_ar_until_the_law_is_read_again():
    """Once the target's law rules every drafter out, the rounds before the next reading of it are quiet: no draft,
    no lookup proposal grafted or scored, no step time learned, only the count towards the next probe. The
    rounds that read the law again (the last eighth of the gap) weigh everything as before, lookup included."""
    flat = [0.3, 0.1, 0.05, 0.05]
    policy = AutoBudget(cost(0.02), probe_every=16)
    rounds_with_law(policy, 4 + 40, flat)  # warm-up, then ruled out
    assert policy.learned.ruled_out and policy.learned.probe_gap == 16
    proposer = DDTree(policy)
    proposer.rounds = DDTree.TRUSTED_AFTER
    proposer.lookup_gain, proposer.lookup_hits, proposer.lookup_misses = 6.0, 6.0, 1.0  # a loop lookup would draft
    history = [1, 2, 3, 4] * 8
    quiet = looked = 0
    for i in range(32):
        ctx = 200 + i
        gain, ratio, since = proposer.lookup_gain, policy.learned.plain_ratio, policy.since_draft
        assert not proposer.drafts(ctx)
        was_quiet = proposer._quiet
        tree = proposer.tree(history[-1], None, SamplingParams(temperature=0.7), ctx, history)
        rnd = RoundStats(ctx, tree.size, committed=1, verify_ms=4.0)
        rnd.law_top = list(flat) if policy.wants_law_top else None
        proposer.observe(rnd, [0], [history[len(history) % 4]])
        history.append(history[len(history) % 4])
        if was_quiet:
            quiet += 1
            assert tree.size == 0 and proposer.lookup_gain == gain and policy.learned.plain_ratio == ratio
            assert policy.since_draft == since + 1
        else:
            looked += 1
            assert proposer.lookup_gain != gain  # lookup proposed and was scored
    assert quiet >= 24 and looked >= 2
