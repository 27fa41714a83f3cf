"""The pool's blocks: who holds each (reference counts) and which prefixes they hold (the prefix cache).

A full block of committed tokens is registered under a key that stands for every token up to its end:
a BLAKE2b digest of its parent's key and its own tokens, so two blocks share a key only if their whole
prefixes are equal (vLLM's automatic prefix caching; a Python `hash()` chain could collide). A new
sequence takes the longest run of registered blocks that spells its prompt's head, shared and
zero-copy. Blocks nobody holds stay registered until they are needed, least recently freed first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from ddscope.kv_pool import BLOCK, Pages


class OutOfBlocks(RuntimeError):
    pass


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, blocks: int, block: int = BLOCK, prefix_cache: bool = True):
        self.blocks, self.block, self.prefix_cache = blocks, block, prefix_cache
        self.refs = [0] * blocks
        self.empty = set(range(blocks))  # free, holding nothing anyone can reuse
        self.cached: OrderedDict[int, None] = OrderedDict()  # free but registered, least recently freed first
        self.index: dict[bytes, int] = {}  # key -> block
        self.key_of: dict[int, bytes] = {}
        self.featured: set[int] = set()  # registered blocks whose drafter features are valid
        self.soft: dict[int, int] = {}  # empty block -> the pages (id) it is kept for, to grow into in a row

    @property
    def free(self) -> int:
        return len(self.empty) + len(self.cached)

    @property
    def used(self) -> int:
        return self.blocks - self.free

    def needed(self, pages: Pages, slots: int) -> int:
        """Blocks `pages` lacks to hold `slots` positions."""
        return max(0, -(-slots // self.block) - len(pages.table))

    def grow(self, pages: Pages, slots: int, expect: int = 0) -> None:
        """Give `pages` room for `slots` positions; OutOfBlocks (and nothing given) when the pool lacks it.
        `expect`: the positions it may grow to, kept free after its blocks while the pool has others, so
        that its table stays a run of blocks (read as a view, not gathered)."""
        n = self.needed(pages, slots)
        if n > self.free:
            raise OutOfBlocks(f"{n} blocks needed, {self.free} free")
        if n and expect and not pages.table:
            self._keep_run(pages, -(-expect // self.block))
        new: list[int] = []
        for _ in range(n):
            new.append(self._take((new or pages.table or [self._run_start(pages) - 1])[-1] + 1, id(pages)))
        pages.extend(new)

    def _keep_run(self, pages: Pages, length: int) -> None:
        """Mark the lowest run of `length` empty blocks nobody else keeps as `pages`' to grow into."""
        start, count, last = 0, 0, -2
        for b in sorted(self.empty):
            if b in self.soft:
                count = 0
                continue
            start, count = (start, count + 1) if count and b == last + 1 else (b, 1)
            last = b
            if count == length:
                self.soft.update(dict.fromkeys(range(start, start + length), id(pages)))
                return

    def _run_start(self, pages: Pages) -> int:
        return min((b for b, owner in self.soft.items() if owner == id(pages)), default=0)

    def _take(self, wanted: int, owner: int) -> int:
        """A free block: `wanted` if it is empty and nobody else keeps it, else the lowest such empty block,
        else any empty one, else the least recently freed registered one, unregistered."""
        if wanted in self.empty and self.soft.get(wanted, owner) == owner:
            b = wanted
        elif self.empty:
            b = min((b for b in self.empty if b not in self.soft), default=None)
            b = min(self.empty) if b is None else b
        else:
            b, _ = self.cached.popitem(last=False)
            self._forget(b)
        self.empty.discard(b)
        self.soft.pop(b, None)
        self.refs[b] = 1
        return b

    def _forget(self, b: int) -> None:
        key = self.key_of.pop(b, None)
        if key is not None and self.index.get(key) == b:
            del self.index[key]
        self.featured.discard(b)

    def match(self, pages: Pages, tokens: list[int], features_from: int | None) -> int:
        """Take the longest registered run of blocks spelling `tokens`' head, leaving at least one token
        out; blocks at or past `features_from` must hold features (None: none needed). Returns its length."""
        if not self.prefix_cache:
            return 0
        parent, n = pages.salt, 0
        for start in range(0, (len(tokens) - 1) // self.block * self.block, self.block):
            key = block_key(parent, tokens[start:start + self.block])
            b = self.index.get(key)
            if b is None or (features_from is not None and start + self.block > features_from
                             and b not in self.featured):
                break
            if self.refs[b] == 0:
                del self.cached[b]
            self.refs[b] += 1
            pages.extend([b])
            pages.keys.append(key)
            parent, n = key, n + self.block
        return n

    def register(self, pages: Pages, tokens: list[int], length: int, features_from: int | None) -> None:
        """Register `pages`' full blocks below `length` (their K/V final) not registered yet; those at or
        past `features_from` (None: no features) hold the drafter's features too."""
        if not self.prefix_cache:
            return
        for i in range(len(pages.keys), length // self.block):
            start = i * self.block
            key = block_key(pages.keys[-1] if pages.keys else pages.salt, tokens[start:start + self.block])
            pages.keys.append(key)
            b = pages.table[i]
            featured = features_from is not None and start >= features_from
            old = self.index.get(key)
            if old is not None and old != b and (old in self.featured or not featured):
                continue  # an equal block is registered already
            if old is not None and old != b:  # ours has the features the registered one lacks
                self._forget(old)
                if old in self.cached:
                    del self.cached[old]
                    self.empty.add(old)
            self.index[key], self.key_of[b] = b, key
            if featured:
                self.featured.add(b)

    def release(self, pages: Pages) -> None:
        """Drop `pages`' hold on its blocks: registered ones stay reusable, the rest become empty."""
        for b in [b for b, owner in self.soft.items() if owner == id(pages)]:
            del self.soft[b]
        for b in pages.table:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.key_of:
                    self.cached[b] = None
                else:
                    self.featured.discard(b)
                    self.empty.add(b)
        pages.clear()

    def clear_cache(self) -> None:
        """Forget every free registered block (the prefix cache emptied)."""
        for b in list(self.cached):
            del self.cached[b]
            self._forget(b)
            self.empty.add(b)
