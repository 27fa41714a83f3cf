"""The prefix cache's block store: what it keeps, what it gives back, and what it evicts."""
from __future__ import annotations

import torch

from ddscope.config import DecoderGeometry
from ddscope.model import KVCache
from ddscope.prefix_cache import BLOCK, PrefixCache


def _cache(fill: float, length: int) -> KVCache:
    g = DecoderGeometry(hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                        rms_norm_eps=1e-6, rope_theta=10000.0, qk_norm=False)
    cache = KVCache(g, 8 * BLOCK, torch.device("cpu"), torch.float32)
    cache.k[:, :, :length] = torch.arange(length, dtype=torch.float32)[None, None, :, None] + fill
    cache.v[:, :, :length] = -cache.k[:, :, :length]
    cache.length = length
    return cache


def _features(fill: float) -> torch.Tensor:
    return torch.arange(8 * BLOCK * 3, dtype=torch.float32).view(8 * BLOCK, 3) + fill


def test_longest_whole_block_prefix_comes_back_exactly():
    tokens = list(range(3 * BLOCK + 10))
    store = PrefixCache(1 << 30)
    target, features = _cache(0.5, 2 * BLOCK + 5), _features(7.0)
    store.save(tokens, target, features)
    assert len(store.blocks) == 2  # the target holds two whole blocks: only those are complete
    fresh_t, fresh_f = _cache(0.0, 0), _features(0.0) * 0
    other = tokens[:BLOCK + 3] + [9999] + tokens[BLOCK + 4:]  # diverges inside the second block
    assert store.load(other, fresh_t, fresh_f) == BLOCK
    assert store.load(tokens, fresh_t, fresh_f) == 2 * BLOCK
    assert fresh_t.length == 2 * BLOCK
    assert torch.equal(fresh_t.k[:, :, :2 * BLOCK], target.k[:, :, :2 * BLOCK])
    assert torch.equal(fresh_f[:2 * BLOCK], features[:2 * BLOCK]) and not fresh_f[2 * BLOCK:].any()


def test_one_token_is_always_left_to_prefill():
    tokens = list(range(2 * BLOCK))
    store = PrefixCache(1 << 30)
    store.save(tokens + [1], _cache(0.0, 2 * BLOCK), None)
    assert store.load(tokens, _cache(0.0, 0), None) == BLOCK  # the last block would leave nothing


def test_target_only_blocks_serve_ar_not_a_drafter():
    tokens = list(range(2 * BLOCK + 1))
    store = PrefixCache(1 << 30)
    store.save(tokens, _cache(0.0, 2 * BLOCK), None)  # an `ar` request: no drafter context
    assert store.load(tokens, _cache(0.0, 0), _features(0.0)) == 0
    assert store.load(tokens, _cache(0.0, 0), None) == 2 * BLOCK
    store.save(tokens, _cache(0.0, 2 * BLOCK), _features(1.0))  # now with the drafter's
    assert store.load(tokens, _cache(0.0, 0), _features(0.0)) == 2 * BLOCK


def test_least_recently_used_blocks_go_first_within_the_budget():
    a, b = list(range(BLOCK + 1)), list(range(1000, 1000 + BLOCK + 1))
    one = PrefixCache(1 << 30)
    one.save(a, _cache(0.0, BLOCK), None)
    store = PrefixCache(one.bytes)  # room for one block
    store.save(a, _cache(0.0, BLOCK), None)
    store.save(b, _cache(0.0, BLOCK), None)
    assert store.bytes <= store.max_bytes and len(store.blocks) == 1
    assert store.load(a, _cache(0.0, 0), None) == 0 and store.load(b, _cache(0.0, 0), None) == BLOCK
    assert PrefixCache(0).load(a, _cache(0.0, 0), None) == 0


def test_engine_outputs_are_the_same_with_and_without_the_cache():
    """Demo pair, drafts really accepted: a repeated prompt and one sharing its head are served from the
    cache, and every method's output equals a cache-less engine's."""
    from ddscope.bench.workloads import fit_ids, load_workload
    from ddscope.engine import Engine

    cached, plain = Engine.load(), Engine.load(prefix_cache_mb=0)
    head = fit_ids(load_workload("padding"), 0, 700, cached.tokenizer)
    # `other` shares 10 whole blocks; its first draft reads none of the two that `head` saved without features
    other = head[:640] + cached.encode(" Something else entirely, then continue:")
    for method, budget in (("dflash", None), ("ddtree", 32), ("ar", None)):
        for prompt in (head, head, other):
            got = cached.generate(prompt, max_new_tokens=48, method=method, budget=budget, ignore_eos=True)
            want = plain.generate(prompt, max_new_tokens=48, method=method, budget=budget, ignore_eos=True)
            assert got.token_ids == want.token_ids, (method, len(prompt))
            assert want.stats.cached_tokens == 0
            if method != "ar":
                assert got.stats.to_dict()["avg_commit"] > 1.5  # drafts were accepted
        assert got.stats.cached_tokens == 640
    assert cached.generate(head, max_new_tokens=4, method="ar").stats.cached_tokens == 640


def test_server_reports_cached_tokens_in_usage_and_metrics():
    import httpx

    from ddscope.bench.workloads import fit_ids, load_workload
    from ddscope.engine import Engine
    from ddscope.server.launch import serve_in_background

    engine = Engine.load()
    prompt = fit_ids(load_workload("padding"), 0, 300, engine.tokenizer)
    with serve_in_background(engine=engine, method="dflash") as url, httpx.Client(timeout=120) as client:
        usages = [client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
                  .json()["usage"] for _ in range(2)]
        metrics = client.get(f"{url}/metrics").text
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 256]
    assert 'ddscope:cached_prompt_tokens_total{model_name="target"} 256.0' in metrics


def test_a_hit_gives_the_drafter_the_features_a_prefill_would(tiny_engine):
    """A request that never drafted (`ar`-like plain rounds) still leaves the target features of every cached
    position, so a later hit drafts exactly as after a full prefill."""
    from ddscope.decoding import Decoder
    from ddscope.proposers import DDTree
    from ddscope.sampling import SamplingParams

    e = tiny_engine
    prompt = list(range(5, 5 + 2 * BLOCK + 9))
    full = Decoder(e.target, e.drafter, DDTree(4), e.cache, e.draft_cache, SamplingParams(), None)
    full.prefill(prompt)
    want = e.draft_cache.features[:len(prompt)].clone()
    store = PrefixCache(1 << 30)
    store.save(prompt, e.cache, e.draft_cache.features)
    e.draft_cache.features.zero_()
    hit = Decoder(e.target, e.drafter, DDTree(4), e.cache, e.draft_cache, SamplingParams(), None)
    cached = store.load(prompt, e.cache, e.draft_cache.features)
    hit.prefill(prompt, cached)
    assert cached == 2 * BLOCK and e.draft_cache.length == 0
    torch.testing.assert_close(e.draft_cache.features[:len(prompt)], want, atol=1e-5, rtol=1e-4)
