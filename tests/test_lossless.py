"""Greedy DDTree/DFlash equal greedy AR token for token; sampling draws from the target's law."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ddscope import Engine
from ddscope.decoding import Decoder
from ddscope.model import rope
from ddscope.testing import make_drafter, make_target, oracle_engine


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2] + torch.randint(3, 40, (n - 2,), generator=g).tolist()
    return [torch.randint(4, vocab, (m,), generator=g).tolist() for m in lengths]


@pytest.fixture(scope="module")
def ar_references(tiny_engine):
    """12 prompts (lengths 1 to 39) and their 160-token greedy AR continuations."""
    return [(p, tiny_engine.generate(p, max_new_tokens=160, method="ar", ignore_eos=True).token_ids)
            for p in prompts(tiny_engine.vocab_size, 12, seed=3)]


@pytest.fixture(scope="module")
def oracle(tiny_engine):
    """Right at 70% of depths, with the target's choice second where wrong: long accepted paths, full
    blocks, sibling acceptance and compaction at every depth."""
    return oracle_engine(tiny_engine, accuracy=0.7)


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16),
                                           ("ddtree", 64), ("ddtree", "auto")])
def test_greedy_equals_ar(oracle, ar_references, method, budget):
    block = oracle.drafter.block_size
    deepest = block if method == "dflash" or budget == "auto" else min(budget, block - 1) + 1
    longest = committed = steps = 0
    for i, (prompt, ref) in enumerate(ar_references):
        out = oracle.generate(prompt, max_new_tokens=160, method=method, budget=budget, ignore_eos=True)
        assert out.token_ids == ref, f"prompt {i}: {method} diverged from ar"
        assert out.stats.completion_tokens == 160
        longest = max(longest, max(int(k) for k in out.stats.to_dict()["commit_histogram"]))
        committed, steps = committed + out.stats.committed_tokens, steps + out.stats.verify_steps
    assert longest == deepest, f"deepest accepted path {longest} < {deepest}: the test lost its power"
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
    for step in engine.stream(prompt, max_new_tokens=120, method="ddtree", budget=16, ignore_eos=True):
        committed += step.token_ids
        if step.finish_reason:
            break
        if step.round is not None:  # not the prefill's token
            depths.add(step.round.committed)
        n = len(committed) - 1
        assert engine.cache.length == n
        fresh = engine.target.new_cache(n + 1)
        feats = engine.target(torch.tensor(committed[:-1]), torch.arange(n), fresh,
                              capture=engine.drafter.cfg.target_layer_ids).features
        torch.testing.assert_close(engine.cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(engine.cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-5, rtol=1e-4)
        # the drafter's context cache matches the same features, projected
        m = engine.draft_cache.length
        g = engine.drafter.cfg.geometry
        with torch.inference_mode():
            ctx = engine.drafter.context(feats[:m])
            cos, sin = rope(torch.arange(m), g.head_dim, g.rope_theta, ctx.dtype)
            k0, _ = engine.drafter.layers[0].self_attn.key_value(ctx, cos, sin)
        torch.testing.assert_close(engine.draft_cache.k[0, :, :m], k0, atol=1e-5, rtol=1e-4)
    assert len(depths) >= 4, f"compaction exercised at too few depths: {sorted(depths)}"


@pytest.fixture(scope="module")
def small_vocab_engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("v16")
    target = make_target(d / "t", "qwen3", vocab_size=16, init_std=0.1)
    return Engine.load(target, make_drafter(d / "d", target, block_size=4))


def exact_two_token_law(engine, prompt: list[int]) -> np.ndarray:
    """P(t1, t2) under the target at temperature 1, computed directly."""
    t = engine.target
    with torch.inference_mode():
        cache = t.new_cache(len(prompt) + 2)
        p1 = t(torch.tensor(prompt), torch.arange(len(prompt)), cache).logits[-1].softmax(-1)
        law = np.zeros((16, 16))
        for a in range(16):
            c = t.new_cache(len(prompt) + 2)
            p2 = t(torch.tensor(prompt + [a]), torch.arange(len(prompt) + 1), c).logits[-1].softmax(-1)
            law[a] = (p1[a] * p2).numpy()
    return law


def sample_pairs(engine, prompt, n: int) -> np.ndarray:
    counts = np.zeros((16, 16))
    for s in range(n):
        ids = engine.generate(prompt, max_new_tokens=2, method="ddtree", budget=8, temperature=1.0, seed=s,
                              ignore_eos=True).token_ids
        counts[ids[0], ids[1]] += 1
    return counts


def chi2_pvalue(counts: np.ndarray, law: np.ndarray) -> float:
    expected = law.ravel() * counts.sum()
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    obs = np.append(counts.ravel()[~small], counts.ravel()[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def biased_accept(self, tree, logits):
    """A classic bug: take the draft child whenever it is in the target's top-3, else sample."""
    choices = self.sampling.choose(logits, self.generator)
    top3 = logits.topk(3, dim=-1).indices.tolist()
    children = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if i}
    path = [0]
    while True:
        cur = path[-1]
        nxt = next((children[(cur, t)] for t in top3[cur] if (cur, t) in children), None)
        if nxt is None:
            return path, choices
        path.append(nxt)


def test_ddtree_sampling_matches_target_law_and_detects_bias(small_vocab_engine, monkeypatch):
    engine, prompt = small_vocab_engine, [5, 9, 7]
    law = exact_two_token_law(engine, prompt)
    p_fair = chi2_pvalue(sample_pairs(engine, prompt, 3000), law)
    assert p_fair > 1e-3, f"ddtree sampling departs from the target law (p={p_fair:.2e})"
    monkeypatch.setattr(Decoder, "accept", biased_accept)
    p_biased = chi2_pvalue(sample_pairs(engine, prompt, 3000), law)
    assert p_biased < 1e-6, f"the chi-square test failed to catch a biased sampler (p={p_biased:.2e})"
