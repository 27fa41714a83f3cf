"""An SGLang general plugin (entry point `sglang.srt.plugins`, found through the dist-info beside this file when this
folder is on PYTHONPATH): it lets SGLang 0.5.23's CPU engine serve DFLASH. Loaded by SGLang in each of its processes
(launch_server.py:79, and each scheduler's start), never by ddscope; with SGLANG_USE_CPU_ENGINE unset it does nothing.

It makes SGLang's CPU path runnable, nothing more: SGLang's scheduler, DFLASH worker, server and telemetry run
unmodified. Four patches (file:line in the sglang 0.5.23 wheel):
1. `_handle_dflash` (srt/arg_groups/speculative_hook.py:287-301) refuses any device but CUDA, NPU and XPU; for its
   one call on a CPU it sees a platform that supports DFLASH with a torch_native draft backend, which is also added
   to the draft backends' choices (srt/arg_groups/choices.py:103, 227).
2. torch_native has no target-verify path: DFLASH verifies (and drafts) a straight block in TARGET_VERIFY mode,
   where `extend_prefix_lens` is None and `seq_lens` is the prefix without the block, so `_run_sdpa_forward_extend`
   fails its assert (srt/layers/attention/torch_native_backend.py:101). A block is an extend of n tokens over the
   prefix: the batch is given those lengths for the call, and torch_native's own extend runs it (causal for the
   target's layers, not for the drafter's encoder-only ones). torch_native's extend drops the sliding window of a
   layer that is not causal (:325-333), as a DFlash drafter's `sliding_attention` layers are (`is_causal: false`;
   srt/models/dflash.py:157-190): for those the block runs with the window kept, each query seeing the keys at most
   `window_left` before it (the window flashinfer keeps on CUDA, flashinfer_backend.py:1427), all later ones.
3. `Tensor.record_stream` raises on a CPU tensor (srt/speculative/dflash_worker_v2.py:2481): a no-op there.
4. `ModelRunner._extend_forward_kwargs` casts input embeddings to bfloat16 (srt/model_executor/model_runner.py:1772)
   whatever the serving dtype; on a CPU they are cast to the runner's dtype instead, from the original tensor.
"""
from __future__ import annotations

import os

import torch


def _dflash_on_cpu(original, server_args, *args, **kwargs):
    import sglang.srt.arg_groups.speculative_hook as hook

    real = hook.current_platform
    if hook.resolving_view(server_args).device != "cpu" or real.is_out_of_tree():
        return original(server_args, *args, **kwargs)
    hook.current_platform = _CpuDflash(real)
    try:
        return original(server_args, *args, **kwargs)
    finally:
        hook.current_platform = real


class _CpuDflash:
    """The CPU platform, but for DFLASH with a torch_native draft backend."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == "DFLASH"

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return backend == "torch_native"

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "torch_native"


def _block_as_extend(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    batch = forward_batch
    if not batch.forward_mode.is_target_verify() or batch.extend_prefix_lens is not None:
        return original(self, q, k, v, layer, batch, save_kv_cache, **kwargs)
    if getattr(batch.spec_info, "custom_mask", None) is not None:  # a tree (EAGLE, topk > 1): not what DFLASH verifies
        raise ValueError("ddscope's CPU plugin verifies DFLASH's straight block; a tree-masked verify is refused")
    requests = int(batch.req_pool_indices.shape[0])
    prefix = batch.seq_lens[:requests].long()
    block = torch.full_like(prefix, q.shape[0] // requests)
    saved = batch.seq_lens, batch.extend_prefix_lens, batch.extend_seq_lens
    batch.seq_lens, batch.extend_prefix_lens, batch.extend_seq_lens = prefix + block, prefix, block
    try:
        if _windowed_bidirectional(layer):
            return _windowed_block(self, q, k, v, layer, batch, save_kv_cache)
        return original(self, q, k, v, layer, batch, save_kv_cache, **kwargs)
    finally:
        batch.seq_lens, batch.extend_prefix_lens, batch.extend_seq_lens = saved


def _windowed_bidirectional(layer) -> bool:
    from sglang.srt.layers.radix_attention import AttentionType

    window = layer.sliding_window_size
    return layer.attn_type == AttentionType.ENCODER_ONLY and window is not None and window > -1


def _windowed_block(backend, q, k, v, layer, batch, save_kv_cache: bool):
    """torch_native's extend of a non-causal layer, its sliding window kept: keys from `window_left` before each
    query on, later ones included."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache:
        backend.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    out = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    backend._make_sliding_window_mask = _left_window  # this call only: the instance shadows the static method
    try:
        backend._run_sdpa_forward_extend(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), out.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            backend.token_to_kv_pool.get_key_buffer(layer.layer_id),
            backend.token_to_kv_pool.get_value_buffer(layer.layer_id), backend.req_to_token_pool.req_to_token,
            batch.req_pool_indices, batch.seq_lens, batch.extend_prefix_lens, batch.extend_seq_lens, None,
            scaling=layer.scaling, enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num, causal=False,
            is_cross_attn=False, sliding_window_size=layer.sliding_window_size)
    finally:
        del backend._make_sliding_window_mask
    return out


def _left_window(*, q_len: int, kv_len: int, sliding_window_size: int, device, query_offset: int = 0):
    q_pos = torch.arange(query_offset, query_offset + q_len, device=device).unsqueeze(1)
    return torch.arange(kv_len, device=device).unsqueeze(0) >= q_pos - sliding_window_size


def _record_stream_off_cpu(original, self, *args, **kwargs):
    return None if self.device.type == "cpu" else original(self, *args, **kwargs)


def _embeds_in_serving_dtype(result, self, forward_batch, *args, **kwargs):
    embeds = result.get("input_embeds") if isinstance(result, dict) else None
    if (embeds is None or forward_batch.input_embeds is None or str(self.device) != "cpu"
            or embeds.dtype == self.dtype):
        return result
    source = forward_batch.input_embeds if forward_batch.replace_embeds is None else embeds
    result["input_embeds"] = source.to(self.dtype)
    return result


def register() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES, add_draft_attention_backend_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if "torch_native" not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices(["torch_native"])
    for target, hook, kind in (
            ("sglang.srt.arg_groups.speculative_hook._handle_dflash", _dflash_on_cpu, HookType.AROUND),
            ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
             _block_as_extend, HookType.AROUND),
            ("torch.Tensor.record_stream", _record_stream_off_cpu, HookType.AROUND),
            ("sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs", _embeds_in_serving_dtype,
             HookType.AFTER)):
        HookRegistry.register(target, hook, kind)
