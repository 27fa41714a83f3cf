"""The KV caches. `KVCache`: one sequence's slots in order. The paged one: one pool of fixed blocks holding, per
slot, the target's K/V, the drafter's K/V and the target features the drafter drafts from; each sequence sees
its own slots through its block table.

A sequence whose blocks lie in a row (the common case: blocks are handed out in order) reads its K/V
as a view, so a batch of one costs what a contiguous cache does; a fragmented table gathers them.
"""
from __future__ import annotations

import torch

from ddscope.config import DecoderGeometry
from ddscope.models import pages

BLOCK = 64  # slots a block; the prefix cache shares whole blocks


def zeroed(shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """K/V storage, zeroed now as vLLM allocates its KV cache at start-up: the memory is held from the start (no
    OOM later) and no step pays for first touching it. On CPU, on 2 MiB pages: a decode step streams its keys
    and values whole, and on 4 KiB pages its attention took 4-5% longer (docs/journal.md)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    return pages.huge(shape, dtype).zero_()


class KVCache:
    """Preallocated per-layer K/V in slot order; `length` slots are valid."""

    def __init__(self, g: DecoderGeometry, capacity: int, device: torch.device, dtype: torch.dtype):
        shape = (g.num_layers, g.num_kv_heads, capacity, g.head_dim)
        self.k, self.v = zeroed(shape, device, dtype), zeroed(shape, device, dtype)
        self.capacity = capacity
        self.length = 0

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[1]
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def run(self, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
        """K/V [layers, kv_heads, slots, d] and the slot of position 0: its slots lie in one run."""
        return self.k, self.v, 0

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Move the accepted tree slots `start + slots` to `[start, start + len(slots))` and truncate."""
        n = slots.numel()
        src = slots + start
        self.k[:, :, start:start + n] = self.k.index_select(2, src)
        self.v[:, :, start:start + n] = self.v.index_select(2, src)
        self.length = start + n


class Pages:
    """A sequence's block table and the slot of each of its positions."""

    def __init__(self, block: int = BLOCK, device: torch.device | str = "cpu", salt: str | None = None):
        self.block, self.device = block, torch.device(device)  # the pool's: slot indices live beside it
        # The prefix-cache key its first block chains from: a tenant's salt keeps its entries apart (vLLM's
        # cache_salt), since a shared hit is a timing side channel.
        self.salt = b"" if salt is None else b"salt:" + salt.encode("utf-8")
        self.table: list[int] = []
        self.keys: list[bytes] = []  # the prefix-cache keys of its leading full blocks, once registered
        self._map: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return len(self.table) * self.block

    def extend(self, blocks: list[int]) -> None:
        if blocks:
            self.table += blocks
            self._map = None

    def clear(self) -> None:
        self.table, self.keys, self._map = [], [], None

    @property
    def contiguous(self) -> bool:
        t = self.table
        return not t or t[-1] - t[0] == len(t) - 1 and all(b - a == 1 for a, b in zip(t, t[1:]))

    def slots(self, a: int, b: int) -> slice | torch.Tensor:
        """The pool slots of positions [a, b): a slice where the table is a run of blocks."""
        if self._map is None:
            self._build()
        if isinstance(self._map, int):
            return slice(self._map + a, self._map + b)
        return self._map[a:b]

    def index(self, positions: torch.Tensor) -> torch.Tensor:
        """The pool slots of these positions."""
        s = self.slots(0, self.capacity)
        return positions + s.start if isinstance(s, slice) else s[positions]

    def _build(self) -> None:
        if self.contiguous:
            self._map = self.table[0] * self.block if self.table else 0
        else:
            t = torch.tensor(self.table, dtype=torch.long, device=self.device)
            self._map = (t[:, None] * self.block + torch.arange(self.block, device=self.device)).flatten()


class PagedCache:
    """`KVCache`'s interface (`length`, `capacity`, `write`, `keep`) over one sequence's slots of a pool."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, pages: Pages, features: torch.Tensor | None = None):
        self.k, self.v, self.pages = k, v, pages  # [layers, kv_heads, slots, head_dim]
        self.features = PagedRows(features, pages) if features is not None else None
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.pages.capacity

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[1]
        dst, every = self.pages.slots(start, end), self.pages.slots(0, end)
        if isinstance(dst, slice):
            self.k[layer, :, dst], self.v[layer, :, dst] = k, v
            return self.k[layer, :, every], self.v[layer, :, every]
        self.k[layer].index_copy_(1, dst, k)
        self.v[layer].index_copy_(1, dst, v)
        return self.k[layer].index_select(1, every), self.v[layer].index_select(1, every)

    def run(self, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """`Cache.run`: the pool's K/V and the slot of position 0, where positions [0, length + rows) are a run."""
        every = self.pages.slots(0, self.length + rows)
        return (self.k, self.v, every.start) if isinstance(every, slice) else None

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Move the accepted tree slots `start + slots` to `[start, start + len(slots))` and truncate."""
        n = slots.numel()
        src, dst = self.pages.index(slots + start), self.pages.slots(start, start + n)
        for t in (self.k, self.v):
            moved = t.index_select(2, src)
            if isinstance(dst, slice):
                t[:, :, dst] = moved
            else:
                t.index_copy_(2, dst, moved)
        self.length = start + n


class PagedRows:
    """A [slots, dim] pool tensor indexed by a sequence's positions, as `DrafterCache.features` is."""

    def __init__(self, storage: torch.Tensor, pages: Pages):
        self.storage, self.pages = storage, pages

    def _slots(self, span: slice) -> slice | torch.Tensor:
        return self.pages.slots(span.start or 0, span.stop)

    def __getitem__(self, span: slice) -> torch.Tensor:
        s = self._slots(span)
        return self.storage[s] if isinstance(s, slice) else self.storage.index_select(0, s)

    def __setitem__(self, span: slice, value: torch.Tensor) -> None:
        s = self._slots(span)
        if isinstance(s, slice):
            self.storage[s] = value
        else:
            self.storage.index_copy_(0, s, value)


class KVPool:
    """The storage: target K/V, and for a drafter its K/V and the target features, for `blocks` blocks."""

    def __init__(self, target: DecoderGeometry, drafter: DecoderGeometry | None, feature_dim: int, blocks: int,
                 device: torch.device, dtype: torch.dtype, block: int = BLOCK):
        self.blocks, self.block = blocks, block
        slots = blocks * block

        def kv(g: DecoderGeometry) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (g.num_layers, g.num_kv_heads, slots, g.head_dim)
            return zeroed(shape, device, dtype), zeroed(shape, device, dtype)

        self.k, self.v = kv(target)
        self.dk, self.dv = kv(drafter) if drafter is not None else (None, None)
        self.features = zeroed((slots, feature_dim), device, dtype) if drafter is not None else None

    @staticmethod
    def block_bytes(target: DecoderGeometry, drafter: DecoderGeometry | None, feature_dim: int,
                    dtype: torch.dtype, block: int = BLOCK) -> int:
        per_slot = 2 * target.num_layers * target.num_kv_heads * target.head_dim
        if drafter is not None:
            per_slot += 2 * drafter.num_layers * drafter.num_kv_heads * drafter.head_dim + feature_dim
        return per_slot * block * torch.finfo(dtype).bits // 8

    def target_cache(self, pages: Pages) -> PagedCache:
        return PagedCache(self.k, self.v, pages)

    def drafter_cache(self, pages: Pages) -> PagedCache:
        return PagedCache(self.dk, self.dv, pages, self.features)
