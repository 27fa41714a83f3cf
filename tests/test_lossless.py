"""Greedy DDTree/DFlash equal greedy AR token for token (sampling: test_sampling_law.py)."""
import pytest
import torch

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.models.layers import rope
from support.tolerance import assert_same_sums, sums_depth


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2] + torch.randint(3, 40, (n - 2,), generator=g).tolist()
    return [torch.randint(4, vocab, (m,), generator=g).tolist() for m in lengths]


@pytest.fixture(scope="module")
def ar_references(tiny_engine):
    """8 prompts (lengths 1 to 39) and their 160-token greedy AR continuations."""
    return [(p, tiny_engine.generate(p, max_new_tokens=160, method="ar", ignore_eos=True).token_ids)
            for p in prompts(tiny_engine.vocab_size, 8, seed=3)]


@pytest.fixture(scope="module")
def oracle(tiny_engine):
    """Right at 70% of depths, with the target's choice second where wrong: long accepted paths, full
    blocks, sibling acceptance and compaction at every depth."""
    return oracle_engine(tiny_engine, accuracy=0.7)


@pytest.fixture(scope="module")
def perfect(tiny_engine):
    """Always right, for `auto`: under virtual time (tests/support/virtual_time.py), at a real drafter's price,
    drafting then pays, so its trees are tested; at its own price (block - 1 target forwards) it could at
    best break even, and what `auto` chose went with this machine's load."""
    return oracle_engine(tiny_engine)


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16),
                                           ("ddtree", 64), ("ddtree", "auto")])
def test_greedy_equals_ar(oracle, perfect, ar_references, virtual_time, method, budget):
    engine = virtual_time.use(perfect) if budget == "auto" else oracle
    block = engine.drafter.block_size
    deepest = block if method == "dflash" or budget == "auto" else min(budget, block - 1) + 1
    longest = committed = steps = 0
    for i, (prompt, ref) in enumerate(ar_references):
        out = engine.generate(prompt, max_new_tokens=160, method=method, budget=budget, ignore_eos=True)
        assert out.token_ids == ref, f"prompt {i}: {method} diverged from ar"
        assert out.stats.completion_tokens == 160
        longest = max(longest, max(int(k) for k in out.stats.to_dict()["commit_histogram"]))
        committed, steps = committed + out.stats.committed_tokens, steps + out.stats.verify_steps
    # >=: a prompt-lookup branch (ddtree) may reach past the drafter's tree where the text repeats
    assert longest >= deepest, f"deepest accepted path {longest} < {deepest}: the test lost its power"
    assert committed / steps > 1.5


def test_greedy_equals_ar_with_a_drafter_never_accepted(tiny_engine, ar_references):
    """The random drafter, on purpose: nearly every round rejects the whole tree."""
    for prompt, ref in ar_references[:4]:
        out = tiny_engine.generate(prompt, max_new_tokens=160, method="ddtree", budget=16, ignore_eos=True)
        assert out.token_ids == ref
        assert out.stats.to_dict()["avg_commit"] < 1.3


def test_cache_equals_fresh_prefill_after_every_round(oracle):
    engine = oracle
    prompt = prompts(engine.vocab_size, 3, seed=5)[2]
    committed = list(prompt)
    depths = set()
    seq = engine.sequence(prompt, max_new_tokens=120, method="ddtree", budget=16, ignore_eos=True)
    cache, draft_cache, pool = seq.decoder.cache, seq.decoder.draft_cache, engine.pool
    geo = engine.target.cfg.geometry
    depth = sums_depth(geo, len(prompt) + 120)
    for step in engine.follow(seq):
        committed += step.token_ids
        if step.finish_reason:
            break
        if step.round is not None:  # not the prefill's token
            depths.add(step.round.committed)
        n = len(committed) - 1
        assert cache.length == n
        slots = cache.pages.slots(0, n)
        fresh = engine.target.new_cache(n + 1)
        feats = engine.target(torch.tensor(committed[:-1]), torch.arange(n), fresh,
                              capture=engine.drafter.cfg.target_layer_ids).features
        assert_same_sums(pool.k[:, :, slots], fresh.k[:, :, :n], depth)
        assert_same_sums(pool.v[:, :, slots], fresh.v[:, :, :n], depth)
        # the drafter's context holds the same features, and its K/V (what it has taken in) their projection
        assert_same_sums(draft_cache.features[:n], feats, depth)
        m = draft_cache.length
        first = 0 if engine.drafter.horizon is None else max(0, m - engine.drafter.horizon)
        g = engine.drafter.cfg.geometry
        with torch.inference_mode():
            ctx = engine.drafter.context(feats[first:m])
            cos, sin = rope(torch.arange(first, m), g.head_dim, g.rope_theta, ctx.dtype)
            k0, _ = engine.drafter.layers[0].self_attn.key_value(ctx, cos, sin)
        assert_same_sums(pool.dk[0][:, cache.pages.slots(first, m)], k0, depth + g.hidden_size)
    assert len(depths) >= 4, f"compaction exercised at too few depths: {sorted(depths)}"
