"""Writing DFlash drafters in the z-lab layout (what `Drafter.load` reads back), sized from a target."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ddscope.config import default_target_layer_ids, rope_theta_of, text_config
from ddscope.models.weights import save_weights
from ddscope.util.atomic import atomic_write_text

MASK_TOKEN = "<|mask|>"


LAST_LAYER_WHY = ("vLLM hands out its output before the final norm, SGLang refuses to capture it, and ddscope and HF "
                  "transformers take the normed one, so a drafter trained on it sees other features in each engine")


def pick_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """z-lab's spread, or an even spread where that one collapses (small L); never the last layer (LAST_LAYER_WHY)."""
    usable = num_target_layers - 1
    if n < 1 or n > usable:
        raise ValueError(f"need 1..{usable} target layer ids for a {num_target_layers}-layer target (its last layer "
                         f"is never used: {LAST_LAYER_WHY}), got {n}")
    ids = default_target_layer_ids(num_target_layers, n)
    if ids == sorted(set(ids)) and all(0 <= i < usable for i in ids):
        return ids
    if n == 1:
        return [min(num_target_layers // 2, usable - 1)]
    lo = 1 if n < usable else 0
    return [round(lo + i * (usable - 1 - lo) / (n - 1)) for i in range(n)]


def check_layer_ids(layer_ids: list[int], num_target_layers: int, option: str = "--target-layer-ids") -> None:
    """A one-line ValueError for ids the target has not, for its last layer, or for ids out of order (vLLM sorts
    them, so a drafter trained on another order would be fed its features shuffled there)."""
    missing = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if missing:
        raise ValueError(f"{option} {missing}: the target has no such layer (it has 0..{num_target_layers - 1})")
    if num_target_layers - 1 in layer_ids:
        raise ValueError(f"{option}: {num_target_layers - 1} is the target's last layer; {LAST_LAYER_WHY}. "
                         f"Pick ids below {num_target_layers - 1}")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"{option} {layer_ids}: an id is repeated")
    if layer_ids != sorted(layer_ids):
        raise ValueError(f"{option} {layer_ids}: give the ids in ascending order ({sorted(layer_ids)}), the order "
                         "vLLM feeds them to a drafter in")


def mask_token_id(tokenizer: Any, override: int | None, vocab_size: int) -> int:
    """The tokenizer's `<|mask|>` unless an explicit id is given; never guesses."""
    if override is None:
        override = tokenizer.get_vocab().get(MASK_TOKEN)
        if override is None:
            raise ValueError(f"the target tokenizer has no {MASK_TOKEN} token: pass --mask-token-id with a token "
                             "id that never occurs in the data")
    if not 0 <= override < vocab_size:
        raise ValueError(f"mask token id {override} outside the target vocab [0, {vocab_size})")
    return override


def drafter_config(target_raw: dict[str, Any], layers: int, block_size: int, mask_token_id: int,
                   target_layer_ids: list[int], nested_block_size: bool = False,
                   mask_token: str = MASK_TOKEN, sliding_window: int | None = None) -> dict[str, Any]:
    """A z-lab DFlash config.json: the target's Qwen3 geometry with `layers` layers, plus `dflash_config`,
    which also records what the drafter was trained against (SGLang's loader reads the mask token there).
    A multimodal target (Kimi K2.5/K2.6) nests its language model's config under `text_config`.
    With `sliding_window`, every layer is a bidirectional `sliding_attention` layer, in z-lab's fields."""
    archs = list(target_raw.get("architectures") or [])
    target_raw = text_config(target_raw)
    hidden, heads = int(target_raw["hidden_size"]), int(target_raw["num_attention_heads"])
    # The drafter runs plain RoPE at the target's base, whatever scaling the target uses (YaRN in DeepSeek-V3).
    plain_rope = {**target_raw, "rope_scaling": None,
                  "rope_parameters": {**(target_raw.get("rope_parameters") or {}), "rope_type": "default"}}
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": hidden, "intermediate_size": int(target_raw["intermediate_size"]),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": int(target_raw.get("num_key_value_heads") or heads),
        "head_dim": int(target_raw.get("head_dim") or hidden // heads),
        "rms_norm_eps": float(target_raw.get("rms_norm_eps", 1e-6)), "rope_theta": rope_theta_of(plain_rope),
        "max_position_embeddings": int(target_raw.get("max_position_embeddings", 4096)),
        "vocab_size": int(target_raw["vocab_size"]), "num_target_layers": int(target_raw["num_hidden_layers"]),
        "dflash_config": {"mask_token_id": mask_token_id, "mask_token": mask_token,
                          "target_layer_ids": list(target_layer_ids),
                          "num_target_layers": int(target_raw["num_hidden_layers"]),
                          "target_architectures": archs,
                          "target_hidden_size": hidden},
    }
    if sliding_window is not None:
        # is_causal is spelled out: z-lab's loader makes sliding layers causal when it is absent.
        cfg.update(layer_types=["sliding_attention"] * layers, sliding_window=sliding_window,
                   use_sliding_window=True, max_window_layers=0, is_causal=False)
    if nested_block_size:
        cfg["dflash_config"]["block_size"] = block_size
    else:
        cfg["block_size"] = block_size
    return cfg


def save_drafter(directory: Path, config: dict[str, Any], state: dict[str, torch.Tensor], prefix: str = "") -> Path:
    """config.json + model.safetensors (unprefixed keys unless `prefix`); the shared embed/head stay out."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {prefix + k: v.detach().cpu().contiguous() for k, v in state.items()
               if not k.startswith(("embed_tokens.", "lm_head."))}
    save_weights(tensors, directory / "model.safetensors")
    atomic_write_text(directory / "config.json", json.dumps(config, indent=2) + "\n")
    return directory
