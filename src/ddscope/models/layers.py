"""The decoder's building blocks, shared by the target (ddscope.models.target) and the drafter: RMSNorm, RoPE,
attention projections and the grouped-query mix, the MLP and one decoder layer."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ddscope.config import DecoderGeometry
from ddscope.models import layer_call, native, pages


BMM_ATTENTION = (torch.float32,)  # dtypes whose masked grouped attention runs as two batched products
# Dtypes whose trees attend in kernels.c's `attend`, each row with a decode step's bits: in bf16 other sums
# flip greedy near-ties; in fp32 they flipped none measured, and fp32 trees run faster as `tree_attend`'s
# products (docs/performance.md, The engine at its floor).
EXACT_TREES = (torch.bfloat16,)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native.serves(x, self.weight):
            return native.rms_norm(x, self.weight, self.eps)
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
        return self._rotated(self.q_proj(x), self.q_norm if self.g.qk_norm else None, self.g.num_heads, cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._rotated(self.k_proj(x), self.k_norm if self.g.qk_norm else None, self.g.num_kv_heads, cos, sin)
        return k, self._heads(self.v_proj(x), self.g.num_kv_heads)

    def _rotated(self, x: torch.Tensor, norm: RMSNorm | None, heads: int, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """A projection's rows [n, heads * d] as heads [heads, n, d], each normed (if `norm`) and rotated."""
        weights = () if norm is None else (norm.weight,)
        if native.serves(x, cos, sin, *weights):
            weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
            return native.norm_rope(x, weight, cos, sin, heads, eps)
        x = x.view(x.shape[0], heads, self.g.head_dim)
        return apply_rope((x if norm is None else norm(x)).transpose(0, 1), cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool = False) -> torch.Tensor:
        """`mix` through the output projection."""
        return self.o_proj(self.mix(q, k, v, mask, causal))

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            causal: bool = False) -> torch.Tensor:
        """q [heads, n, d] over k, v [kv_heads, S, d] -> [n, heads * d]. `mask`: boolean [n, S] (True = may
        attend), or the additive bias of `grouped_bias`, which runs the queries grouped; None: all keys.
        `causal`: the rows are the last n positions and each sees the keys up to its own (`mask`, if given,
        spells that out; without it S = n)."""
        heads, n, d = q.shape
        if causal and native.causal_rows(q, k, v):  # a prefill's fp32 rows as a tree's products
            return native.causal_attend(q, k, v)
        if not causal and native.attends(q, k, v, mask):  # few rows: kernels.c's (a tree's fp32 rows as products)
            if n > 1 and mask is not None and native.tree_rows(q.dtype, heads, k.shape[0], d):
                return native.tree_attend(q, k, v, mask)
            return native.attend(q, k, v, mask)
        if causal or (mask is not None and mask.dtype == torch.bool):
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                 is_causal=causal and mask is None,
                                                 enable_gqa=heads != k.shape[0])[0]
        else:  # the query heads of one K/V head as one head of group * n rows: K/V are read once per group
            grouped = q.reshape(k.shape[0], -1, d)
            if mask is not None and q.dtype in BMM_ATTENTION and q.device.type == "cpu":
                # a tree's rows over its context: MKL's batched products beat SDPA's CPU kernel (docs/journal.md)
                scores = torch.baddbmm(mask.expand(k.shape[0], -1, -1), grouped, k.transpose(1, 2), alpha=d ** -0.5)
                out = torch.bmm(scores.softmax(-1), v)
            else:
                out = F.scaled_dot_product_attention(grouped[None], k[None], v[None], attn_mask=mask)[0]
        return out.reshape(heads, n, d).transpose(0, 1).reshape(n, -1)


def grouped_bias(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """A boolean [n, S] mask as an additive bias for `Attention.attend`'s grouped queries: rows repeated for
    each of the `group` query heads that share a K/V head. Built once per forward, shared by the layers.
    For a few queries over a long context this is SDPA's fastest CPU path: each K/V head is read once."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return bias.repeat(group, 1) if group > 1 else bias


class MLP(nn.Module):
    def __init__(self, g: DecoderGeometry):
        super().__init__()
        self.gate_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.up_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.down_proj = nn.Linear(g.intermediate_size, g.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(native.silu_mul(gate, up) if native.gates(gate, up) else F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, g: DecoderGeometry, bias: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.self_attn = Attention(g, bias)
        self.post_attention_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.mlp = MLP(g)
        self.row: layer_call.DecodeRow | None = None  # a decode row's C calls, once `bind_decode` finds they serve

    def bind_decode(self) -> bool:
        """Bind `row` where kernels.c's decode calls serve (whether they do): panels without bias for every
        projection, a head its attention takes, its calls in this dtype. q/k/v's panels, and gate/up's, then
        lie one after another (one product each), the modules reading their own views."""
        a, m, g = self.self_attn, self.mlp, self.self_attn.g
        projections = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        dtype = self.input_layernorm.weight.dtype
        if not (all(type(p) is PanelLinear and p.bias is None for p in projections)
                and native.masks_rows(dtype, g.num_heads, g.num_kv_heads, g.head_dim) and layer_call.decodes(dtype)):
            self.row = None
            return False
        qk_norms = (a.q_norm.weight, a.k_norm.weight, a.q_norm.eps) if g.qk_norm else (None, None, 0.0)
        post = self.post_attention_layernorm
        self.row = layer_call.DecodeRow((self.input_layernorm.weight, self.input_layernorm.eps),
                                        _adjoin(a.q_proj, a.k_proj, a.v_proj), qk_norms, a.o_proj.panels,
                                        (post.weight, post.eps), _adjoin(m.gate_proj, m.up_proj), m.down_proj.panels,
                                        (g.num_heads, g.num_kv_heads, g.head_dim))
        return True

    def decode_row(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   write: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One decode row h [1, hidden] through the layer in place (where `row` is bound), its K/V stored by
        `write`, the cache's, which returns every key and value as [kv_heads, S, d] with rows d apart."""
        q, k, v = self.row.qkv(h, cos, sin)
        self.row.rest(h, *write(k, v))


class PackedLinear(nn.Module):
    """A bf16 linear whose weight oneDNN reordered once for this CPU's matrix units: a decode step's
    matrix-vector products read it faster than a row-major weight, and any number of rows gets each row's
    result bitwise as one row alone does (docs/performance.md, bf16 on CPU). Where kernels.c's AMX panels
    serve, PanelLinear runs instead."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1),
                             persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none",
                                               [None], "")
        return y.view(*x.shape[:-1], self.out_features)


COLUMN_ROWS = 64  # the most rows ColumnLinear takes as W @ x^T


class ColumnLinear(nn.Linear):
    """An fp32 linear that takes a few rows (a tree's verify) as W @ x^T: MKL's product of that shape reads
    the weight faster than x @ W^T does (docs/performance.md, The engine at its floor); one row or many
    (a decode, a prefill) go the usual way. Where kernels.c's panels serve, PanelLinear runs instead."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not 1 < rows <= COLUMN_ROWS:
            return super().forward(x)
        y = torch.mm(self.weight, x.reshape(rows, self.in_features).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class PanelLinear(nn.Module):
    """A linear on kernels.c's panelled weight (fp32; bf16 on AMX): one row reads it at near the memory's rate,
    a few rows share each read, a prefill runs as fast as MKL's (oneDNN's), and every row gets the bits it gets
    alone (docs/performance.md, The engine at its floor)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("panels", native.panels(linear.weight), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = native.linear(x.reshape(-1, self.in_features), self.panels)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def packs(weight: torch.Tensor) -> bool:
    """Whether PackedLinear serves this weight: bf16 on a CPU whose oneDNN has native bf16."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(layers: nn.ModuleList) -> None:
    """Every projection of `layers` as a PanelLinear where kernels.c's panels serve, a PackedLinear where
    `packs` says so, else a ColumnLinear (inference only: a packed weight takes no gradient)."""
    for layer in layers:
        for block in (layer.self_attn, layer.mlp):
            for name, child in list(block.named_children()):
                if type(child) is nn.Linear:
                    setattr(block, name, _packed(child))


def _adjoin(*linears: PanelLinear) -> torch.Tensor:
    """The linears' panels in one tensor, one after another, each linear keeping a view of its own."""
    parts = [p.panels for p in linears]
    joint = torch.cat(parts, out=pages.huge((sum(len(q) for q in parts), *parts[0].shape[1:]), parts[0].dtype))
    start = 0
    for p in linears:
        p.panels = joint[start:start + p.out_features]
        start += p.out_features
    return joint


def _packed(linear: nn.Linear) -> nn.Module:
    if native.paneled(linear.weight):
        return PanelLinear(linear)
    return PackedLinear(linear) if packs(linear.weight) else _columns(linear)


def _columns(linear: nn.Linear) -> ColumnLinear:
    out = ColumnLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    out.weight, out.bias = linear.weight, linear.bias
    return out
