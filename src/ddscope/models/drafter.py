"""DFlash block-diffusion drafter (z-lab checkpoint layout), sharing the target's embeddings and head.

One forward drafts a whole block: queries come from `[last token, MASK x (B-1)]`, keys/values from
the cached context features plus the block itself. By default a layer sees all context and its whole
block (bidirectional); z-lab's `sliding_attention` layers see only the last `sliding_window` positions,
which keeps a drafter's attention, and its cost, the same at any context length: when every layer
slides, positions out of reach are not even projected.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ddscope.config import CheckpointError, DecoderGeometry, DrafterConfig, LayerAttention
from ddscope.models.layers import DecoderLayer, RMSNorm, RopeTable, grouped_bias, pack_linears
from ddscope.models.kv_pool import KVCache
from ddscope.models.target import Target, joined
from ddscope.models.weights import load_into, read_state_dict

if TYPE_CHECKING:
    from ddscope.models.kv_pool import PagedCache


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        g = cfg.geometry
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * g.hidden_size, g.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(g) for _ in range(g.num_layers))
        self.norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.rope = RopeTable(g.head_dim, g.rope_theta)
        windows = [rule.window for rule in cfg.attention]
        # how far back from a block's first position any layer still sees (None: all the way)
        self.horizon: int | None = None if None in windows else max(windows) - 1

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @classmethod
    def load(cls, directory: Path, target: Target) -> "Drafter":
        cfg = DrafterConfig.load(directory)
        check_compatible(cfg, target, directory)
        p = target.lm_head.weight
        with torch.device("meta"):
            drafter = cls(cfg)
        drafter.to_empty(device=p.device)
        load_into(drafter, drafter_state(directory), directory)
        drafter = drafter.to(p.dtype).eval()
        if p.device.type == "cpu":  # a block's 16 rows share each read of a panelled weight (inference only)
            pack_linears(drafter.layers)
        return drafter

    def new_cache(self, capacity: int) -> "DrafterCache":
        """A cache for `capacity` context positions, and room after them for the block being drafted."""
        p = self.fc.weight
        return DrafterCache(self.cfg.geometry, capacity + self.block_size, self.fc.in_features, p.device, p.dtype)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Project concatenated target hidden states to the drafter's context stream."""
        return self.hidden_norm(self.fc(features))

    def run(self, block: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder stack for training: queries from `block`, keys/values from `[ctx, block]`; many anchor
        blocks at once with a boolean `mask` [n_block, n_ctx + n_block]."""
        cos_c, sin_c = self.rope(ctx_pos, block.dtype)
        cos_b, sin_b = self.rope(block_pos, block.dtype)
        keys = torch.cat([ctx_pos, block_pos])
        seen = {rule: visible(rule, block_pos, keys, mask) for rule in set(self.cfg.attention)}
        h = block
        for layer, rule in zip(self.layers, self.cfg.attention):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            k_ctx, v_ctx = attn.key_value(ctx, cos_c, sin_c)
            k_blk, v_blk = attn.key_value(x, cos_b, sin_b)
            k, v = torch.cat([k_ctx, k_blk], dim=1), torch.cat([v_ctx, v_blk], dim=1)
            h = h + attn.attend(attn.query(x, cos_b, sin_b), k, v, seen[rule])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def _visible(self, rule: LayerAttention, start: int) -> tuple[int, torch.Tensor | None]:
        """(first key slot, mask over the keys from there) for a block at `start` under `rule`: keys outside
        every query's window are sliced off rather than masked, which is the saving at long context."""
        dev = self.fc.weight.device
        block_pos = torch.arange(start, start + self.block_size, device=dev)
        first = 0 if rule.window is None else max(0, start - rule.window + 1)
        seen = visible(rule, block_pos, torch.arange(first, start + self.block_size, device=dev), None)
        g = self.cfg.geometry
        return first, None if seen is None else grouped_bias(seen, g.num_heads // g.num_kv_heads, self.fc.weight.dtype)

    @torch.inference_mode()
    def draft(self, target: Target, last_token: int, start: int, cache: "DrafterCache") -> torch.Tensor:
        """Logits [B-1, vocab] for positions `start+1 .. start+B-1`: `draft_many` of one."""
        return self.draft_many(target, [Draft(last_token, start, cache)])[0]

    @torch.inference_mode()
    def draft_many(self, target: Target, drafts: list["Draft"]) -> list[torch.Tensor]:
        """Each draft's logits [B-1, vocab], all blocks in one pass. A draft reads the target features of
        the positions before its `start` (`cache.features`); those not taken in yet are projected first."""
        B, dev = self.block_size, self.fc.weight.device
        for d in drafts:
            if self.horizon is not None:  # older positions are out of every layer's reach, now and later
                d.cache.length = max(d.cache.length, d.start - self.horizon)
        ctx = self.context(joined([d.cache.features[d.cache.length:d.start] for d in drafts]))
        block = torch.full((len(drafts), B), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = torch.tensor([d.root for d in drafts], device=dev)
        h = self.forward_blocks(target.embed(block.flatten()), drafts, ctx)[:, 1:]
        return list(target.logits(h.reshape(-1, h.shape[-1])).view(len(drafts), B - 1, -1).unbind(0))

    def forward_blocks(self, block: torch.Tensor, drafts: list["Draft"], ctx: torch.Tensor) -> torch.Tensor:
        """Hidden states [drafts, B, hidden] of each draft's block (`block`: their embeddings, [drafts * B,
        hidden]) at positions `[start, start + B)`; projections and MLPs over every row, attention per draft
        over its own context. `ctx` holds each draft's new context rows, for positions `[cache.length,
        start)`, in order; their K/V are cached, followed by the block's own (which the next draft
        overwrites), and each cache afterwards holds context up to its block."""
        B, dev = self.block_size, self.fc.weight.device
        spans = [(d.cache.length, d.start) for d in drafts]
        ctx_pos = joined([torch.arange(a, b, device=dev) for a, b in spans])
        blk_pos = joined([torch.arange(d.start, d.start + B, device=dev) for d in drafts])
        cos_c, sin_c = self.rope(ctx_pos, block.dtype)
        cos_b, sin_b = self.rope(blk_pos, block.dtype)
        seen = [{rule: self._visible(rule, d.start) for rule in set(self.cfg.attention)} for d in drafts]
        h = block
        for i, (layer, rule) in enumerate(zip(self.layers, self.cfg.attention)):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            k_ctx, v_ctx = attn.key_value(ctx, cos_c, sin_c)
            k_blk, v_blk = attn.key_value(x, cos_b, sin_b)
            q = attn.query(x, cos_b, sin_b)
            mixed, c = [], 0
            for j, (d, (a, b)) in enumerate(zip(drafts, spans)):
                rows = slice(j * B, (j + 1) * B)
                k = torch.cat([k_ctx[:, c:c + b - a], k_blk[:, rows]], dim=1)
                v = torch.cat([v_ctx[:, c:c + b - a], v_blk[:, rows]], dim=1)
                k, v = d.cache.write(i, a, k, v)
                first, mask = seen[j][rule]
                mixed.append(attn.mix(q[:, rows], k[:, first:], v[:, first:], mask))
                c += b - a
            h = h + attn.o_proj(joined(mixed))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        for d in drafts:
            d.cache.length = d.start
        return self.norm(h).view(len(drafts), B, -1)


@dataclass
class Draft:
    """One sequence's draft request: its root (last committed token) at `start`, its drafter cache, and
    its target cache (which only test drafters read)."""
    root: int
    start: int
    cache: "DrafterCache | PagedCache"
    target_cache: object = None


class DrafterCache(KVCache):
    """The drafter's context: the target features of every position the target has cached (written by the
    decoder; what the drafter drafts from, and what a prefix cache keeps for it), and the layers' K/V of
    those taken in so far (`length`). Slots the horizon skipped hold nothing valid and are never read."""

    def __init__(self, g: DecoderGeometry, capacity: int, feature_dim: int, device: torch.device,
                 dtype: torch.dtype):
        super().__init__(g, capacity, device, dtype)
        self.features = torch.zeros(capacity, feature_dim, device=device, dtype=dtype)


def visible(rule: LayerAttention, block_pos: torch.Tensor, key_pos: torch.Tensor,
            mask: torch.Tensor | None) -> torch.Tensor | None:
    """`mask` over keys at `key_pos` narrowed to what `rule` lets the block's queries see, by absolute
    position; None means everything."""
    if rule.window is None and not rule.causal:
        return mask
    ahead = block_pos[:, None] - key_pos[None, :]  # how far a key lies before a query
    ok = ahead >= 0 if rule.causal else torch.ones_like(ahead, dtype=torch.bool)
    if rule.window is not None:
        ok &= ahead < rule.window
        if not rule.causal:
            ok &= -ahead < rule.window
    return ok if mask is None else ok & mask


def drafter_state(directory: Path) -> dict[str, torch.Tensor]:
    """A drafter checkpoint's own weights, unprefixed. Some exports carry the shared embedding/head and
    a `model.` prefix; the target's embedding/head are the ones used."""
    state = {k.removeprefix("model."): v for k, v in read_state_dict(directory).items()}
    return {k: v for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head."))}


def check_compatible(cfg: DrafterConfig, target: Target, directory: Path) -> None:
    tg, dg = target.cfg.geometry, cfg.geometry
    if dg.hidden_size != tg.hidden_size:
        raise CheckpointError(
            f"{directory}: drafter hidden_size {dg.hidden_size} != target hidden_size {tg.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < tg.num_layers]
    if bad:
        raise CheckpointError(
            f"{directory}: target_layer_ids {bad} out of range for a {tg.num_layers}-layer target")
    last = tg.num_layers - 1
    if cfg.layout == "speculators" and last in cfg.target_layer_ids:
        raise CheckpointError(
            f"{directory}: aux_hidden_state_layer_ids {tg.num_layers} is, in vLLM, the last layer's output before "
            "the final norm; ddscope (like HF hidden_states[-1]) captures the normed one, so this drafter would "
            "see other features than it was trained on")
    if not 0 <= cfg.mask_token_id < target.cfg.vocab_size:
        raise CheckpointError(
            f"{directory}: mask_token_id {cfg.mask_token_id} outside the target vocab ({target.cfg.vocab_size})")
