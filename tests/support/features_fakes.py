"""Fake hidden-state servers over a real (tiny) target, for train-drafter --features-url's unit tests: the states
they hand out are the target's own, laid out as each engine lays them out.

- vLLM 0.32.0 with `extract_hidden_states` and a hidden-states connector: the completion answers
  `kv_transfer_params.hidden_states_path` (example_hidden_states_connector.py:559); the file holds
  `hidden_states [T, layers, H]` (vLLM ids sorted, id k = the input of layer k) and `token_ids`, written under
  an exclusive flock of `PATH.lock` (:285-289, :329-346). ddscope's connector adds the ids as metadata.
- SGLang 0.5.23 with `--enable-return-aux-hidden-states`: /server_info carries the resolved server args
  (entrypoints/http_server.py:853-888); /generate's `meta_info["hidden_states"]` is a list whose first entry is
  the prefill's [T][k*H] block, layers ascending (batch_result_processor.py:647-661, models/qwen3.py:524-531),
  T counting only the tokens this forward ran (a radix-cache hit drops the cached prefix, at least one token
  recomputed: schedule_batch.py:1766-1775); without the flags, 400 (tokenizer_manager.py:1398-1411).
"""
from __future__ import annotations

import fcntl
import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import save_file

from ddscope.models.target import Target
from ddscope.training.train_drafter import target_features


def _states(target: Target, ids: list[int], zlab: list[int]) -> torch.Tensor:
    """[T, len(zlab), H] for ascending z-lab ids."""
    flat = target_features(target, target.new_cache(len(ids)), ids, tuple(zlab))
    return flat.view(len(ids), len(zlab), -1)


def vllm_features_app(target: Target, storage: Path, vllm_ids: list[int], record_ids: bool = True,
                      hidden_states: bool = True, token_shift: int = 0) -> FastAPI:
    app = FastAPI()
    storage.mkdir(parents=True, exist_ok=True)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-target", "object": "model", "owned_by": "vllm"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        ids = body["prompt"]
        doc: dict[str, Any] = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                               "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                               "usage": {"prompt_tokens": len(ids), "completion_tokens": 1}}
        if not hidden_states:
            return doc
        path = str(storage / f"{uuid.uuid4().hex}.safetensors")
        fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            states = _states(target, ids, [k - 1 for k in sorted(vllm_ids)])
            tokens = torch.tensor([t + token_shift for t in ids])
            meta = {"vllm_aux_layer_ids": json.dumps(sorted(vllm_ids))} if record_ids else None
            save_file({"hidden_states": states.contiguous(), "token_ids": tokens}, path, metadata=meta)
        finally:
            os.close(fd)
        return {**doc, "kv_transfer_params": {"hidden_states_path": path}}

    return app


def sglang_app(target: Target, layer_ids: list[int] | None, radix_cache: bool = False) -> FastAPI:
    app = FastAPI()
    seen: list[list[int]] = []

    @app.get("/server_info")
    def server_info() -> dict[str, Any]:
        return {"enable_return_aux_hidden_states": layer_ids is not None,
                "return_aux_hidden_state_layer_ids": layer_ids, "return_hidden_states_mode": "full",
                "speculative_algorithm": None, "version": "0.5.23", "frontend": "python"}

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        ids = body["input_ids"]
        if body.get("return_hidden_states") and layer_ids is None:
            return JSONResponse({"error": {"message": "The server is not configured to return hidden states. "
                                           "Please set `--return-hidden-states-mode last`, ..."}}, status_code=400)
        cached = max((_common(ids, s) for s in seen), default=0) if radix_cache else 0
        cached = min(cached, len(ids) - 1)  # at least one token is recomputed
        seen.append(ids)
        block = _states(target, ids, sorted(layer_ids)).flatten(1)[cached:]
        meta = {"id": uuid.uuid4().hex, "prompt_tokens": len(ids), "completion_tokens": 1,
                "cached_tokens": cached, "finish_reason": {"type": "length", "length": 1},
                "hidden_states": [block.tolist()]}
        return {"text": "x", "output_ids": [5], "meta_info": meta}

    return app


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
