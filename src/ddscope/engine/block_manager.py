"""The pool's blocks: who holds each (reference counts) and which prefixes they hold (the prefix cache).

A full block of committed tokens is registered under a key that stands for every token up to its end:
a BLAKE2b digest of its parent's key and its own tokens, so two blocks share a key only if their whole
prefixes are equal (vLLM's automatic prefix caching; a Python `hash()` chain could collide). A new
sequence takes the longest run of registered blocks that spells its prompt's head, shared and
zero-copy. Blocks nobody holds stay registered until they are needed, least recently freed first.
"""
from __future__ import annotations

import bisect
import hashlib
from array import array
from collections import OrderedDict

from ddscope.engine.limits import MAX_BUDGET
from ddscope.models.drafter import Drafter
from ddscope.models.kv_pool import BLOCK, KVPool, Pages
from ddscope.models.target import Target
from ddscope.speculative.lookup import LOOKUP_MAX


class OutOfBlocks(RuntimeError):
    pass


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class FreeRuns:
    """Disjoint runs [start, end) of free block ids, merged as blocks come back, lowest first: the lowest free
    block and the lowest run of a length cost the runs, not the blocks (a GPU pool has 100k of them)."""

    def __init__(self, n: int):
        self.starts: list[int] = [0] if n else []
        self.end: dict[int, int] = {0: n} if n else {}  # start -> end
        self.start_of: dict[int, int] = {n: 0} if n else {}  # end -> start
        self.count = n

    def __len__(self) -> int:
        return self.count

    def __contains__(self, b: int) -> bool:
        i = bisect.bisect_right(self.starts, b) - 1
        return i >= 0 and b < self.end[self.starts[i]]

    def lowest(self) -> int | None:
        return self.starts[0] if self.starts else None

    def first_fit(self, length: int) -> int | None:
        """The start of the lowest run of at least `length` free blocks."""
        return next((a for a in self.starts if self.end[a] - a >= length), None)

    def add(self, b: int) -> None:
        a, e = self.start_of.pop(b, b), self.end.pop(b + 1, b + 1)  # merge with the runs either side
        if a != b:
            del self.end[a]
        else:
            bisect.insort(self.starts, b)
        if e != b + 1:
            self.starts.remove(b + 1)
            del self.start_of[e]
        self._set(a, e)
        self.count += 1

    def take(self, a: int, n: int = 1) -> None:
        """Remove [a, a + n), which must be free and inside one run."""
        i = bisect.bisect_right(self.starts, a) - 1
        start = self.starts[i]
        end = self.end.pop(start)
        del self.start_of[end]
        if start < a:
            self._set(start, a)
        else:
            del self.starts[i]
        if a + n < end:
            bisect.insort(self.starts, a + n)
            self._set(a + n, end)
        self.count -= n

    def _set(self, a: int, e: int) -> None:
        self.end[a], self.start_of[e] = e, a


class BlockManager:
    def __init__(self, blocks: int, block: int = BLOCK, prefix_cache: bool = True):
        self.blocks, self.block, self.prefix_cache = blocks, block, prefix_cache
        self.refs = [0] * blocks
        self.plain = FreeRuns(blocks)  # free, holding nothing anyone can reuse, kept for nobody
        self.cached: OrderedDict[int, None] = OrderedDict()  # free but registered, least recently freed first
        self.index: dict[bytes, int] = {}  # key -> block
        self.key_of: dict[int, bytes] = {}
        self.featured: set[int] = set()  # registered blocks whose drafter features are valid
        self.soft: dict[int, int] = {}  # empty block -> the pages (id) it is kept for, to grow into in a row
        self.kept: dict[int, tuple[int, set[int]]] = {}  # pages (id) -> (its run's start, the blocks still kept)

    @property
    def free(self) -> int:
        return len(self.plain) + len(self.soft) + len(self.cached)

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
            last = (new or pages.table or [None])[-1]
            start = self.kept[id(pages)][0] if id(pages) in self.kept else None
            new.append(self._take(start if last is None else last + 1, id(pages)))
        pages.extend(new)

    def _keep_run(self, pages: Pages, length: int) -> None:
        """Keep the lowest run of `length` empty blocks nobody else keeps for `pages` to grow into."""
        start = self.plain.first_fit(length)
        if start is None:
            return
        self.plain.take(start, length)
        run = set(range(start, start + length))
        self.soft.update(dict.fromkeys(run, id(pages)))
        self.kept[id(pages)] = (start, run)

    def _take(self, wanted: int | None, owner: int) -> int:
        """A free block: `wanted` (None: any) if it is empty and nobody else keeps it, or if it is registered and
        free (a table in a row is read as a view, a gathered one copies the whole context every step, which
        costs more than a divergent tail's chance of a later hit), else the lowest empty block nobody keeps,
        else one kept for another, else the least recently freed registered one."""
        if wanted is not None and (self.soft.get(wanted) == owner
                                   or (wanted not in self.soft and wanted in self.plain)):
            b = wanted
        elif wanted in self.cached:
            return self._reclaim(wanted)
        elif len(self.plain):
            b = self.plain.lowest()
        elif self.soft:
            b = next(iter(self.soft))
        else:
            return self._reclaim(next(iter(self.cached)))
        if b in self.soft:
            self.kept[self.soft.pop(b)][1].discard(b)
        else:
            self.plain.take(b)
        self.refs[b] = 1
        return b

    def _reclaim(self, b: int) -> int:
        """Registered and free block `b`, unregistered and held."""
        del self.cached[b]
        self._forget(b)
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

    def register(self, pages: Pages, tokens: list[int], length: int, features: tuple[int, int | None] | None) -> None:
        """Register `pages`' full blocks below `length` (their K/V final) not registered yet; those within
        `features`, (from, to) positions (to None: on to the end; None: no features), hold the drafter's
        features too."""
        if not self.prefix_cache:
            return
        for i in range(len(pages.keys), length // self.block):
            start = i * self.block
            key = block_key(pages.keys[-1] if pages.keys else pages.salt, tokens[start:start + self.block])
            pages.keys.append(key)
            b = pages.table[i]
            featured = features is not None and start >= features[0] and (
                features[1] is None or start + self.block <= features[1])
            old = self.index.get(key)
            if old is not None and old != b and (old in self.featured or not featured):
                continue  # an equal block is registered already
            if old is not None and old != b:  # ours has the features the registered one lacks
                self._forget(old)
                if old in self.cached:
                    del self.cached[old]
                    self.plain.add(old)
            self.index[key], self.key_of[b] = b, key
            if featured:
                self.featured.add(b)

    def release(self, pages: Pages) -> None:
        """Drop `pages`' hold on its blocks: registered ones stay reusable, the rest become empty."""
        _, still = self.kept.pop(id(pages), (0, set()))
        for b in still:
            del self.soft[b]
            self.plain.add(b)
        for b in pages.table:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.key_of:
                    self.cached[b] = None
                else:
                    self.featured.discard(b)
                    self.plain.add(b)
        pages.clear()

    def clear_cache(self) -> None:
        """Forget every free registered block (the prefix cache emptied)."""
        for b in list(self.cached):
            del self.cached[b]
            self._forget(b)
            self.plain.add(b)


def sized_pool(target: Target, drafter: Drafter | None, max_model_len: int, kv_cache_mb: int, prefix_cache: bool,
               max_num_seqs: int) -> tuple[KVPool, BlockManager]:
    """The pool of `kv_cache_mb` for a native target (and drafter), allocated now; it must hold at least one
    sequence of max_model_len and its round, and is cut to what `max_num_seqs` such sequences can fill (a tiny
    model's pool is small)."""
    dg, fdim = (drafter.cfg.geometry, drafter.fc.in_features) if drafter is not None else (None, 0)
    p = target.lm_head.weight
    per_block = KVPool.block_bytes(target.cfg.geometry, dg, fdim, p.dtype)
    blocks = (kv_cache_mb << 20) // per_block
    need = -(-(max_model_len + 1 + MAX_BUDGET + LOOKUP_MAX) // BLOCK)
    if blocks < need:
        raise ValueError(f"kv_cache_mb={kv_cache_mb} holds {blocks} blocks of {BLOCK} tokens; one sequence of "
                         f"max_model_len {max_model_len} needs {need} ({-(-need * per_block >> 20)} MB)")
    blocks = min(blocks, max_num_seqs * need)
    return KVPool(target.cfg.geometry, dg, fdim, blocks, p.device, p.dtype), BlockManager(blocks, BLOCK, prefix_cache)
