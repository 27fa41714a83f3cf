"""Native Qwen3/Llama decoder with a preallocated KV cache, explicit positions and boolean masks.

Tree verification needs arbitrary (ancestor-only) masks and positions that repeat across siblings;
owning the forward keeps that exact and independent of the HF Cache API.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from ddscope.config import TargetConfig
from ddscope.models import layers, native
from ddscope.models.kv_pool import KVCache
from ddscope.models.layers import DecoderLayer, PanelLinear, RMSNorm, RopeTable, grouped_bias, pack_linears
from ddscope.models.weights import load_into, read_state_dict


class KVCacheFull(RuntimeError):
    """A forward would write past the cache: the engine's fault or its capacity's, never the request's."""


GROUPED_QUERIES = 128  # up to this many queries (a decode step, a tree) attend grouped; a prefill, not


@dataclass
class ForwardOut:
    logits: torch.Tensor | None    # [rows, vocab]; None where none were asked for
    features: torch.Tensor | None  # [rows, len(capture) * hidden] target hidden states for the drafter


class Cache(Protocol):
    """What a forward writes K/V through: one sequence's slots (`KVCache`, or its pages in a pool)."""
    length: int
    capacity: int

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def run(self, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Where positions [0, length + rows) are one run of slots: K/V [layers, kv_heads, slots, d], position
        0's slot."""
        ...


@dataclass
class Segment:
    """One sequence's rows in a batched forward, written at slots `[cache.length, +n)` of its cache.

    `mask` is a boolean [n, cache.length + n] (True = may attend); None means causal. `tail` (causal only):
    the last layer runs past its K/V for the last `tail` rows alone (0: none), and logits are theirs; nothing
    later reads the other rows' outputs. `features`: the last rows whose captured layers' outputs come back
    (a prefill: the drafter's window; None: the last layer's rows; a captured last layer needs them as many).
    `logits`: "all" rows', the "last" row's alone (a prefill: the head is vocab-wide), or "none" (a prefill's
    early chunk).
    """
    tokens: torch.Tensor
    positions: torch.Tensor
    cache: Cache
    mask: torch.Tensor | None = None
    tail: int | None = None
    logits: str = "all"
    features: int | None = None

    @property
    def rows(self) -> int:
        """The rows the last layer runs for."""
        n = self.tokens.shape[0]
        return n if self.tail is None else min(self.tail, n)


class Target(nn.Module):
    """Causal LM whose state dict uses the HF key names (`model.layers.{i}...`, `lm_head.weight`)."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        g = cfg.geometry
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, g.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(g, cfg.attention_bias) for _ in range(g.num_layers))
        self.model.norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.lm_head = nn.Linear(g.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RopeTable(g.head_dim, g.rope_theta)
        self._fused = False  # every layer's decode row bound (kernels.c serves it): set once `load` packed them
        self.head: PanelLinear | None = None  # the vocab head on kernels.c's panels, set by `load` where they serve

    @classmethod
    def load(cls, directory: Path, device: torch.device, dtype: torch.dtype) -> "Target":
        cfg = TargetConfig.load(directory)
        with torch.device("meta"):
            model = cls(cfg)
        model.to_empty(device=device)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        state = read_state_dict(directory)
        optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
        load_into(model, {k: v for k, v in state.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")},
                  directory, optional)
        model = model.to(dtype).eval()
        if model.lm_head.weight.device.type == "cpu":
            pack_linears(model.model.layers)
            model._fused = all([layer.bind_decode() for layer in model.model.layers])  # binds every layer
            if native.paneled(model.lm_head.weight):  # a copy of the weight: torch's product was 2-4x slower
                model.head = PanelLinear(model.lm_head)
        return model

    def panelled(self) -> bool:
        """Whether every product of a step runs on kernels.c's panels (the layers' and the vocab head's), so that
        each row gets its own bits whatever the rows beside it."""
        projections = [m for layer in self.model.layers for block in (layer.self_attn, layer.mlp)
                       for m in block.children() if not isinstance(m, RMSNorm)]
        return self.head is not None and all(isinstance(m, PanelLinear) for m in projections)

    def new_cache(self, capacity: int) -> KVCache:
        p = self.lm_head.weight
        return KVCache(self.cfg.geometry, capacity, p.device, p.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocab head: on its panels (each row its own bits) unless a gradient must flow (training)."""
        if self.head is not None and native.serves(hidden):
            return self.head(hidden)
        return self.lm_head(hidden)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Cache,
                mask: torch.Tensor | None = None, capture: tuple[int, ...] = (), last_only: bool = False,
                tail: int | None = None) -> ForwardOut:
        """One sequence's forward: `forward_many` of one `Segment`."""
        return self.forward_many([Segment(tokens, positions, cache, mask, tail, "last" if last_only else "all")],
                                 capture)[0]

    @torch.inference_mode()
    def forward_many(self, segments: list[Segment], capture: tuple[int, ...] = ()) -> list[ForwardOut]:
        """Every segment's rows in one pass: the projections and MLPs over all rows at once, attention per
        segment over its own cache. `capture` lists layer ids whose outputs are returned as features,
        HF-style (output of layer id)."""
        for seg in segments:
            start, n = seg.cache.length, seg.tokens.shape[0]
            if start + n > seg.cache.capacity:
                raise KVCacheFull(f"KV cache full: {start} + {n} tokens > capacity {seg.cache.capacity}")
            if seg.tail is not None and seg.tail < n and seg.mask is not None:
                raise ValueError("tail applies to a causal forward (mask=None)")
        dtype = self.lm_head.weight.dtype
        sizes = [seg.tokens.shape[0] for seg in segments]
        plans = [self._plan(seg) for seg in segments]
        cos, sin = self.rope(joined([seg.positions for seg in segments]), dtype)
        h = self.embed(joined([seg.tokens for seg in segments]))
        captured: dict[int, torch.Tensor] = {}
        last = len(self.model.layers) - 1
        rows = self._in_c(segments, plans, h, cos, sin)
        if rows is not None:  # a decode step or a tree: each layer in kernels.c, the same bits without the Python
            self._c_rows(*rows, h, cos, sin, capture, captured)
        for i, layer in enumerate(self.model.layers if rows is None else ()):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            k, v = attn.key_value(x, cos, sin)
            if i == last:  # past its K/V, the last layer runs only for the rows read later
                keep = _trailing(sizes, [seg.rows for seg in segments], h.device)
                if keep is not None:
                    h, x, cos, sin = h[keep], x[keep], cos[keep], sin[keep]
            q = attn.query(x, cos, sin)
            mixed, a, qa = [], 0, 0
            for seg, n, plan in zip(segments, sizes, plans):
                rows = seg.rows if i == last else n
                keys, values = seg.cache.write(i, seg.cache.length, k[:, a:a + n], v[:, a:a + n])
                if rows:
                    mask, causal = plan.last if i == last else plan.body
                    mixed.append(attn.mix(q[:, qa:qa + rows], keys, values, mask, causal))
                a, qa = a + n, qa + rows
            if mixed:
                h = h + attn.o_proj(joined(mixed))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in capture and i != last:
                captured[i] = h
        for seg, n in zip(segments, sizes):
            seg.cache.length += n
        h = self.model.norm(h)
        if last in capture:  # HF's last hidden state is the normed one
            captured[last] = h
        return self._outputs(segments, sizes, h, captured, capture)

    def _in_c(self, segments: list[Segment], plans: list["_Masks"], h: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[Cache, torch.Tensor | None] | None:
        """(cache, mask) of a forward whose rows go through every layer in kernels.c, every layer's row bound:
        one sequence's decode row, or its tree's rows over a cache in one run under a mask kernels.c's attention
        takes (`_grouped` left it boolean)."""
        (mask, causal), n, seg = plans[0].body, h.shape[0], segments[0]
        if (len(segments) > 1 or seg.rows != n or plans[0].last is not plans[0].body or causal or not self._fused
                or not native.serves(h, cos, sin)):
            return None
        tree = (1 < n <= GROUPED_QUERIES and mask is not None and mask.dtype == torch.bool
                and seg.cache.run(n) is not None)
        return (seg.cache, mask) if tree or (n == 1 and mask is None) else None

    def _c_rows(self, cache: Cache, mask: torch.Tensor | None, h: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, capture: tuple[int, ...], captured: dict[int, torch.Tensor]) -> None:
        """Rows h [n, hidden] through every layer in place: a C call a layer where the cache's slots lie in one
        run (it stores the K/V itself), else (a decode row) two around the cache's write."""
        last, run, n = len(self.model.layers) - 1, cache.run(h.shape[0]), h.shape[0]
        if run is not None:
            keys, values, first = run  # [layers, kv_heads, slots, d]; position 0 at slot `first`
            size = keys.element_size()
            k0, v0 = (t.data_ptr() + first * t.stride(2) * size for t in (keys, values))
            step = keys.stride(0) * size
        for i, layer in enumerate(self.model.layers):
            if run is None:
                layer.decode_row(h, cos, sin, lambda k, v, i=i: cache.write(i, cache.length, k, v))
            else:
                layer.row.layer(h, cos, sin, k0 + i * step, v0 + i * step, cache.length + n, keys.stride(1), mask)
            if i in capture and i != last:
                captured[i] = h.clone()

    def _plan(self, seg: Segment) -> "_Masks":
        """Each segment's (mask, causal) for the layers before the last and for the last (its `tail` rows)."""
        start, n, dev = seg.cache.length, seg.tokens.shape[0], seg.tokens.device
        mask = seg.mask
        if mask is None and start > 0 and n > 1:
            mask = torch.ones(n, start + n, dtype=torch.bool, device=dev).tril(start)
        # a prefill's rows (not a few after a prefix: those take a tree's path) attend as causal
        causal = seg.mask is None and n > 1 and (start == 0 or n > GROUPED_QUERIES)
        body = (self._grouped(mask) if mask is not None and n <= GROUPED_QUERIES else mask, causal)
        rows = seg.rows
        if rows == n or rows == 0:
            return _Masks(body, body)
        tail = torch.ones(rows, start + n, dtype=torch.bool, device=dev).tril(start + n - rows)
        return _Masks(body, (self._grouped(tail), False) if rows <= GROUPED_QUERIES else (tail, True))

    def _grouped(self, mask: torch.Tensor) -> torch.Tensor:
        """A few rows' mask as their attention takes it: boolean for kernels.c's (the exact kernel in the
        dtypes of `EXACT_TREES`, fp32's tree products), else an additive bias for grouped queries."""
        g, dtype = self.cfg.geometry, self.lm_head.weight.dtype
        geometry = (dtype, g.num_heads, g.num_kv_heads, g.head_dim)
        if mask.shape[0] <= native.MAX_ROWS and (native.masks_rows(*geometry) if dtype in layers.EXACT_TREES
                                                 else native.tree_rows(*geometry)):
            return mask.contiguous()
        return grouped_bias(mask, g.num_heads // g.num_kv_heads, dtype)

    def _outputs(self, segments: list[Segment], sizes: list[int], h: torch.Tensor, captured: dict[int, torch.Tensor],
                 capture: tuple[int, ...]) -> list[ForwardOut]:
        """Split the last layer's rows (and the captured layers' matching rows) back into segments."""
        rows = [seg.rows for seg in segments]
        featured = [seg.rows if seg.features is None else min(seg.features, n) for seg, n in zip(segments, sizes)]
        picks = [(a + n - r, a + n) for a, n, r in zip(_starts(sizes), sizes, featured)]  # in the full rows
        kept = [(b - r, b) for b, r in zip(_ends(rows), rows)]  # in the last layer's rows
        wanted = {"all": lambda a, b: (a, b), "last": lambda a, b: (b - 1, b), "none": lambda a, b: (b, b)}
        heads = [wanted[seg.logits](*ab) for seg, ab in zip(segments, kept)]
        head_rows = torch.cat([h[a:b] for a, b in heads]) if len(heads) > 1 else h[heads[0][0]:heads[0][1]]
        logits = self.logits(head_rows) if head_rows.shape[0] else None
        out, at = [], 0
        for seg, (fa, fb), (ka, kb), (la, lb) in zip(segments, picks, kept, heads):
            feats = None
            if capture:
                last = len(self.model.layers) - 1  # its rows are the last layer's; the others' are all rows
                parts = [captured[i][ka:kb] if i == last else captured[i][fa:fb] for i in capture]
                feats = torch.cat(parts, dim=-1)
            n = lb - la
            out.append(ForwardOut(None if seg.logits == "none" else logits[at:at + n], feats))
            at += n
        return out


@dataclass
class _Masks:
    body: tuple[torch.Tensor | None, bool]  # (mask or grouped bias, causal) of every layer but the last
    last: tuple[torch.Tensor | None, bool]  # ... of the last, for its rows


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows of every segment in order; one segment's as they are (a batch of one copies nothing)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _ends(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i + 1]) for i in range(len(sizes))]


def _trailing(sizes: list[int], rows: list[int], device: torch.device) -> torch.Tensor | slice | None:
    """The rows of every segment's trailing `rows`, in order; None when that is all of them."""
    if sizes == rows:
        return None
    if len(sizes) == 1:
        return slice(sizes[0] - rows[0], sizes[0])
    idx = [j for a, n, r in zip(_starts(sizes), sizes, rows) for j in range(a + n - r, a + n)]
    return torch.tensor(idx, dtype=torch.long, device=device)
