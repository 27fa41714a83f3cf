"""The target's token embedding and LM head alone: all a drafter trainer needs of a target whose hidden states
come from the engine that serves it (training/served_features.py).

A 1T-parameter checkpoint is sharded; the safetensors index names the shard of each tensor, so only the one or
two shards holding the embedding and the head are opened, and of those only the two tensors are read. The
decoder's shards may be absent altogether.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ddscope.config import CheckpointError, read_json, text_config
from ddscope.models.weights import read_state_dict, save_weights

INDEX = "model.safetensors.index.json"


def _weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> shard file, from the index, or from the header of a single-file checkpoint."""
    index = directory / INDEX
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no {INDEX} and no *.safetensors file: the trainer needs the target's "
                              "embedding and LM head")
    names: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update(dict.fromkeys(st.keys(), f.name))
    return names


def _one(names: dict[str, str], suffix: str) -> str | None:
    """The single tensor name ending in `suffix` (`language_model.` prefixes of multimodal targets allowed; a
    decoder layer's own, as DeepSeek's MTP layer has, is not the model's)."""
    hits = sorted(n for n in names if (n == suffix or n.endswith("." + suffix)) and ".layers." not in n)
    if len(hits) > 1:
        raise CheckpointError(f"several tensors end in {suffix}: {hits[:4]}; cannot tell the language model's")
    return hits[0] if hits else None


def _read(directory: Path, names: dict[str, str], name: str) -> torch.Tensor:
    shard = directory / names[name]
    if not shard.is_file():
        raise CheckpointError(f"{directory}: {name} sits in shard {shard.name}, which is missing: copy that shard "
                              "(the decoder's shards may stay away)")
    with safe_open(str(shard), framework="pt") as st:
        return st.get_tensor(name)


class TargetHead(nn.Module):
    """`embed`, `logits` and `lm_head` of a target, as training reads them from a full `Target`."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor | None):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")  # no random V x H
        self.lm_head.weight = self.embed_tokens.weight if head is None else nn.Parameter(head, requires_grad=False)

    @classmethod
    def load(cls, directory: Path, device: torch.device, dtype: torch.dtype) -> "TargetHead":
        raw = text_config(read_json(directory / "config.json"))
        names = _weight_map(directory)
        embed_name, head_name = _one(names, "embed_tokens.weight"), _one(names, "lm_head.weight")
        tied = bool(raw.get("tie_word_embeddings", False))
        if embed_name is None:
            raise CheckpointError(f"{directory}: no embed_tokens.weight in its weights: the trainer embeds the "
                                  "drafter's block tokens with it")
        if head_name is None and not tied:
            raise CheckpointError(f"{directory}: no lm_head.weight in its weights and tie_word_embeddings is false: "
                                  "copy the shard holding the head")
        embed = _read(directory, names, embed_name)
        head = None if tied or head_name is None else _read(directory, names, head_name)
        return cls(embed, head).to(device=device, dtype=dtype).eval()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def has_decoder(directory: Path) -> bool:
    """Whether every shard the checkpoint names is present (the engine check needs the whole target)."""
    index = directory / INDEX
    if index.is_file():
        return all((directory / s).is_file() for s in set(json.loads(index.read_text())["weight_map"].values()))
    if not any(directory.glob("*.safetensors")):
        return True  # not ours to judge (.bin, or nothing): the target loader says what is wrong
    return any(".layers." in n for n in _weight_map(directory))


def head_only(src: Path, dst: Path) -> Path:
    """A copy of target `src` as a trainer beside a features server sees a 1T checkpoint: config, tokenizer and
    a sharded index whose shard with the embedding (and head) is present and whose decoder shard is not."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, dst / f.name)
    state = read_state_dict(src)
    head = {k: v for k, v in state.items() if k.endswith(("embed_tokens.weight", "lm_head.weight"))}
    save_weights(head, dst / "model-00001-of-00002.safetensors")
    names = {k: "model-00001-of-00002.safetensors" if k in head else "model-00002-of-00002.safetensors" for k in state}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return dst
