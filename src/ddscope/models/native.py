"""kernels.c: RMSNorm and the heads' norm + RoPE as one C call each, projections on panelled weights (fp32; bf16
on AMX), the attention of a few rows (a decode step's, a tree's under its mask; fp32 trees as two panel
products), the MLP's silu(gate) * up, and a decode row or a tree's rows through a whole layer in one call.

torch spends five to eight dispatches on each RMSNorm and RoPE of a decode step; its products of one or a few
rows (a decode, a tree's verify) read the weights slower than the memory allows, and give a row other bits
among others than alone (oneDNN's bf16 too, at 512 rows and more); its attention of one row reads a long
context's K/V slower than the memory allows (docs/performance.md, The engine at its floor). The file is
compiled with the system C compiler on first use and cached under DDSCOPE_CACHE by its source, compiler and
CPU; with no compiler, or with DDSCOPE_NATIVE=0, torch's ops run instead; all but the norms need AVX-512, and
the bf16 products AMX.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

from ddscope.models import pages

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
MAX_DIM = 16384  # kernels.c's widest row
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int  # _T: the threads to run on
_SIGNATURES = {"rms_norm": (_P, _P, _P, _I, _I, _F, _T), "norm_rope": (_P, _P, _P, _P, _P, _I, _I, _I, _F, _T)}
_AVX512_SIGNATURES = {"pack_f32": (_P, _P, _I, _I, _T), "linear_f32": (_P, _P, _P, _I, _I, _I, _T),
                     "pack_bf16": (_P, _P, _I, _I, _T), "linear_bf16": (_P, _P, _P, _I, _I, _I, _T), "amx_ready": (),
                     "fma_peak_f32": (_I, _P, _T), "amx_peak_bf16": (_I, _P, _T), "read_peak_f32": (_P, _I, _P, _T),
                     "attend_f32": (_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _T),
                     "attend_bf16": (_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _T),
                     "tree_attend_f32": (_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _T),
                     "silu_mul_f32": (_P, _P, _P, _I, _T), "silu_mul_bf16": (_P, _P, _P, _I, _T),
                     **{f"decode_qkv_{s}": (_P, _P, _F, _P, _P, _P, _F, *[_P] * 6, *[_I] * 4, _T)
                        for s in _DTYPES.values()},
                     **{f"decode_rest_{s}": (*[_P] * 4, _I, _I, _P, _P, _F, *[_P] * 6, *[_I] * 5, _F, _T)
                        for s in _DTYPES.values()},
                     **{f"rows_layer_{s}": (_P, _P, _F, _P, _P, _P, _F, *[_P] * 4, _I, _I, _P, _P, _P, _F, _P, _P,
                                            *[_I] * 6, _F, _T) for s in _DTYPES.values()}}
MAX_HEAD = 256  # kernels.c's attention: the widest head
TREE_KEYS = 2048  # the most keys `tree_attend` takes (floor_ab.py, tree-attention-fp32: 0.93 at 1057, 1.04 at 4129)
MAX_ROWS = 128  # the most query rows `attend` takes (a tree's verify; a prefill's are many: SDPA blocks them)
# A panelled weight's rows (outputs) and columns come in multiples of these: fp32, 8 panels of 16 (kernels.c's
# tiles and decode rows take a group of 4); bf16, its AMX tiles' 2 panels of 16 by k blocks of 32.
PANEL_OUTPUTS = {torch.float32: 128, torch.bfloat16: 32}
PANEL_INPUTS = {torch.float32: 1, torch.bfloat16: 32}


def _cpu_key() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    return next((line for line in info.splitlines() if line.startswith("flags")), "unknown")


def _build(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True,
                       text=True, timeout=300)
        os.replace(built, out)  # atomic: a concurrent loader sees the old file or the whole new one


@cache
def library() -> ctypes.CDLL | None:
    """kernels.c as loaded (built if its cache entry is missing); None where it can't be (with a warning
    saying why) or DDSCOPE_NATIVE=0."""
    if os.environ.get("DDSCOPE_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("no C compiler: ddscope runs kernels.c's ops as torch ops (slower on CPU)", stacklevel=2)
        return None
    key = hashlib.sha256("|".join((SOURCE.read_text(), compiler, *FLAGS, _cpu_key())).encode()).hexdigest()[:16]
    root = Path(os.environ.get("DDSCOPE_CACHE", Path.home() / ".cache" / "ddscope"))
    path = root / "kernels" / f"kernels-{key}.so"
    try:
        if not path.is_file():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"kernels.c did not build or load ({detail.strip()[:500]}): torch ops run instead",
                      stacklevel=2)
        return None
    for name, args in _SIGNATURES.items():
        for suffix in _DTYPES.values():
            getattr(lib, f"{name}_{suffix}").argtypes = args
    for name, args in _AVX512_SIGNATURES.items():
        if hasattr(lib, name):  # built where the compiler targets AVX-512
            getattr(lib, name).argtypes = args
    return lib


def _inference(*tensors: torch.Tensor) -> bool:
    """Nothing here to differentiate: kernels.c's ops have no backward."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def serves(*tensors: torch.Tensor) -> bool:
    """Whether kernels.c computes an op on these: contiguous CPU tensors of one of its dtypes, nothing to
    differentiate, and a library to call."""
    first = tensors[0]
    return (first.device.type == "cpu" and first.dtype in _DTYPES and first.shape[-1] <= MAX_DIM
            and _inference(*tensors)
            and all(t.dtype == first.dtype and t.is_contiguous() for t in tensors) and library() is not None)


def has(name: str) -> bool:
    """Whether the library was built with `name` (the AVX-512 ones need a compiler targeting it)."""
    return library() is not None and hasattr(library(), name)


def _call(name: str, *args) -> None:
    """kernels.c's `name` on torch's intra-op threads: a thread of its own (a server's worker) has OpenMP's
    default, not what torch was told."""
    getattr(library(), name)(*args, torch.get_num_threads())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * RMSNorm(x)` over the last dimension."""
    y = torch.empty_like(x)
    dim = x.shape[-1]
    _call(f"rms_norm_{_DTYPES[x.dtype]}", x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, eps)
    return y


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int,
              eps: float) -> torch.Tensor:
    """x [n, heads * d] -> [heads, n, d]: each head RMSNormed by `weight` (None: not normed), then rotated by
    cos/sin [n, d]."""
    n, d = x.shape[0], cos.shape[-1]
    y = torch.empty(heads, n, d, dtype=x.dtype)
    _call(f"norm_rope_{_DTYPES[x.dtype]}", x.data_ptr(), None if weight is None else weight.data_ptr(), cos.data_ptr(),
          sin.data_ptr(), y.data_ptr(), n, heads, d, eps)
    return y


def paneled(weight: torch.Tensor) -> bool:
    """Whether `linear` serves this weight: on a CPU with AVX-512, fp32, or bf16 where the CPU has AMX and Linux
    lends it; its shape whole panels."""
    dtype = weight.dtype
    return (dtype in PANEL_OUTPUTS and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % PANEL_OUTPUTS[dtype] == 0 and weight.shape[1] % PANEL_INPUTS[dtype] == 0
            and has(f"linear_{_DTYPES[dtype]}") and (dtype != torch.bfloat16 or bool(library().amx_ready())))


def panels(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] reordered for `linear`: fp32, groups of 64 outputs whose k rows lie one after another;
    bf16, panels of 16 outputs, k-major in pairs within each."""
    weight = weight.detach().contiguous()
    out = pages.huge(weight.shape, weight.dtype)
    _call(f"pack_{_DTYPES[weight.dtype]}", weight.data_ptr(), out.data_ptr(), *weight.shape)
    return out


def linear(x: torch.Tensor, panelled: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T with W as `panels` gave it: each row's result the same bits whatever M."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], panelled.shape[0], dtype=x.dtype)
    _call(f"linear_{_DTYPES[x.dtype]}", x.data_ptr(), panelled.data_ptr(), y.data_ptr(), *x.shape, panelled.shape[0])
    return y


def attends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `attend` computes this: a few query rows (a decode step, one sequence's of a batch, a tree's
    verify), q [heads, n, d] with its rows and values contiguous, K/V heads with rows d apart and the same
    strides, `mask` None or a contiguous boolean [n, S], and nothing to differentiate."""
    heads, n, d = q.shape
    return (masks_rows(q.dtype, heads, k.shape[0], d) and n <= MAX_ROWS and q.device.type == "cpu"
            and k.dtype == v.dtype == q.dtype and q.stride(2) == 1 and (n == 1 or q.stride(1) == d)
            and k.stride() == v.stride() and k.stride(1) == d and k.stride(2) == 1
            and (mask is None or (mask.dtype == torch.bool and mask.shape == (n, k.shape[1])
                                  and mask.is_contiguous()))
            and _inference(q, k, v))


def masks_rows(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `attend` serves this geometry and dtype: a caller keeps its tree's mask boolean for it."""
    return (dtype in _DTYPES and head_dim % 16 == 0 and head_dim <= MAX_HEAD and heads % kv_heads == 0
            and has("attend_f32"))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of q [heads, n, d] over k, v [kv_heads, S, d], where `mask` [n, S] allows (None:
    every key) -> [n, heads * d]: each row the bits it gets alone over the same keys."""
    heads, n, d = q.shape
    out = torch.empty(n, heads * d, dtype=q.dtype)
    _call(f"attend_{_DTYPES[q.dtype]}", q.data_ptr(), k.data_ptr(), v.data_ptr(),
          None if mask is None else mask.data_ptr(), out.data_ptr(), heads, k.shape[0], n, k.shape[1], d,
          q.stride(0), k.stride(0), d ** -0.5)
    return out


def tree_rows(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, keys: int) -> bool:
    """Whether `tree_attend` serves this geometry, dtype and keys (fp32, head_dim a multiple of 64, keys up to
    TREE_KEYS: past them a unit's scores leave L2, and MKL's batched products were faster)."""
    return (dtype == torch.float32 and head_dim % 64 == 0 and keys <= TREE_KEYS
            and masks_rows(dtype, heads, kv_heads, head_dim) and has("tree_attend_f32"))


def tree_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`attend` of a tree's rows (or a few causal rows) as two panel products, in fp32: faster than MKL's
    batched products for a verify of 33 rows over 1057 keys (docs/performance.md); each row's result the same
    whatever the rows beside it, though not the bits `attend` gives it."""
    heads, n, d = q.shape
    out = torch.empty(n, heads * d, dtype=q.dtype)
    _call("tree_attend_f32", q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), out.data_ptr(), heads,
          k.shape[0], n, k.shape[1], d, q.stride(0), k.stride(0), d ** -0.5)
    return out


def gates(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `silu_mul` computes silu(gate) * up: `serves` and AVX-512."""
    return serves(gate, up) and gate.shape == up.shape and has("silu_mul_f32")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one pass (bf16: rounded after the silu and after the product, as torch's two ops)."""
    y = torch.empty_like(gate)
    _call(f"silu_mul_{_DTYPES[gate.dtype]}", gate.data_ptr(), up.data_ptr(), y.data_ptr(), gate.numel())
    return y


def decodes(dtype: torch.dtype) -> bool:
    """Whether the library has the calls of rows through a layer (`rows_layer`; a decode row's `decode_qkv`,
    `decode_rest`)."""
    return dtype in _DTYPES and has(f"decode_qkv_{_DTYPES[dtype]}")


class DecodeRow:
    """One decode row h [1, hidden] through a layer in kernels.c, the bits its modules give one by one: in one
    call where the cache's slots lie in one run (`layer`), else in two around the cache's write (`qkv`, `rest`).
    The layer's weights, geometry and scratch are bound once, so a step's Python is those calls. `qkv` holds
    q's, k's and v's panels one after another, `gate_up` the gate's and up's (one product each; every output is
    summed alone, so the modules' views of them give the same bits). A layer decodes one row at a time."""

    def __init__(self, w_in: torch.Tensor, eps: float, qkv: torch.Tensor,
                 norms: tuple[torch.Tensor | None, torch.Tensor | None], qk_eps: float, o: torch.Tensor,
                 w_post: torch.Tensor, post_eps: float, gate_up: torch.Tensor, down: torch.Tensor, heads: int,
                 kv_heads: int, d: int):
        dtype, hidden, inter = w_in.dtype, w_in.shape[0], down.shape[1]
        self._weights = (w_in, qkv, *norms, o, w_post, gate_up, down)  # alive while their pointers are bound
        self._suffix = _DTYPES[dtype]
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
        _call(f"rows_layer_{self._suffix}", h.data_ptr(), *inputs, cos.data_ptr(), sin.data_ptr(), keys, values,
              length, head_stride, None if mask is None else mask.data_ptr(), *tail, h.shape[0], *geometry)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The input norm, q/k/v and the heads' norm + RoPE: (q [heads, 1, d], k and v [kv_heads, 1, d]),
        the layer's scratch (read before its next call)."""
        inputs, scratch = self._qkv
        _call(f"decode_qkv_{self._suffix}", h.data_ptr(), *inputs, cos.data_ptr(), sin.data_ptr(), *scratch)
        return self.q, self.k, self.v

    def rest(self, h: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """h += the attention of `qkv`'s q over keys/values [kv_heads, S, d] through o_proj, then += the MLP of
        its post-attention norm, in place."""
        weights, geometry = self._rest
        _call(f"decode_rest_{self._suffix}", h.data_ptr(), self.q.data_ptr(), keys.data_ptr(), values.data_ptr(),
              keys.shape[1], keys.stride(0), *weights, keys.shape[0], *geometry)
