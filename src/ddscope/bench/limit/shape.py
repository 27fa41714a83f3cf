"""What one forward of a model reads and computes, from its HF `config.json` alone.

A model is a list of weight groups (how many parameters, at how many bytes each, read by every token or
only by the tokens routed to an expert, split over tensor-parallel ranks or replicated on each) and an
attention shape (grouped-query heads, or DeepSeek's latent MLA). Bytes per parameter come from the
checkpoint's `quantization_config`, module by module. A field the floor needs and the config lacks is
refused by name: a floor built on a guessed width is no floor.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4.0, "fp32": 4.0, "bfloat16": 2.0, "bf16": 2.0, "float16": 2.0, "fp16": 2.0,
               "float8": 1.0, "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0}
# The families whose config fields this module reads; anything else is refused rather than read wrongly.
DENSE_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite", "olmo2",
               "ministral"}
MOE_TYPES = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "kimi_k2"}
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


class ConfigError(ValueError):
    """A config the floor cannot read, naming the field or architecture."""


@dataclass(frozen=True)
class Weights:
    """One kind of weight over all layers, at one width per parameter (e.g. every layer's attention in bf16)."""
    part: str               # attention | mlp | experts | shared_experts | router | embedding | lm_head
    params: int             # over all layers (experts: all of them; a step reads those its tokens touch)
    bytes_per_param: float
    sharded: bool = True    # split over tensor-parallel ranks; else every rank reads it whole
    per_token: bool = False  # read only for the tokens' own rows (an embedding lookup)
    flops_dtype: str = "bf16"  # the rate its matmuls run at

    @property
    def bytes(self) -> float:
        return self.params * self.bytes_per_param


@dataclass(frozen=True)
class Attention:
    kind: str               # gqa | mla
    heads: int
    kv_heads: int           # gqa; mla: 1 shared latent
    head_dim: int           # gqa; mla: qk_nope + qk_rope
    kv_width: int           # elements of K+V cached per token per layer
    windows: tuple[int | None, ...]  # per layer: the sliding window, or None for full attention
    kv_lora_rank: int = 0
    rope_dim: int = 0
    nope_dim: int = 0
    v_head_dim: int = 0


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    vocab: int
    dtype: str              # activations and the KV cache unless told otherwise
    attention: Attention
    weights: tuple[Weights, ...]
    experts: int = 0        # routed experts per MoE layer
    top_k: int = 0
    moe_layers: int = 0
    quantization: str = "none"
    tied: bool = False      # lm_head is the embedding
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def params(self) -> int:
        return sum(w.params for w in self.weights if not (self.tied and w.part == "embedding"))

    def summary(self) -> dict[str, Any]:
        a = self.attention
        return {"name": self.name, "params": self.params, "layers": self.layers, "hidden": self.hidden,
                "attention": a.kind, "heads": a.heads, "kv_heads": a.kv_heads, "kv_width": a.kv_width,
                "experts": self.experts, "top_k": self.top_k, "moe_layers": self.moe_layers, "dtype": self.dtype,
                "quantization": self.quantization,
                "notes": list(self.notes)}


def _need(cfg: dict[str, Any], key: str, *alts: str) -> Any:
    for k in (key, *alts):
        if cfg.get(k) is not None:
            return cfg[k]
    names = " or ".join(f"'{k}'" for k in (key, *alts))
    raise ConfigError(f"config.json lacks {names}, which the floor needs")


def read_config(path: Path) -> tuple[dict[str, Any], str]:
    """A model directory's or a file's config dict, and a name for it."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{file} is not a config object")
    return cfg, (path.name if path.is_dir() else path.stem)


# ---- quantization, module by module -----------------------------------------------------------------

@dataclass(frozen=True)
class Quant:
    """Bytes per parameter by module name, from a checkpoint's `quantization_config`."""
    method: str
    rules: tuple[tuple[tuple[str, ...], float, str], ...] = ()  # (targets, bytes/param, flops dtype), first wins
    ignore: tuple[str, ...] = ()
    dense: float = 2.0       # the unquantized dtype's bytes

    def of(self, module: str) -> tuple[float, str]:
        """(bytes per parameter, the dtype its matmuls run at) for a module's weight."""
        if any(_matches(p, module) for p in self.ignore):
            return self.dense, _dense_flops(self.dense)
        for targets, size, flops in self.rules:
            if any(t == "Linear" or _matches(t, module) for t in targets):
                return size, flops
        return self.dense, _dense_flops(self.dense)


def _dense_flops(size: float) -> str:
    return "fp32" if size >= 4 else "bf16"


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors' convention: `re:REGEX` matched against the module name, else the name or its suffix."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def _group_bytes(bits: int, group: int | None, scale_bytes: float, zero: bool) -> float:
    """Packed weights plus one scale (and zero point) per group; a per-channel scale is negligible."""
    per_group = scale_bytes + (bits / 8 if zero else 0.0)
    return bits / 8 + (per_group / group if group and group > 0 else 0.0)


def read_quant(cfg: dict[str, Any], dense: float) -> Quant:
    q = cfg.get("quantization_config")
    if not q:
        return Quant("none", dense=dense)
    method = str(_need(q, "quant_method")).lower()
    if method == "compressed-tensors":
        rules = []
        for group in _need(q, "config_groups").values():
            w = group.get("weights") or {}
            bits = int(_need(w, "num_bits"))
            kind = str(w.get("type", "int"))
            act = group.get("input_activations")
            flops = "fp8" if (act and int(act.get("num_bits", 16)) == 8 and kind == "float") else _dense_flops(dense)
            size = _group_bytes(bits, w.get("group_size"), 2.0, not w.get("symmetric", True))
            rules.append((tuple(_need(group, "targets")), size, flops))
        return Quant(method, tuple(rules), tuple(q.get("ignore") or ()), dense)
    if method in ("gptq", "awq"):
        bits = int(_need(q, "bits", "w_bit"))
        size = _group_bytes(bits, q.get("group_size", q.get("q_group_size")), 2.0, not q.get("sym", False))
        ignore = tuple(q.get("modules_to_not_convert") or ()) + ("lm_head",)
        return Quant(method, ((("Linear",), size, _dense_flops(dense)),), ignore, dense)
    if method == "fp8":  # activations are quantized too (dynamic or static scales): the matmuls run in fp8
        block = q.get("weight_block_size")
        scale = 4.0 / (block[0] * block[1]) if block else 0.0  # an fp32 scale per block
        ignore = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ()) + ("lm_head",)
        return Quant(method, ((("Linear",), 1.0 + scale, "fp8"),), ignore, dense)
    raise ConfigError(f"quantization_config.quant_method {method!r} is not one the floor reads "
                      f"(compressed-tensors, gptq, awq, fp8)")


# ---- the model ----------------------------------------------------------------------------------------

def _dtype(cfg: dict[str, Any], override: str | None) -> str:
    name = override or cfg.get("torch_dtype") or cfg.get("dtype")
    if name is None:
        raise ConfigError("config.json lacks 'torch_dtype' (or 'dtype'): pass --dtype")
    name = str(name).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(sorted(DTYPE_BYTES))}")
    return name


def _family(cfg: dict[str, Any]) -> str:
    model_type = str(_need(cfg, "model_type"))
    if model_type not in DENSE_TYPES | MOE_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not an architecture the floor reads "
                          f"(dense: {', '.join(sorted(DENSE_TYPES))}; MoE: {', '.join(sorted(MOE_TYPES))})")
    return model_type


SLIDING_EVERYWHERE = {"mistral", "mixtral", "ministral", "phi3"}  # a sliding_window applies to every layer


def _windows(cfg: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, or None: from layer_types; else every layer slides where the family does so
    (Mistral's, Phi-3's); Qwen's use_sliding_window false means none does; anything else is refused."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) is not False else None
    types = cfg.get("layer_types")
    if not types:
        if window and cfg.get("model_type") not in SLIDING_EVERYWHERE:
            raise ConfigError("config.json has a sliding_window but no 'layer_types': which layers slide is not known")
        types = ["sliding_attention" if window else "full_attention"] * layers
    if len(types) != layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {layers} layers")
    odd = sorted(set(types) - ATTENTION_LAYERS)
    if odd:
        raise ConfigError(f"layer_types {odd} is not attention the floor reads ({', '.join(sorted(ATTENTION_LAYERS))})")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and not window:
        raise ConfigError("layer_types has sliding_attention but config.json lacks 'sliding_window'")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _attention(cfg: dict[str, Any], hidden: int, layers: int) -> tuple[Attention, dict[str, int], dict[str, int]]:
    """The attention shape, and its projections' parameters: (split over ranks, replicated on each)."""
    heads = int(_need(cfg, "num_attention_heads"))
    windows = _windows(cfg, layers)
    if cfg.get("kv_lora_rank"):
        rank, rope = int(cfg["kv_lora_rank"]), int(_need(cfg, "qk_rope_head_dim"))
        nope, v = int(_need(cfg, "qk_nope_head_dim")), int(_need(cfg, "v_head_dim"))
        q_rank = cfg.get("q_lora_rank")
        split = {"kv_b_proj": rank * heads * (nope + v), "o_proj": heads * v * hidden}
        replicated = {"kv_a_proj_with_mqa": hidden * (rank + rope)}
        if q_rank:
            replicated["q_a_proj"] = hidden * int(q_rank)
            split["q_b_proj"] = int(q_rank) * heads * (nope + rope)
        else:
            split["q_proj"] = hidden * heads * (nope + rope)
        att = Attention("mla", heads, 1, nope + rope, rank + rope, windows, rank, rope, nope, v)
        return att, split, replicated
    kv_heads = int(cfg.get("num_key_value_heads") or heads)  # HF's documented default: multi-head attention
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    split = {"q_proj": hidden * heads * head_dim, "k_proj": hidden * kv_heads * head_dim,
             "v_proj": hidden * kv_heads * head_dim, "o_proj": heads * head_dim * hidden}
    return Attention("gqa", heads, kv_heads, head_dim, 2 * kv_heads * head_dim, windows), split, {}


def _moe(cfg: dict[str, Any], family: str, layers: int) -> tuple[int, int, int, int, list[bool]]:
    """(routed experts, top-k, expert width, shared width, which layers are MoE)."""
    if family not in MOE_TYPES:
        return 0, 0, 0, 0, [False] * layers
    experts = int(_need(cfg, "n_routed_experts", "num_experts", "num_local_experts"))
    top_k = int(_need(cfg, "num_experts_per_tok"))
    if family == "mixtral":
        return experts, top_k, int(_need(cfg, "intermediate_size")), 0, [True] * layers
    width = int(_need(cfg, "moe_intermediate_size"))
    if family.startswith("qwen"):
        step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
        moe = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    else:  # DeepSeek V2/V3, Kimi K2
        first, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
        moe = [i >= first and i % freq == 0 for i in range(layers)]
        shared = int(cfg.get("n_shared_experts") or 0) * width
    return experts, top_k, width, shared, moe


def model_shape(cfg: dict[str, Any], name: str = "model", dtype: str | None = None) -> ModelShape:
    """The weights and attention of a causal LM's config (a multimodal config's `text_config` is read)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "quantization_config": cfg.get("quantization_config"),
               "torch_dtype": cfg["text_config"].get("torch_dtype") or cfg.get("torch_dtype")}
    family = _family(cfg)
    hidden, layers = int(_need(cfg, "hidden_size")), int(_need(cfg, "num_hidden_layers"))
    vocab = int(_need(cfg, "vocab_size"))
    dt = _dtype(cfg, dtype)
    quant = read_quant(cfg, DTYPE_BYTES[dt])
    att, att_split, att_repl = _attention(cfg, hidden, layers)
    experts, top_k, width, shared, moe = _moe(cfg, family, layers)
    dense_width = int(_need(cfg, "intermediate_size")) if not all(moe) else 0
    groups: dict[tuple[str, float, bool, str], int] = {}

    def add(part: str, module: str, params: int, sharded: bool = True) -> None:
        size, flops = quant.of(module)
        groups[(part, size, sharded, flops)] = groups.get((part, size, sharded, flops), 0) + params

    for i in range(layers):
        pre = f"model.layers.{i}"
        for proj, n in att_split.items():
            add("attention", f"{pre}.self_attn.{proj}", n)
        for proj, n in att_repl.items():
            add("attention", f"{pre}.self_attn.{proj}", n, sharded=False)
        if not moe[i]:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                add("mlp", f"{pre}.mlp.{proj}", hidden * dense_width)
            continue
        moe_block = "block_sparse_moe" if family == "mixtral" else "mlp"
        add("router", f"{pre}.{moe_block}.gate", hidden * experts, sharded=False)
        shared_name = "shared_expert" if family == "qwen2_moe" else "shared_experts"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            add("experts", f"{pre}.{moe_block}.experts.0.{proj}", hidden * width * experts)
            if shared:
                add("shared_experts", f"{pre}.mlp.{shared_name}.{proj}", hidden * shared)
    weights = [Weights(part, n, size, sharded, flops_dtype=flops) for (part, size, sharded, flops), n in groups.items()]
    weights.append(Weights("embedding", vocab * hidden, DTYPE_BYTES[dt], per_token=True))
    head_size, head_flops = quant.of("lm_head")
    weights.append(Weights("lm_head", vocab * hidden, head_size, flops_dtype=head_flops))
    tied = bool(cfg.get("tie_word_embeddings"))
    notes = ("lm_head is the embedding (tied): its parameters are counted once",) if tied else ()
    return ModelShape(name, hidden, layers, vocab, dt, att, tuple(weights), experts, top_k, sum(moe), quant.method,
                      tied, notes)


def load_shape(path: Path, dtype: str | None = None) -> ModelShape:
    cfg, name = read_config(path)
    return model_shape(cfg, name, dtype)
