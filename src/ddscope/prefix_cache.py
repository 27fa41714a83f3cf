"""Prefix cache: the target K/V and the drafter's context K/V of earlier requests, reused for the
longest common token prefix of a new prompt, so a repeated long prompt is not prefilled again.

Storage is in fixed blocks of `BLOCK` positions keyed by a hash chain over the tokens up to each
block's end, the scheme of vLLM's automatic prefix caching: a block depends on every token before
it, and so stands for the whole prefix. A batched engine can later map each sequence's block table
onto the same blocks. Blocks are evicted least recently used, within a byte budget. Reuse is exact in
what is attended to: every cached position's K/V is a function of the tokens up to it (the drafter's
context K/V too: it projects target features at that position). Only the arithmetic of the prefill
differs (a suffix instead of the whole prompt), as in every serving engine with prefix caching.
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
    draft_k: torch.Tensor | None = None  # drafter context K/V; None when its request ran no drafter
    draft_v: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        tensors = (self.k, self.v, self.draft_k, self.draft_v)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


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

    def load(self, tokens: list[int], cache: KVCache, draft_cache: KVCache | None) -> int:
        """Copy the longest cached whole-block prefix of `tokens` into the caches (with the drafter's
        when `draft_cache` is given), leaving at least one token to prefill; returns its length."""
        n = 0
        for key in block_keys(tokens, (len(tokens) - 1) // BLOCK):
            block = self.blocks.get(key)
            if block is None or block.tokens != tuple(tokens[n:n + BLOCK]):
                break
            if draft_cache is not None and block.draft_k is None:
                break
            cache.k[:, :, n:n + BLOCK], cache.v[:, :, n:n + BLOCK] = block.k, block.v
            if draft_cache is not None:
                draft_cache.k[:, :, n:n + BLOCK], draft_cache.v[:, :, n:n + BLOCK] = block.draft_k, block.draft_v
            self.blocks.move_to_end(key)
            n += BLOCK
        cache.length = n
        if draft_cache is not None:
            draft_cache.length = n
        return n

    def save(self, tokens: list[int], cache: KVCache, draft_cache: KVCache | None) -> None:
        """Keep the whole blocks of `tokens` that both caches hold (the target's alone without a drafter)."""
        if self.max_bytes == 0:
            return
        valid = min(cache.length, len(tokens))
        if draft_cache is not None:
            valid = min(valid, draft_cache.length)
        for b, key in enumerate(block_keys(tokens, valid // BLOCK)):
            start = b * BLOCK
            old = self.blocks.get(key)
            if old is not None and (old.draft_k is not None or draft_cache is None):
                self.blocks.move_to_end(key)
                continue
            block = Block(tuple(tokens[start:start + BLOCK]), *_slice(cache, start))
            if draft_cache is not None:
                block.draft_k, block.draft_v = _slice(draft_cache, start)
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
