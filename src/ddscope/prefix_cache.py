"""Prefix cache: the target K/V and the drafter's context (the target features it drafts from) of earlier
requests, reused for the longest common token prefix of a new prompt, so a repeated long prompt is not
prefilled again.

Storage is in fixed blocks of `BLOCK` positions keyed by a hash chain over the tokens up to each
block's end, the scheme of vLLM's automatic prefix caching: a block depends on every token before
it, and so stands for the whole prefix. A batched engine can later map each sequence's block table
onto the same blocks. Blocks are evicted least recently used, within a byte budget. Reuse is exact in
what is attended to: every cached position's K/V, and its target features, are a function of the tokens
up to it. Only the arithmetic of the prefill differs (a suffix instead of the whole prompt), as in every
serving engine with prefix caching.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ddscope.model import KVCache

BLOCK = 64


@dataclass
class Block:
    tokens: tuple[int, ...]  # kept to rule out hash collisions
    k: torch.Tensor  # target [layers, kv_heads, BLOCK, head_dim]
    v: torch.Tensor
    features: torch.Tensor | None = None  # [BLOCK, feature_dim] for the drafter; None when its request had none

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.features) if t is not None)


def block_keys(tokens: list[int], n_blocks: int) -> list[int]:
    """The hash chain of the first `n_blocks` blocks: each key covers every token up to its end."""
    keys, key = [], 0
    for b in range(n_blocks):
        key = hash((key, tuple(tokens[b * BLOCK:(b + 1) * BLOCK])))
        keys.append(key)
    return keys


def _slice(cache: KVCache, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.k[:, :, start:start + BLOCK].clone(), cache.v[:, :, start:start + BLOCK].clone()


class PrefixCache:
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"the prefix cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[int, Block] = OrderedDict()
        self.bytes = 0

    def load(self, tokens: list[int], cache: KVCache, features: torch.Tensor | None, features_from: int = 0) -> int:
        """Copy the longest cached whole-block prefix of `tokens` into the target cache, and into `features`
        the drafter's features of its positions from `features_from` on (the drafter reads no older ones),
        leaving at least one token to prefill; returns its length."""
        n = 0
        for key in block_keys(tokens, (len(tokens) - 1) // BLOCK):
            block = self.blocks.get(key)
            if block is None or block.tokens != tuple(tokens[n:n + BLOCK]):
                break
            wanted = features is not None and n + BLOCK > features_from
            if wanted and block.features is None:
                break
            cache.k[:, :, n:n + BLOCK], cache.v[:, :, n:n + BLOCK] = block.k, block.v
            if wanted:
                features[n:n + BLOCK] = block.features
            self.blocks.move_to_end(key)
            n += BLOCK
        cache.length = n
        return n

    def save(self, tokens: list[int], cache: KVCache, features: torch.Tensor | None, features_from: int = 0) -> None:
        """Keep the whole blocks of `tokens` the target cache holds, with their features when given and valid
        (those of the same positions, from `features_from` on: a prefill computes none further back)."""
        if self.max_bytes == 0:
            return
        for b, key in enumerate(block_keys(tokens, min(cache.length, len(tokens)) // BLOCK)):
            start = b * BLOCK
            with_features = features is not None and start >= features_from
            old = self.blocks.get(key)
            if old is not None and (old.features is not None or not with_features):
                self.blocks.move_to_end(key)
                continue
            block = Block(tuple(tokens[start:start + BLOCK]), *_slice(cache, start))
            if with_features:
                block.features = features[start:start + BLOCK].clone()
            self._put(key, block)

    def _put(self, key: int, block: Block) -> None:
        old = self.blocks.pop(key, None)
        self.bytes -= old.nbytes if old is not None else 0
        self.blocks[key] = block
        self.bytes += block.nbytes
        while self.bytes > self.max_bytes and self.blocks:
            self.bytes -= self.blocks.popitem(last=False)[1].nbytes

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes = 0
