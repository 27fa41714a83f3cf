"""A transformers-backed target for any causal-LM architecture, with the native `Target`'s interface.

The native model (model.py) covers Qwen3 and Llama and stays the fast default. Any other architecture
(DeepSeek-V3-style MoE with MLA attention, ...) runs through `AutoModelForCausalLM`: a tree verifies with
a 4D ancestor mask and explicit `position_ids` over a `DynamicCache`, which reproduces sequential
decoding, and the accepted entries are compacted like the native cache's. Features follow the z-lab
indexing: layer id i is HF `hidden_states[i + 1]` (the last one normed, as in HF).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache

from ddscope.config import (SUPPORTED_TARGETS, CheckpointError, DecoderGeometry, TargetConfig, read_json, text_config,
                            token_ids)
from ddscope.models.kv_pool import KVCache
from ddscope.models.target import ForwardOut, KVCacheFull, Segment, Target

BACKENDS = ("auto", "native", "transformers")


class HFCache:
    """A DynamicCache with the bookkeeping the decoder uses on `KVCache`: `length`, `capacity`, `keep`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.dynamic = DynamicCache()

    @property
    def length(self) -> int:
        return self.dynamic.get_seq_length()

    @length.setter
    def length(self, value: int) -> None:
        """Truncate, or grow with zero slots as the native cache's stale ones (`budget.VerifyCost` times
        forwards at a cache length, whatever it holds)."""
        if value == 0:
            self.dynamic = DynamicCache()
        elif value < self.length:
            self.dynamic.crop(value - self.length)  # transformers 5.x: a negative count of slots to drop
        elif value > self.length:
            if not self.dynamic.layers or not self.dynamic.layers[0].is_initialized:
                raise ValueError(f"cannot grow an empty cache to {value} slots")
            for layer in self.dynamic.layers:
                layer.keys, layer.values = _grow(layer.keys, value), _grow(layer.values, value)

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Keep `[0, start)` and the accepted tree slots `start + slots`, in that order."""
        for layer in self.dynamic.layers:
            idx = torch.cat([torch.arange(start, device=slots.device), slots + start]).to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)


def _grow(t: torch.Tensor, length: int) -> torch.Tensor:
    """Zero slots appended along the sequence axis of a [batch, heads, seq, dim] cache tensor, up to `length`."""
    return torch.cat([t, t.new_zeros(*t.shape[:-2], length - t.shape[-2], t.shape[-1])], dim=-2)


def _target_config(raw: dict, model: nn.Module) -> TargetConfig:
    """The fields the engine and the drafter loader read; attention details stay inside transformers."""
    c = model.config
    heads = int(getattr(c, "num_attention_heads", 1))
    geometry = DecoderGeometry(
        hidden_size=int(c.hidden_size), num_layers=int(c.num_hidden_layers), num_heads=heads,
        num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        intermediate_size=int(getattr(c, "intermediate_size", 0)), rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        rope_theta=float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)), qk_norm=False)
    return TargetConfig(
        arch=str(c.model_type), geometry=geometry, vocab_size=int(c.vocab_size),
        max_position_embeddings=int(getattr(c, "max_position_embeddings", 4096)),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(c, "attention_bias", False)),
        eos_token_ids=token_ids(raw.get("eos_token_id")))


class HFTarget(nn.Module):
    """`Target`'s interface (`cfg`, `lm_head`, `embed`, `logits`, `new_cache`, `forward`) over a transformers model."""

    def __init__(self, model: nn.Module, cfg: TargetConfig):
        super().__init__()
        self.model, self.cfg = model, cfg

    @classmethod
    def load(cls, directory: Path, device: torch.device, dtype: torch.dtype,
             device_map: str | None = None) -> "HFTarget":
        """`device_map` (e.g. "auto") shards a target too large for one device over all visible ones."""
        raw = read_json(directory / "config.json")
        archs = raw.get("architectures") or []
        text = text_config(raw)
        if text.get("sliding_window") is not None and text.get("use_sliding_window", True):
            raise CheckpointError(f"{directory}: sliding-window attention is not supported (KV compaction assumes "
                                  "full-length layers)")
        try:
            model, info = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, device_map=device_map,
                                                               output_loading_info=True)
        except (OSError, ValueError, KeyError) as e:
            reason = str(e).splitlines()[0]
            raise CheckpointError(f"{directory}: {archs} is not supported natively and transformers cannot load it "
                                  f"({reason})") from e
        # transformers would fill missing weights with random ones: a target must load whole.
        bad = info["missing_keys"] or info["mismatched_keys"]
        if bad:
            raise CheckpointError(f"{directory}: {archs} is not supported natively and its weights do not fit "
                                  f"transformers' {type(model).__name__} (missing or mismatched: {sorted(bad)[:3]})")
        if device_map is None:
            model.to(device)
        return cls(model.eval(), _target_config(raw, model))

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def new_cache(self, capacity: int) -> HFCache:
        return HFCache(capacity)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        # On the head's device, where the drafter runs: with `device_map` the embedding may sit on another GPU.
        return self.model.get_input_embeddings()(tokens).to(self.lm_head.weight.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: HFCache,
                mask: torch.Tensor | None = None, capture: tuple[int, ...] = (), last_only: bool = False,
                tail: int | None = None) -> ForwardOut:
        """As `Target.forward`: `mask` is a boolean [n, cache.length + n] (True = may attend), None = causal.
        `tail` is a hint this backend does not take: features come for every row."""
        start, n = cache.length, tokens.shape[0]
        if start + n > cache.capacity:
            raise KVCacheFull(f"KV cache full: {start} + {n} tokens > capacity {cache.capacity}")
        attn = None
        if mask is not None or (start > 0 and n > 1):
            if mask is None:
                mask = torch.ones(n, start + n, dtype=torch.bool, device=tokens.device).tril(start)
            # An additive 4D mask is used as given by every attention implementation (bool is not, by eager).
            dtype = self.lm_head.weight.dtype
            attn = torch.zeros(mask.shape, dtype=dtype, device=tokens.device).masked_fill(
                ~mask, torch.finfo(dtype).min)[None, None]
        out = self.model(input_ids=tokens[None], position_ids=positions[None], attention_mask=attn,
                         past_key_values=cache.dynamic, use_cache=True, output_hidden_states=bool(capture),
                         logits_to_keep=1 if last_only else 0)
        # With `device_map` each layer's state stays on its GPU: gather them on the head's, with the drafter.
        dev = self.lm_head.weight.device
        features = torch.cat([out.hidden_states[i + 1][0].to(dev) for i in capture], dim=-1) if capture else None
        return ForwardOut(out.logits[0], features)


    def forward_many(self, segments: list[Segment], capture: tuple[int, ...] = ()) -> list[ForwardOut]:
        """`Target.forward_many`'s interface; this backend runs one sequence at a time (its scheduler admits
        one), so the segments run in turn, every row's features returned."""
        return [self.forward(s.tokens, s.positions, s.cache, s.mask, capture, last_only=s.logits != "all")
                for s in segments]


# What the engine and training accept as a target, and the cache each one makes.
TargetLike = Target | HFTarget
CacheLike = KVCache | HFCache


def load_target(directory: Path, device: torch.device, dtype: torch.dtype, backend: str = "auto",
                device_map: str | None = None) -> TargetLike:
    """The native model where it covers the architecture (auto), else transformers."""
    if backend not in BACKENDS:
        raise ValueError(f"target backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    archs = read_json(directory / "config.json").get("architectures") or []
    native = any(a in SUPPORTED_TARGETS for a in archs)
    if device.type == "cuda":  # cuDNN's attention plans each new shape on the host: a step's shapes are all new
        torch.backends.cuda.enable_cudnn_sdp(False)  # (docs/limit.md, "On an H200")
    if backend == "native" or (backend == "auto" and native and device_map is None):
        return Target.load(directory, device, dtype)
    return HFTarget.load(directory, device, dtype, device_map)
