"""kernels.c: RMSNorm and the heads' norm + RoPE as one C call each, projections on panelled weights (fp32 and
bf16), the attention of a few rows (a decode step's, a tree's under its mask; fp32 trees as two panel products,
and a prefill's causal rows as the same products), and the MLP's silu(gate) * up. A decode row or a tree's rows
through a whole layer in one call: ddscope.models.layer_call.

torch spends five to eight dispatches on each RMSNorm and RoPE of a decode step; its products of one or a few
rows (a decode, a tree's verify) read the weights slower than the memory allows, and give a row other bits
among others than alone (oneDNN's bf16 too, at 512 rows and more; without bf16 instructions, at any count); its
attention of one row reads a long context's K/V slower than the memory allows (docs/performance.md, The engine
at its floor).

kernels.c is written once over vec.h's vector and built per ISA (ddscope.models.builds): the best this CPU runs,
or the one DDSCOPE_ISA names. With no compiler, or DDSCOPE_NATIVE=0, torch's ops run.
"""
from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

from ddscope.models import builds, pages

MAX_DIM = 16384  # kernels.c's widest row
DTYPES = builds.DTYPES
MAX_HEAD = 256  # kernels.c's attention: the widest head
TREE_VECTORS = 80  # query vectors (heads x rows) a unit of `tree_attend` and `causal_attend`: kernels.c's
MAX_ROWS = 128  # the most query rows `attend` takes (a tree's verify; a prefill's are many: SDPA blocks them)
# A panelled weight's rows (outputs) and columns come in multiples of these: fp32, 8 panels of 16 (kernels.c's
# tiles and decode rows take a group of 4); bf16, its AMX tiles' 2 panels of 16 by k blocks of 32.
PANEL_OUTPUTS = {torch.float32: 128, torch.bfloat16: 32}
PANEL_INPUTS = {torch.float32: 1, torch.bfloat16: 32}


@cache
def library() -> ctypes.CDLL | None:
    """kernels.c's build for `isa()`, as loaded; None where it can't be (with a warning saying why) or
    DDSCOPE_NATIVE=0."""
    if os.environ.get("DDSCOPE_NATIVE", "1") == "0":
        return None
    return builds.load(builds.isa())


def inexact(dtype: torch.dtype) -> str | None:
    """Why a CPU forward in `dtype` would not give each row the bits it gets alone (so greedy speculation would
    not commit `ar`'s tokens), or None where it does: fp32 always; bf16 on kernels.c's products."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and library() is not None):
        return None
    why = ("kernels.c is not loaded (DDSCOPE_NATIVE=0, or no C compiler)" if dtype == torch.bfloat16
           else "kernels.c has no float16 products")
    return (f"{str(dtype).removeprefix('torch.')} on the CPU needs kernels.c's products and {why}: torch's give a "
            "row other bits among other rows than alone, so speculation would not be lossless. Use float32.")


def _inference(*tensors: torch.Tensor) -> bool:
    """Nothing here to differentiate: kernels.c's ops have no backward."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def serves(*tensors: torch.Tensor) -> bool:
    """Whether kernels.c computes an op on these: contiguous CPU tensors of one of its dtypes, nothing to
    differentiate, and a library to call."""
    first = tensors[0]
    return (first.device.type == "cpu" and first.dtype in DTYPES and first.shape[-1] <= MAX_DIM
            and _inference(*tensors)
            and all(t.dtype == first.dtype and t.is_contiguous() for t in tensors) and library() is not None)


def has(name: str) -> bool:
    """Whether kernels.c is loaded and its build has `name` (the AMX and AVX512-BF16 peak loops need those ISAs)."""
    return library() is not None and hasattr(library(), name)


def call(name: str, *args) -> None:
    """kernels.c's `name` on torch's intra-op threads: a thread of its own (a server's worker) has OpenMP's
    default, not what torch was told."""
    getattr(library(), name)(*args, torch.get_num_threads())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * RMSNorm(x)` over the last dimension."""
    y = torch.empty_like(x)
    dim = x.shape[-1]
    call(f"rms_norm_{DTYPES[x.dtype]}", x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, eps)
    return y


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int,
              eps: float) -> torch.Tensor:
    """x [n, heads * d] -> [heads, n, d]: each head RMSNormed by `weight` (None: not normed), then rotated by
    cos/sin [n, d]."""
    n, d = x.shape[0], cos.shape[-1]
    y = torch.empty(heads, n, d, dtype=x.dtype)
    call(f"norm_rope_{DTYPES[x.dtype]}", x.data_ptr(), None if weight is None else weight.data_ptr(), cos.data_ptr(),
          sin.data_ptr(), y.data_ptr(), n, heads, d, eps)
    return y


BF16_PRODUCTS = {1: "amx", 2: "avx512-bf16", 3: "widened"}


def bf16_products() -> str:
    """Which of kernels.c's bf16 products this build runs: the tile unit's (AMX, where Linux lends it), vdpbf16ps
    (AVX512-BF16 without the tiles, e.g. AMD Zen 4 and 5), or bf16 widened to fp32 by a shift into FMAs (every
    other CPU); none (torch's) where kernels.c is not loaded."""
    return BF16_PRODUCTS[library().bf16_products()] if library() is not None else "none"


def kernels() -> str:
    """The build kernels.c runs here, as chosen when it loaded: e.g. "avx2 (bf16 widened)", "avx512 (bf16
    avx512-bf16)", or torch's ops where it did not load (no compiler, DDSCOPE_NATIVE=0)."""
    if library() is None:
        return "torch (kernels.c not loaded)"
    return f"{library().kernels_isa().decode()} (bf16 {bf16_products()})"


def paneled(weight: torch.Tensor) -> bool:
    """Whether `linear` serves this weight: fp32, or bf16 where `bf16_products` has a kernel; its shape whole
    panels."""
    dtype = weight.dtype
    return (dtype in PANEL_OUTPUTS and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % PANEL_OUTPUTS[dtype] == 0 and weight.shape[1] % PANEL_INPUTS[dtype] == 0
            and has(f"linear_{DTYPES[dtype]}"))


def panels(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] reordered for `linear`: fp32, groups of 64 outputs whose k rows lie one after another;
    bf16, panels of 16 outputs, k-major in pairs within each."""
    weight = weight.detach().contiguous()
    out = pages.huge(weight.shape, weight.dtype)
    call(f"pack_{DTYPES[weight.dtype]}", weight.data_ptr(), out.data_ptr(), *weight.shape)
    return out


def linear(x: torch.Tensor, panelled: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T with W as `panels` gave it: each row's result the same bits whatever M."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], panelled.shape[0], dtype=x.dtype)
    call(f"linear_{DTYPES[x.dtype]}", x.data_ptr(), panelled.data_ptr(), y.data_ptr(), *x.shape, panelled.shape[0])
    return y


def attends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `attend` computes this: a few query rows (a decode step, one sequence's of a batch, a tree's
    verify), q [heads, n, d] with its rows and values contiguous, K/V heads with rows d apart and the same
    strides, `mask` None or a contiguous boolean [n, S], and nothing to differentiate."""
    heads, n, d = q.shape
    return (masks_rows(q.dtype, heads, k.shape[0], d) and n <= MAX_ROWS and (n == 1 or q.stride(1) == d)
            and _laid_out(q, k, v) and (mask is None or (mask.dtype == torch.bool and mask.shape == (n, k.shape[1])
                                                         and mask.is_contiguous())))


def _laid_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q's values contiguous, K/V heads with rows d apart and the same strides, one dtype, on the CPU, and
    nothing to differentiate."""
    return (q.device.type == "cpu" and k.dtype == v.dtype == q.dtype and q.stride(2) == 1 and k.stride() == v.stride()
            and k.stride(1) == q.shape[2] and k.stride(2) == 1 and _inference(q, k, v))


def masks_rows(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `attend` serves this geometry and dtype: a caller keeps its tree's mask boolean for it."""
    return (dtype in DTYPES and head_dim % 16 == 0 and head_dim <= MAX_HEAD and heads % kv_heads == 0
            and has("attend_f32"))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of q [heads, n, d] over k, v [kv_heads, S, d], where `mask` [n, S] allows (None:
    every key) -> [n, heads * d]: each row the bits it gets alone over the same keys."""
    heads, n, d = q.shape
    out = torch.empty(n, heads * d, dtype=q.dtype)
    call(f"attend_{DTYPES[q.dtype]}", q.data_ptr(), k.data_ptr(), v.data_ptr(),
          None if mask is None else mask.data_ptr(), out.data_ptr(), heads, k.shape[0], n, k.shape[1], d,
          q.stride(0), k.stride(0), d ** -0.5)
    return out


def tree_rows(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `tree_attend` serves this geometry and dtype (fp32, head_dim a multiple of 64), at any number of
    keys: past 2k keys too, a verify's forward in kernels.c beat MKL's batched products (docs/performance.md)."""
    return _panel_heads(dtype, heads, kv_heads, head_dim) and has("tree_attend_f32")


def _panel_heads(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """The geometry the fp32 panel products of the heads take: head_dim a multiple of 64, as `attend` takes it."""
    return dtype == torch.float32 and head_dim % 64 == 0 and masks_rows(dtype, heads, kv_heads, head_dim)


def tree_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`attend` of a tree's rows (or a few causal rows) as two panel products, in fp32: faster than MKL's
    batched products for a verify of 33 rows over 1057 keys (docs/journal.md); each row's result the same
    whatever the rows beside it, though not the bits `attend` gives it."""
    heads, n, d = q.shape
    out = torch.empty(n, heads * d, dtype=q.dtype)
    call("tree_attend_f32", q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), out.data_ptr(), heads,
          k.shape[0], n, k.shape[1], d, q.stride(0), k.stride(0), d ** -0.5)
    return out


def causal_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `causal_attend` computes this: `tree_attend`'s geometry (any number of keys; a unit holds whole
    rows, so at most TREE_VECTORS query heads a K/V head), q's rows contiguous."""
    heads, n, d = q.shape
    return (_panel_heads(q.dtype, heads, k.shape[0], d) and heads // k.shape[0] <= TREE_VECTORS
            and has("causal_attend_f32") and q.stride(1) == d and k.shape[1] >= n and _laid_out(q, k, v))


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [heads, n, d], the last n positions of k, v [kv_heads, S, d] (a prefill's rows
    after a prefix of S - n), as `tree_attend`'s products: each row the bits a tree's row over its keys gets."""
    heads, n, d = q.shape
    out = torch.empty(n, heads * d, dtype=q.dtype)
    call("causal_attend_f32", q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), heads, k.shape[0], n,
          k.shape[1] - n, d, q.stride(0), k.stride(0), d ** -0.5)
    return out


def gates(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `silu_mul` computes silu(gate) * up."""
    return serves(gate, up) and gate.shape == up.shape and has("silu_mul_f32")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one pass (bf16: rounded after the silu and after the product, as torch's two ops)."""
    y = torch.empty_like(gate)
    call(f"silu_mul_{DTYPES[gate.dtype]}", gate.data_ptr(), up.data_ptr(), y.data_ptr(), gate.numel())
    return y
