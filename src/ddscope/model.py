"""Native Qwen3/Llama decoder with a preallocated KV cache, explicit positions and boolean masks.

Tree verification needs arbitrary (ancestor-only) masks and positions that repeat across siblings;
owning the forward keeps that exact and independent of the HF Cache API.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddscope.config import DecoderGeometry, TargetConfig
from ddscope.weights import load_into, read_state_dict


class KVCacheFull(RuntimeError):
    """A forward would write past the cache: the engine's fault or its capacity's, never the request's."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as transformers does, so logits match at low precision too; one fused kernel.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [n, head_dim] for the given absolute positions."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTable:
    """cos/sin for positions [0, n), grown by doubling; a lookup is cheaper than recomputing per step."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        self.cos = self.sin = torch.empty(0)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > len(self.cos) or self.cos.dtype != dtype or self.cos.device != positions.device:
            size = max(need, 2 * len(self.cos), 256)
            self.cos, self.sin = rope(torch.arange(size, device=positions.device), self.head_dim, self.theta, dtype)
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Projections and norms of one attention block; the callers decide what attends to what."""

    def __init__(self, g: DecoderGeometry, bias: bool = False):
        super().__init__()
        self.g = g
        self.q_proj = nn.Linear(g.hidden_size, g.num_heads * g.head_dim, bias=bias)
        self.k_proj = nn.Linear(g.hidden_size, g.num_kv_heads * g.head_dim, bias=bias)
        self.v_proj = nn.Linear(g.hidden_size, g.num_kv_heads * g.head_dim, bias=bias)
        self.o_proj = nn.Linear(g.num_heads * g.head_dim, g.hidden_size, bias=False)
        if g.qk_norm:
            self.q_norm = RMSNorm(g.head_dim, g.rms_norm_eps)
            self.k_norm = RMSNorm(g.head_dim, g.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        return x.view(x.shape[0], n_heads, self.g.head_dim).transpose(0, 1)  # [heads, n, d]

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(x.shape[0], self.g.num_heads, self.g.head_dim)
        if self.g.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q.transpose(0, 1), cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_proj(x).view(x.shape[0], self.g.num_kv_heads, self.g.head_dim)
        if self.g.qk_norm:
            k = self.k_norm(k)
        v = self._heads(self.v_proj(x), self.g.num_kv_heads)
        return apply_rope(k.transpose(0, 1), cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool = False) -> torch.Tensor:
        """q [heads, n, d] over k, v [kv_heads, S, d]. `mask`: boolean [n, S] (True = may attend), or the
        additive bias of `grouped_bias`, which runs the queries grouped; None: all keys (or `causal`)."""
        heads, n, d = q.shape
        if causal or (mask is not None and mask.dtype == torch.bool):
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                                 enable_gqa=heads != k.shape[0])[0]
        else:  # the query heads of one K/V head as one head of group * n rows: K/V are read once per group
            grouped = q.reshape(k.shape[0], -1, d)
            out = F.scaled_dot_product_attention(grouped[None], k[None], v[None], attn_mask=mask)[0]
        return self.o_proj(out.reshape(heads, n, d).transpose(0, 1).reshape(n, -1))


def grouped_bias(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """A boolean [n, S] mask as an additive bias for `Attention.attend`'s grouped queries: rows repeated for
    each of the `group` query heads that share a K/V head. Built once per forward, shared by the layers.
    For a few queries over a long context this is SDPA's fastest CPU path (a quarter off at 5.5k keys)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return bias.repeat(group, 1) if group > 1 else bias


class MLP(nn.Module):
    def __init__(self, g: DecoderGeometry):
        super().__init__()
        self.gate_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.up_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.down_proj = nn.Linear(g.intermediate_size, g.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, g: DecoderGeometry, bias: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.self_attn = Attention(g, bias)
        self.post_attention_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.mlp = MLP(g)


GROUPED_QUERIES = 128  # up to this many queries (a decode step, a tree) attend grouped; a prefill, not


class KVCache:
    """Preallocated per-layer K/V in slot order; `length` slots are valid."""

    def __init__(self, g: DecoderGeometry, capacity: int, device: torch.device, dtype: torch.dtype):
        shape = (g.num_layers, g.num_kv_heads, capacity, g.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.length = 0

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[1]
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Move the accepted tree slots `start + slots` to `[start, start + len(slots))` and truncate."""
        n = slots.numel()
        src = slots + start
        self.k[:, :, start:start + n] = self.k.index_select(2, src)
        self.v[:, :, start:start + n] = self.v.index_select(2, src)
        self.length = start + n


@dataclass
class ForwardOut:
    logits: torch.Tensor          # [n, vocab]
    features: torch.Tensor | None  # [n, len(capture) * hidden] target hidden states for the drafter


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
        return model.to(dtype).eval()

    def new_cache(self, capacity: int) -> KVCache:
        p = self.lm_head.weight
        return KVCache(self.cfg.geometry, capacity, p.device, p.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None = None, capture: tuple[int, ...] = (), last_only: bool = False,
                tail: int | None = None) -> ForwardOut:
        """Run `tokens` at `positions`, writing their K/V at slots `[cache.length, +n)`.

        `mask` is a boolean [n, cache.length + n] (True = may attend); None means causal.
        `capture` lists layer ids whose outputs are returned, HF-style (output of layer id).
        `last_only`: logits of the last token alone (a prefill needs no others: the head is vocab-wide).
        `tail` (causal only): the last layer runs past its K/V for the last `tail` rows alone, and logits and
        features are theirs; nothing later reads the other rows' outputs (a prefill: the drafter's window).
        """
        start, n = cache.length, tokens.shape[0]
        if start + n > cache.capacity:
            raise KVCacheFull(f"KV cache full: {start} + {n} tokens > capacity {cache.capacity}")
        trim = tail is not None and tail < n
        if trim and mask is not None:
            raise ValueError("tail applies to a causal forward (mask=None)")
        if mask is None and start > 0 and n > 1:
            mask = torch.ones(n, start + n, dtype=torch.bool, device=tokens.device).tril(start)
        if mask is not None and n <= GROUPED_QUERIES:
            g = self.cfg.geometry
            mask = grouped_bias(mask, g.num_heads // g.num_kv_heads, self.lm_head.weight.dtype)
        cos, sin = self.rope(positions, self.lm_head.weight.dtype)
        h = self.embed(tokens)
        captured: dict[int, torch.Tensor] = {}
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            k, v = cache.write(i, start, *attn.key_value(x, cos, sin))
            causal = mask is None and start == 0 and n > 1
            if i == last and trim:
                h, x, cos, sin = h[-tail:], x[-tail:], cos[-tail:], sin[-tail:]
                mask = torch.ones(tail, start + n, dtype=torch.bool, device=tokens.device).tril(start + n - tail)
                causal = False
            h = h + attn.attend(attn.query(x, cos, sin), k, v, mask, causal=causal)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in capture and i != last:
                captured[i] = h
        cache.length = start + n
        h = self.model.norm(h)
        if last in capture:  # HF's last hidden state is the normed one
            captured[last] = h
        features = torch.cat([captured[i][-len(h):] for i in capture], dim=-1) if capture else None
        return ForwardOut(self.logits(h[-1:] if last_only else h), features)
