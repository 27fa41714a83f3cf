"""Prompt lookup: the copied continuation, its branch in the tree, and what it does to a real generation."""
import torch

from ddscope.speculative.lookup import LOOKUP_MAX, Lookup
from ddscope.speculative.proposers import DDTree
from ddscope.speculative.sampling import SamplingParams
from ddscope.speculative.tree import chain
from support.virtual_time import DEMO


def test_copies_what_followed_the_last_ngram():
    look = Lookup(n=2)
    assert look.propose([1, 2, 3, 4, 9, 1, 2], 3) == [3, 4, 9]
    assert look.propose([5, 6, 7], 4) == []  # never seen before
    assert Lookup(n=3).propose([1, 2], 2) == []  # shorter than an n-gram


def test_a_short_cycle_repeats_past_the_end():
    tokens = [7, 8, 9] + [1, 2] * 3
    assert Lookup(n=2).propose(tokens, 6) == [1, 2, 1, 2, 1, 2]


def test_the_index_grows_with_the_text():
    look, tokens = Lookup(n=2), [1, 2, 3]
    assert look.propose(tokens, 2) == []
    tokens += [4, 1, 2]  # the same list, grown, as the decoder's
    assert look.propose(tokens, 2) == [3, 4]
    tokens += [5, 1, 2]
    assert look.propose(tokens, 1) == [5]  # the latest occurrence


def test_graft_shares_the_nodes_that_spell_its_start():
    tree = chain(10, [11, 12, 13])
    path = tree.graft([11, 12, 20, 21])
    assert path == {1, 2, 4, 5} and tree.size == 5
    assert tree.parents[4:] == [2, 4] and tree.depths[4:] == [3, 4]
    assert tree.walk([11, 12, 20, 0, 21, 0].__getitem__) == [0, 1, 2, 4, 5]  # choices by node index


def test_a_budget_caps_the_drafters_tree_and_the_lookup_branch_comes_on_top():
    proposer = DDTree(budget=8)
    history = [1, 2, 3, 4] * 4  # lookup proposes 1 2 3 ...: a branch of 3 (its gain starts at 1)
    logits = torch.randn(15, 64, generator=torch.Generator().manual_seed(0))
    tree = proposer.tree(history[-1], logits, SamplingParams(), len(history) - 1, history)
    alone = DDTree(budget=8, lookup=False).tree(history[-1], logits, SamplingParams(), len(history) - 1, history)
    assert alone.size == 8 and tree.tokens[:alone.size + 1] == alone.tokens  # the drafter's tree, then the graft
    assert 8 < tree.size <= 8 + LOOKUP_MAX


def test_rounds_of_a_fixed_budget_verify_more_nodes_once_the_text_loops(tiny_engine):
    """The tiny target's greedy text ends in a run of one token, which lookup grafts onto budget 8's trees: a
    budget bounds a round's nodes only with LOOKUP_MAX on top (what tests/test_server.py may assert)."""
    out = tiny_engine.generate([5, 6, 7, 8], max_new_tokens=80, method="ddtree", budget=8, ignore_eos=True)
    nodes = [r.nodes for r in out.stats.rounds]
    assert max(nodes) > 8 and all(n <= 8 + LOOKUP_MAX for n in nodes), nodes


def test_the_demo_targets_code_loop_is_drafted_by_lookup(virtual_time):
    """On a long HumanEval prompt the demo target loops (`\"\"\"` and an indent, over and over), which the
    short-context drafter commits about 2 tokens a step on (the bundled one, trained on long code, drafts it
    well); the lookup branch commits nearly whole blocks, and the output is still `ar`'s."""
    from ddscope.bench.running.workloads import fit_ids, load_workload
    from ddscope.engine import Engine
    from ddscope.engine.limits import DEMO_DIR

    engine = virtual_time.use(Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter-short"), DEMO)
    prompt = fit_ids(load_workload("code"), 0, 1663, engine.tokenizer)
    ref = engine.generate(prompt, max_new_tokens=96, method="ar", ignore_eos=True).token_ids
    assert ref[-4:] == ref[-6:-2] == ref[-8:-4], "the target no longer loops here: the test has no power"
    dflash = engine.generate(prompt, max_new_tokens=96, method="dflash", ignore_eos=True)
    for budget in (4, "auto"):
        out = engine.generate(prompt, max_new_tokens=96, method="ddtree", budget=budget, ignore_eos=True)
        assert out.token_ids == dflash.token_ids == ref
        commit, base = out.stats.to_dict()["avg_commit"], dflash.stats.to_dict()["avg_commit"]
        assert commit > 2 * base and commit > 4, (budget, commit, base)


def test_auto_leaves_the_drafter_out_of_a_loop_that_lookup_drafts_whole(virtual_time):
    """Padding at 13 tokens: the demo target loops on `"The ` and the lookup branch commits whole blocks by
    itself, so `auto` runs rounds without a draft that commit far more than the root; same output."""
    from ddscope.bench.running.workloads import fit_ids, load_workload
    from ddscope.engine import Engine

    engine = virtual_time.use(Engine.load(), DEMO)
    prompt = fit_ids(load_workload("padding"), 0, 13, engine.tokenizer)
    ref = engine.generate(prompt, max_new_tokens=256, method="ar", ignore_eos=True).token_ids
    out = engine.generate(prompt, max_new_tokens=256, method="ddtree", budget="auto", ignore_eos=True)
    assert out.token_ids == ref
    undrafted = [r.committed for r in out.stats.rounds if not r.drafted]
    assert sum(c >= 8 for c in undrafted) >= 3, undrafted
    assert 0 < out.stats.to_dict()["drafted_steps"] < out.stats.verify_steps
    whole = next(i for i, r in enumerate(out.stats.rounds) if not r.drafted and r.committed == 16)
    assert sum(r.drafted for r in out.stats.rounds[whole:]) <= 1  # a draft has nothing to add: no probes




def test_lookup_is_scored_against_the_committed_tokens_grafted_or_not():
    """With the lookup gain spent, a plain round verifies the root alone, whatever lookup proposes; the
    tokens the round commits score the proposal all the same (those right before the first miss), and
    once they match, the next round grafts a branch for real."""
    from ddscope.speculative.stats import RoundStats

    proposer = DDTree(budget=4)
    proposer.lookup_gain = 0.0

    def round_on(history: list[int], committed: list[int]) -> int:
        size = proposer.tree(history[-1], None, SamplingParams(), 0, history).size
        proposer.observe(RoundStats(0, size, len(committed)), [0], committed)
        history += committed  # the decoder's list grows in place
        return size

    history = [1, 2, 3, 4, 1, 2, 3]
    assert round_on(history, [7]) == 0 and proposer.lookup_gain == 0.0  # lookup proposed 4 1 2 3 ...
    assert round_on(history, [1, 2, 3]) == 0 and proposer.lookup_gain == 0.0  # 2 3 7: never seen, no proposal
    assert round_on(history, [7, 1, 2, 3]) == 0  # lookup proposes what followed 1 2 3 last time: 7 1 2 3 7 ...
    assert abs(proposer.lookup_gain - 0.3 * 4) < 1e-12  # four right, none of them verified
    tree = proposer.tree(history[-1], None, SamplingParams(), 0, history)
    assert tree.tokens[1:] == [7, 1, 2]  # a branch of 2 x 1.2 + 1 = 3
