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


def test_longest_whole_block_prefix_comes_back_exactly():
    tokens = list(range(3 * BLOCK + 10))
    store = PrefixCache(1 << 30)
    target, drafter = _cache(0.5, len(tokens) - 1), _cache(7.0, 2 * BLOCK + 5)
    store.save(tokens, target, drafter)
    assert len(store.blocks) == 2  # the drafter holds two whole blocks: only those are complete
    fresh_t, fresh_d = _cache(0.0, 0), _cache(0.0, 0)
    other = tokens[:BLOCK + 3] + [9999] + tokens[BLOCK + 4:]  # diverges inside the second block
    assert store.load(other, fresh_t, fresh_d) == BLOCK
    assert store.load(tokens, fresh_t, fresh_d) == 2 * BLOCK
    assert fresh_t.length == fresh_d.length == 2 * BLOCK
    assert torch.equal(fresh_t.k[:, :, :2 * BLOCK], target.k[:, :, :2 * BLOCK])
    assert torch.equal(fresh_d.v[:, :, :2 * BLOCK], drafter.v[:, :, :2 * BLOCK])


def test_one_token_is_always_left_to_prefill():
    tokens = list(range(2 * BLOCK))
    store = PrefixCache(1 << 30)
    store.save(tokens + [1], _cache(0.0, 2 * BLOCK), None)
    assert store.load(tokens, _cache(0.0, 0), None) == BLOCK  # the last block would leave nothing


def test_target_only_blocks_serve_ar_not_a_drafter():
    tokens = list(range(2 * BLOCK + 1))
    store = PrefixCache(1 << 30)
    store.save(tokens, _cache(0.0, 2 * BLOCK), None)  # an `ar` request: no drafter context
    assert store.load(tokens, _cache(0.0, 0), _cache(0.0, 0)) == 0
    assert store.load(tokens, _cache(0.0, 0), None) == 2 * BLOCK
    store.save(tokens, _cache(0.0, 2 * BLOCK), _cache(1.0, 2 * BLOCK))  # now with the drafter's
    assert store.load(tokens, _cache(0.0, 0), _cache(0.0, 0)) == 2 * BLOCK


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
