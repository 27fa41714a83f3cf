"""A pure-PyTorch stand-in for the few `sgl_kernel` CPU helpers SGLang 0.5.23 imports unconditionally on its CPU
engine (SGLANG_USE_CPU_ENGINE=1): no CPU `sgl_kernel` is on the registry (sgl-kernel and sglang-kernel are CUDA-only).

It makes SGLang's CPU path runnable, nothing more: SGLang's scheduler, DFLASH worker, server and telemetry run
unmodified. It registers no torch op, so `torch.ops.sgl_kernel.*` stays empty, SGLang's AMX detection
(srt/utils/common.py:352-359) says no, and every layer takes SGLang's own pure-torch path.

Imported at module level when `_is_cpu` (file:line in the sglang 0.5.23 wheel):
- kernels/ops/kvcache/cache_move.py:9-10: copy_all_layer_kv_cache_cpu (called once at start with DFLASH,
  srt/mem_cache/memory_pool.py:2420);
- srt/mem_cache/allocation.py:45-46: assign_req_to_token_pool_cpu (every DFLASH step, allocation.py:746);
- kernels/ops/speculative/cache_locs.py:27-31: assign_extend_cache_locs_cpu (every DFLASH step, :740) and
  assign_draft_cache_locs_contiguous_cpu;
- kernels/ops/speculative/eagle.py:9-10 and spec_tree.py:39-43: EAGLE's helpers, imported but never called
  by plain decoding or DFLASH.
"""
from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+ddscope"


def _ranges(req_to_token: torch.Tensor, pools: torch.Tensor, start: torch.Tensor, end: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of req_to_token[pools[i], start[i]:end[i]] for every i, concatenated in order."""
    pools, start = pools.reshape(-1).long(), start.reshape(-1).long()
    lengths = end.reshape(-1).long() - start
    row = torch.repeat_interleave(torch.arange(pools.numel(), device=req_to_token.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    col = torch.arange(int(lengths.sum()), device=req_to_token.device) - first[row] + start[row]
    return pools[row], col


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:
    """req_to_token[pool i, start i:end i] = the next end i - start i entries of out_cache_loc."""
    rows, cols = _ranges(req_to_token, req_pool_indices, start_offset, end_offset)
    req_to_token[rows, cols] = out_cache_loc.reshape(-1)[:rows.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:
    """The converse: out_cache_loc's leading entries = req_to_token[pool i, start i:end i], in order."""
    rows, cols = _ranges(req_to_token, req_pool_indices, start_offset, end_offset)
    out_cache_loc.view(-1)[:rows.numel()] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk, num_steps) -> None:
    """Each request's next topk x num_steps slots after its sequence, in order."""
    start = seq_lens.reshape(-1).long()
    assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start, start + int(topk) * int(num_steps),
                                 out_cache_loc, pool_len)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """In every K and V layer buffer (base address data_ptrs[b], row stride strides[b] bytes): row tgt[i] = row
    src[i]. The rows are gathered before they are written, so overlapping sources and targets are safe."""
    tgt, src = tgt_loc.reshape(-1).long(), src_loc.reshape(-1).long()
    if not tgt.numel():
        return
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_ubyte * (rows * int(stride))).from_address(int(ptr))  # a view: no copy of the buffer
        view = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        view[tgt] = view[src]


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """EAGLE's: bonus_tokens[i] = the last accepted token of request i."""
    n = accept_lens.numel()
    index = torch.arange(n, device=accept_lens.device) * int(accept_stride) + accept_lens.reshape(-1).long() - 1
    bonus_tokens.view(-1)[:n] = accept_tokens.reshape(-1)[index].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc, size=None) -> None:
    """EAGLE's: the accepted entries' cache locations, compacted in order."""
    index = accept_index.reshape(-1).long()
    kept = index[index > -1]
    accept_out_cache_loc.view(-1)[:kept.numel()] = out_cache_loc.reshape(-1)[kept].to(accept_out_cache_loc.dtype)


def _eagle_tree_only(name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{name}: EAGLE's tree kernels are not in ddscope's sgl_kernel stand-in (plain decoding "
                           "and DFLASH never call them)")
    refuse.__name__ = name
    return refuse


build_tree_kernel_efficient_cpu = _eagle_tree_only("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _eagle_tree_only("verify_tree_greedy_cpu")
