"""A decoder layer's rows through the whole layer in one kernels.c call (ddscope.models.native): a decode row, or
a tree's rows under its mask, the bits the layer's modules give them one by one, with no Python between the
layer's ops."""
from __future__ import annotations

import torch

from ddscope.models.native import DTYPES, call, has


def decodes(dtype: torch.dtype) -> bool:
    """Whether the library has the calls of rows through a layer (`rows_layer`; a decode row's `decode_qkv`,
    `decode_rest`)."""
    return dtype in DTYPES and has(f"decode_qkv_{DTYPES[dtype]}")


class DecodeRow:
    """One decode row h [1, hidden] through a layer in kernels.c, the bits its modules give one by one: in one
    call where the cache's slots lie in one run (`layer`), else in two around the cache's write (`qkv`, `rest`).
    The layer's weights, geometry and scratch are bound once, so a step's Python is those calls. `qkv` holds
    q's, k's and v's panels one after another, `gate_up` the gate's and up's (one product each; every output is
    summed alone, so the modules' views of them give the same bits). A layer decodes one row at a time."""

    def __init__(self, norm: tuple[torch.Tensor, float], qkv: torch.Tensor,
                 qk_norms: tuple[torch.Tensor | None, torch.Tensor | None, float], o: torch.Tensor,
                 post_norm: tuple[torch.Tensor, float], gate_up: torch.Tensor, down: torch.Tensor,
                 geometry: tuple[int, int, int]):
        """`norm`, `post_norm`: (weight, eps); `qk_norms`: q's and k's weights (None without) and their eps;
        `geometry`: (heads, kv_heads, head_dim)."""
        (w_in, eps), (w_post, post_eps), (heads, kv_heads, d) = norm, post_norm, geometry
        norms, qk_eps = qk_norms[:2], qk_norms[2]
        dtype, hidden, inter = w_in.dtype, w_in.shape[0], down.shape[1]
        self._weights = (w_in, qkv, *norms, o, w_post, gate_up, down)  # alive while their pointers are bound
        self._suffix = DTYPES[dtype]
        xn, row, att, out, gu = (torch.empty(n, dtype=dtype) for n in
                                 (hidden, (heads + 2 * kv_heads) * d, heads * d, hidden, 2 * inter))
        self._scratch = (xn, row, att, out, gu)  # alive while their pointers are bound
        self.q, self.k = torch.empty(heads, 1, d, dtype=dtype), torch.empty(kv_heads, 1, d, dtype=dtype)
        self.v = row[(heads + kv_heads) * d:].view(kv_heads, 1, d)
        qn, kn = (None if w is None else w.data_ptr() for w in norms)
        xn_p, row_p, q_p, k_p, att_p, out_p, gu_p = (t.data_ptr() for t in (xn, row, self.q, self.k, att, out, gu))
        inputs = (w_in.data_ptr(), eps, qkv.data_ptr(), qn, kn, qk_eps)
        tail = (o.data_ptr(), w_post.data_ptr(), post_eps, gate_up.data_ptr(), down.data_ptr())
        self._qkv = (inputs, (xn_p, row_p, q_p, k_p, hidden, heads, kv_heads, d))
        self._rest = ((*tail, att_p, out_p, xn_p, gu_p, hidden, heads), (d, inter, d ** -0.5))
        self._layer = (inputs, tail, (hidden, heads, kv_heads, d, inter, d ** -0.5))

    def layer(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: int, values: int, length: int,
              head_stride: int, mask: torch.Tensor | None = None) -> None:
        """Rows h [n, hidden] through the whole layer in place (a decode row; a tree's rows under `mask`, a
        contiguous boolean [n, length] that `attends` takes, in fp32 one `tree_rows` serves), their K/V stored
        at positions `length - n` .. `length - 1` of the cache's keys/values (their addresses: [kv_heads,
        length, d], heads `head_stride` elements apart, rows d apart)."""
        inputs, tail, geometry = self._layer
        call(f"rows_layer_{self._suffix}", h.data_ptr(), *inputs, cos.data_ptr(), sin.data_ptr(), keys, values,
              length, head_stride, None if mask is None else mask.data_ptr(), *tail, h.shape[0], *geometry)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The input norm, q/k/v and the heads' norm + RoPE: (q [heads, 1, d], k and v [kv_heads, 1, d]),
        the layer's scratch (read before its next call)."""
        inputs, scratch = self._qkv
        call(f"decode_qkv_{self._suffix}", h.data_ptr(), *inputs, cos.data_ptr(), sin.data_ptr(), *scratch)
        return self.q, self.k, self.v

    def rest(self, h: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """h += the attention of `qkv`'s q over keys/values [kv_heads, S, d] through o_proj, then += the MLP of
        its post-attention norm, in place."""
        weights, geometry = self._rest
        call(f"decode_rest_{self._suffix}", h.data_ptr(), self.q.data_ptr(), keys.data_ptr(), values.data_ptr(),
              keys.shape[1], keys.stride(0), *weights, keys.shape[0], *geometry)
