"""Reading safetensors checkpoints (single file or sharded) into a module, with strict key checks; writing them
with ordinary file permissions."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ddscope.config import CheckpointError


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / s for s in shards]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {directory}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"shard {f.name} listed in the index is missing from {directory}")
        state.update(load_file(str(f)))
    return state


def load_into(module: nn.Module, state: dict[str, torch.Tensor], where: Path,
              optional: tuple[str, ...] = ()) -> None:
    """Copy `state` into `module`, failing with the exact missing/unexpected/mis-shaped keys."""
    expected = module.state_dict()
    missing = sorted(k for k in expected if k not in state and k not in optional)
    unexpected = sorted(k for k in state if k not in expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: weights do not match the config. missing: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}; unexpected: {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{where}: tensor {name} has shape {tuple(tensor.shape)}, config implies {tuple(expected[name].shape)}")
    module.load_state_dict(state, strict=False)


def umask_mode(path: Path) -> None:
    """Give `path` the mode a plain open() would (0644 under the usual umask 022): safetensors writes through a
    private temporary file and keeps its 0600, so other users could not read the weights."""
    mask = os.umask(0)  # reading the umask means setting it; restored at once
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, with ordinary file permissions."""
    save_file(tensors, str(path))
    umask_mode(path)
