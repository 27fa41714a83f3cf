"""vLLM's penalties, allowed_token_ids and bad_words are the target's law at every tree node, each node under
its own history: `dflash` and `ddtree` equal `ar` (greedy and seeded sampling) through accepted trees, and `ar`
equals a plain reference decode that applies vLLM's formulas (model_executor/layers/utils.py:43-80 in 0.32)."""
from __future__ import annotations

import pytest
import torch

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.speculative.law import bad_word_ids
from ddscope.speculative.tree import DraftTree

PROMPT = "def add(a, b):"
LAWS = {
    "repetition": dict(repetition_penalty=1.6),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=1.2),
    "all three": dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.5),
}


@pytest.fixture(scope="module")
def oracle(tiny_engine):
    return oracle_engine(tiny_engine)


def run(engine, method: str, **kw):
    return engine.generate(PROMPT, max_new_tokens=32, method=method, ignore_eos=True, budget=16, **kw)


def accepted(out) -> int:
    return sum(r.committed - 1 for r in out.stats.rounds)


def reference(engine, prompt: list[int], steps: int, rep: float = 1.0, freq: float = 0.0,
              pres: float = 0.0) -> list[int]:
    """Greedy decoding by full forwards, the penalties written out from vLLM's apply_penalties."""
    out: list[int] = []
    for _ in range(steps):
        ids = prompt + out
        cache = engine.target.new_cache(len(ids) + 1)
        logits = engine.target(torch.tensor(ids), torch.arange(len(ids)), cache).logits[-1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt] = True
        seen |= counts > 0
        factor = torch.where(seen, torch.tensor(rep), torch.tensor(1.0))
        logits = torch.where(logits > 0, logits / factor, logits * factor)
        logits = logits - freq * counts - pres * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("name", list(LAWS))
def test_penalties_equal_ar_and_a_plain_reference(oracle, name):
    kw = LAWS[name]
    outs = {m: run(oracle, m, **kw) for m in ("ar", "dflash", "ddtree")}
    plain = run(oracle, "ar").token_ids
    assert outs["ar"].token_ids != plain, "the penalty changed nothing: the test would prove nothing"
    rep, freq = kw.get("repetition_penalty", 1.0), kw.get("frequency_penalty", 0.0)
    pres = kw.get("presence_penalty", 0.0)
    assert outs["ar"].token_ids == reference(oracle, oracle.encode(PROMPT), 32, rep, freq, pres)
    for m in ("dflash", "ddtree"):
        assert outs[m].token_ids == outs["ar"].token_ids, m
        assert accepted(outs[m]) > 0, f"{m}: no draft accepted, the tree path went untested"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_field_at_once_under_every_method(oracle, temperature):
    vocab = oracle.vocab_size
    plain = run(oracle, "ar").token_ids
    allowed = sorted(set(range(vocab)) - {plain[2], plain[5]})  # two tokens the target wanted, out
    kw = dict(temperature=temperature, seed=11, repetition_penalty=1.2, frequency_penalty=0.4,
              allowed_token_ids=allowed, bad_words=[oracle.tokenizer.decode(plain[8:10])])
    outs = {m: run(oracle, m, **kw) for m in ("ar", "dflash", "ddtree")}
    assert set(outs["ar"].token_ids) <= set(allowed)
    for m in ("dflash", "ddtree"):
        assert outs[m].token_ids == outs["ar"].token_ids, (m, temperature)
        assert accepted(outs[m]) > 0, m


def test_a_node_sees_its_own_path_not_the_roots(oracle, monkeypatch):
    """The test above can fail: a verify that penalizes with the root's history is caught."""
    kw = dict(frequency_penalty=1.5, repetition_penalty=1.4)
    good = run(oracle, "ar", **kw).token_ids
    monkeypatch.setattr(DraftTree, "paths", lambda self: [[] for _ in self.tokens])
    assert run(oracle, "ddtree", **kw).token_ids != good


def test_bad_words_are_never_completed(oracle):
    plain = run(oracle, "ar").token_ids
    word = oracle.tokenizer.decode(plain[4:7])
    out = run(oracle, "ddtree", bad_words=[word])
    assert accepted(out) > 0
    for ids in bad_word_ids(oracle.tokenizer, [word], oracle.vocab_size):
        n = len(ids)
        assert all(tuple(out.token_ids[i:i + n]) != ids for i in range(len(out.token_ids) - n + 1)), ids


def test_bad_words_tokenize_as_vllm(oracle):
    tok = oracle.tokenizer
    ids = bad_word_ids(tok, ["fox"], oracle.vocab_size)
    bare = tuple(tok.encode("fox", add_special_tokens=False))
    spaced = tuple(tok.encode(" fox", add_special_tokens=False))
    assert ids[0] == bare
    assert (spaced in ids) == (spaced[0] != bare[0] and len(spaced) == len(bare))
    with pytest.raises(ValueError, match="empty"):
        bad_word_ids(tok, [""], oracle.vocab_size)


@pytest.mark.parametrize("kw, match", [
    (dict(repetition_penalty=0.0), "greater than zero"),
    (dict(presence_penalty=2.5), r"\[-2, 2\]"),
    (dict(frequency_penalty=-3.0), r"\[-2, 2\]"),
    (dict(allowed_token_ids=[]), "empty"),
    (dict(allowed_token_ids=[10**6]), "allowed_token_ids"),
])
def test_bad_values_are_refused(oracle, kw, match):
    with pytest.raises(ValueError, match=match):
        oracle.sequence(PROMPT, **kw)
