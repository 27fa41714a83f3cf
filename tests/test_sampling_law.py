"""Sampling is lossless: the first three tokens of every method follow the target's own law, computed
exactly from the target alone (transformers' forward, not ddscope's) with temperature, then top-k, then
top-p applied as sampling.py documents.

Three tokens, because the first comes from the prefill and the second from the first tree's root: only
the third can come from a draft node the target accepted, which is where a tree can go wrong. The
drafter is an oracle (the target's own top tokens), so drafts are accepted and the test asserts they
were. Seeds are fixed, so the chi-square p-values are the same on every run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from ddscope import Engine
from ddscope.bench.synthetic_models import make_drafter, make_target, oracle_engine
from ddscope.speculative.decoder import Decoder

V, PROMPT, N = 32, [5, 9, 7], 250
METHODS = [("ar", None), ("dflash", None), ("ddtree", 1), ("ddtree", 16), ("ddtree", "auto")]
SETTINGS = [(0.3, 0.9, 0), (0.7, 0.9, 0), (1.5, 0.9, 0), (0.3, 1.0, 20), (0.7, 1.0, 20), (1.5, 1.0, 20),
            (1.3, 1.0, 20)]  # (temperature, top_p, top_k)
P_MIN = 1e-3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A small vocabulary, so that the law of three tokens has at most 32^3 cells; two layers, because a
    drafter never reads the last one."""
    return make_target(tmp_path_factory.mktemp("law") / "t", "qwen3", vocab_size=V, init_std=0.6, hidden=32,
                       layers=2)


@pytest.fixture(scope="module")
def engine(target_dir):
    """Block size 2: one drafted depth, all the third token needs; the ddtree 16 tree is 16 siblings wide."""
    plain = Engine.load(target_dir, make_drafter(target_dir.parent / "d", target_dir, block_size=2))
    return oracle_engine(plain)


@pytest.fixture(scope="module")
def logits(target_dir) -> list[np.ndarray]:
    """The target's next-token logits after PROMPT, after PROMPT + [a], after PROMPT + [a, b], for all a, b."""
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))
    with torch.no_grad():
        return [model(torch.hstack([torch.tensor(PROMPT).expand(len(tail), -1), tail])).logits[:, -1].double().numpy()
                for tail in (torch.zeros(1, 0, dtype=torch.long), torch.arange(V)[:, None], grid)]


def filtered(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """Rows of probabilities: logits / T, then keep the top_k largest, then the smallest set reaching top_p."""
    x = logits / temperature
    if top_k:
        x = np.where(x < np.sort(x, axis=-1)[:, -top_k:-top_k + 1], -np.inf, x)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p < 1:
        order = np.argsort(-p, axis=-1)
        sorted_p = np.take_along_axis(p, order, -1)
        keep = np.cumsum(sorted_p, -1) - sorted_p < top_p
        p = np.where(np.take_along_axis(keep, np.argsort(order, -1), -1), p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


def exact_law(logits: list[np.ndarray], setting: tuple) -> np.ndarray:
    """P(t1, t2, t3) as a [V, V, V] array."""
    p1, p2, p3 = (filtered(x, *setting) for x in logits)
    return p1[0][:, None, None] * p2[:, :, None] * p3.reshape(V, V, V)


def pooled_chi2(counts: np.ndarray, law: np.ndarray) -> float:
    """Chi-square p-value. Cells expected below 5 are pooled by their (t1, t2) prefix, then by their t1,
    then all together, so that sparse tails still count."""
    obs, exp = counts.astype(float), law * counts.sum()
    bins_o, bins_e = [], []
    for k in (3, 2, 1):  # cells, then (t1, t2) prefixes, then t1: views of the not yet binned mass
        o, e = obs.reshape(V ** k, -1), exp.reshape(V ** k, -1)
        big = e.sum(1) >= 5
        bins_o += o[big].sum(1).tolist()
        bins_e += e[big].sum(1).tolist()
        o[big], e[big] = 0, 0
    if exp.sum() > 0:
        bins_o.append(obs.sum())
        bins_e.append(exp.sum())
    if len(bins_o) < 2:
        return 1.0  # the filtered law is one sequence
    return float(chisquare(bins_o, np.array(bins_e) * sum(bins_o) / sum(bins_e)).pvalue)


def draw(engine: Engine, setting: tuple, method: str, budget, n: int = N) -> tuple[np.ndarray, int]:
    """n seeded samples of the first three tokens, and the draft tokens the target accepted."""
    temperature, top_p, top_k = setting
    samples, accepted = [], 0
    for seed in range(n):
        out = engine.generate(PROMPT, max_new_tokens=3, method=method, budget=budget, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=seed, ignore_eos=True)
        samples.append(out.token_ids)
        accepted += out.stats.committed_tokens - out.stats.verify_steps
    return np.array(samples), accepted


def counts_of(samples: np.ndarray) -> np.ndarray:
    counts = np.zeros((V, V, V))
    np.add.at(counts, tuple(samples.T), 1)
    return counts


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"T{s[0]}-top_p{s[1]}-top_k{s[2]}")
def test_first_three_tokens_follow_the_target_law(engine, logits, setting):
    law = exact_law(logits, setting)
    reference = None
    for method, budget in METHODS:
        samples, accepted = draw(engine, setting, method, budget)
        name = f"{method} {budget}"
        assert law[tuple(samples.T)].min() > 0, f"{name}: a sample outside the target's filtered support"
        p = pooled_chi2(counts_of(samples), law)
        assert p > P_MIN, f"{name}: samples depart from the target law (p={p:.2e})"
        if method == "ar":
            reference = samples
            continue
        if budget != "auto":  # auto may judge drafting not worth it on so small a target
            assert accepted > 0, f"{name}: no draft token accepted, the tree path went untested"
        # Seeded reproducibility: token i is drawn with the noise of index i, whatever the tree.
        assert np.array_equal(samples, reference), f"{name}: seeded samples differ from ar's"


def biased_accept(self, tree, logits):
    """A classic bug: take the draft child whenever it is in the target's top-3, else sample."""
    choices = self.choose(logits, tree)
    top3 = logits.topk(3, dim=-1).indices.tolist()
    children = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if i}
    path = [0]
    while (nxt := next((children[(path[-1], t)] for t in top3[path[-1]] if (path[-1], t) in children), None)):
        path.append(nxt)
    return path, choices


def test_the_chi_square_catches_a_biased_acceptance(engine, logits, monkeypatch):
    setting = (1.5, 1.0, 20)
    monkeypatch.setattr(Decoder, "accept", biased_accept)
    samples, _ = draw(engine, setting, "ddtree", 16)
    p = pooled_chi2(counts_of(samples), exact_law(logits, setting))
    assert p < 1e-6, f"the chi-square test failed to catch a biased sampler (p={p:.2e})"
