"""The least time one verify step can take: bytes over bandwidth, FLOPs over peak, collectives over the link.

A step of `batch` sequences, each verifying `nodes` tokens (a tree's nodes, root included; 1 for plain
decoding) after `context` tokens of cache, on `gpus` cards in tensor parallel. Per card it reads:
- the weights: every dense weight once, and of each MoE layer's routed experts those the step's tokens touch,
  E(1 - (1 - k/E)^T) for T tokens routed uniformly (`routing="lower"`: k, the strict bound);
- the KV cache: each sequence's context, per layer up to its sliding window; an MLA latent whole on every
  rank (it is shared by all heads), grouped-query heads split over ranks (replicated below one a rank).
It computes 2 FLOPs per weight a token uses, and attention over the context: for MLA in its absorbed form by
default (queries projected into the latent, as engines decode), or naive (the latent expanded to K and V).
Memory and compute overlap on a card, so the card's time is the larger; the all-reduces after attention and
after the MLP cannot overlap the layer that waits for them, so their time is added. Per-op latencies
(kernel launch, a collective's start-up) are not in the floor.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ddscope.bench.limit.hardware import Hardware
from ddscope.bench.limit.shape import DTYPE_BYTES, ModelShape

ROUTINGS = ("uniform", "lower")
MLA_FORMS = ("absorbed", "naive")


class FloorError(ValueError):
    """A parallel layout or input the floor cannot be computed for."""


@dataclass(frozen=True)
class Floor:
    prompt_tokens: float
    nodes: float
    batch: int
    floor_ms: float
    bound: str               # memory | compute (the card's binding bound; collectives are added to it)
    parts: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def experts_touched(experts: int, top_k: int, tokens: float, routing: str = "uniform") -> float:
    """Distinct routed experts that `tokens` tokens reach in one layer."""
    if not experts:
        return 0.0
    if routing == "lower":
        return float(min(experts, top_k))
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def check_layout(shape: ModelShape, gpus: int) -> None:
    """Tensor parallelism over `gpus` splits the query heads, the KV heads (or replicates them) and the experts."""
    att = shape.attention
    if gpus < 1:
        raise FloorError("--gpus must be at least 1")
    if att.heads % gpus:
        raise FloorError(f"--gpus {gpus} does not divide the {att.heads} attention heads")
    if att.kind == "gqa" and att.kv_heads % gpus and gpus % att.kv_heads:
        raise FloorError(f"--gpus {gpus} neither divides nor is a multiple of the {att.kv_heads} KV heads")
    if shape.experts and shape.experts % gpus:
        raise FloorError(f"--gpus {gpus} does not divide the {shape.experts} routed experts")


def _kv_width(shape: ModelShape, gpus: int) -> float:
    """KV elements a token holds per layer on one card: an MLA latent whole, grouped-query heads split (or one
    replicated head where the ranks outnumber them)."""
    att = shape.attention
    return att.kv_width if att.kind == "mla" else att.kv_width * max(att.kv_heads / gpus, 1) / att.kv_heads


def _kv_elems(shape: ModelShape, context: float, gpus: int) -> float:
    """KV elements one sequence's step reads on one card."""
    return sum(min(context, w) if w else context for w in shape.attention.windows) * _kv_width(shape, gpus)


def _attention_flops(shape: ModelShape, context: float, tokens: float, batch: int, form: str) -> float:
    """Attention FLOPs of the step over all ranks (scores and values over the context, per layer)."""
    att = shape.attention
    seen = sum(min(context, w) if w else context for w in att.windows)  # context over all layers
    if att.kind == "gqa":
        return tokens * 4 * att.heads * att.head_dim * seen
    if form == "absorbed":  # scores over the latent and its rope part, values over the latent
        return tokens * 2 * att.heads * (2 * att.kv_lora_rank + att.rope_dim) * seen
    expand = batch * 2 * seen * att.kv_lora_rank * att.heads * (att.nope_dim + att.v_head_dim)
    return expand + tokens * 2 * att.heads * (att.head_dim + att.v_head_dim) * seen


def step_floor(shape: ModelShape, hw: Hardware, *, context: float, nodes: float = 1, batch: int = 1,
               gpus: int = 1, kv_dtype: str | None = None, routing: str = "uniform",
               mla: str = "absorbed", causal: bool = False) -> Floor:
    """The floor of one step, in parts (bytes, FLOPs, ms per card) and the bound that binds. `causal`: the
    step's tokens are one causal chain (a prefill), each attending to those before it as well as to the
    context; else only the context is counted (a tree's node sees a few of its own, the least bound)."""
    check_layout(shape, gpus)
    if gpus > 1 and not hw.link_gbps:
        raise FloorError(f"{hw.name} has no interconnect rate: --gpus {gpus} needs one (custom:...,link=GBps)")
    tokens = nodes * batch
    share = experts_touched(shape.experts, shape.top_k, tokens, routing) / shape.experts if shape.experts else 0
    weight_bytes = linear = 0.0
    by_dtype: dict[str, float] = {}
    for w in shape.weights:
        ranks = gpus if w.sharded else 1
        if w.per_token:  # an embedding lookup reads the tokens' rows
            weight_bytes += min(tokens, shape.vocab) * shape.hidden * w.bytes_per_param / ranks
            continue
        used = share if w.part == "experts" else 1.0
        weight_bytes += w.bytes * used / ranks
        flops_per_token = 2 * w.params * (shape.top_k / shape.experts if w.part == "experts" else 1.0)
        by_dtype[w.flops_dtype] = by_dtype.get(w.flops_dtype, 0.0) + flops_per_token * tokens / ranks
        linear += flops_per_token * tokens / ranks
    kv_size = DTYPE_BYTES[kv_dtype or shape.dtype]
    kv_bytes = batch * _kv_elems(shape, context, gpus) * kv_size
    kv_write = tokens * shape.layers * _kv_width(shape, gpus) * kv_size
    seen = context + ((nodes + 1) / 2 if causal else 0)  # on average, token i of a chain sees i + 1 of it
    attention = _attention_flops(shape, seen, tokens, batch, mla) / gpus
    act = DTYPE_BYTES[shape.dtype]  # activations, and the matmul rate attention runs at
    # a ring all-reduce moves 2(G-1)/G of the tensor through each card; two per layer, and the logits gathered
    comm_bytes = (2 * shape.layers * 2 * tokens * shape.hidden * act + tokens * shape.vocab * act) * (gpus - 1) / gpus
    weights_ms = 1e3 * weight_bytes / (hw.bandwidth_gbps * 1e9)
    kv_ms = 1e3 * (kv_bytes + kv_write) / (hw.bandwidth_gbps * 1e9)
    linear_ms = 1e3 * sum(f / hw.rate(dt) for dt, f in by_dtype.items())
    attention_ms = 1e3 * attention / hw.rate("fp32" if act >= 4 else "bf16")
    comm_ms = 1e3 * comm_bytes / (hw.link_gbps * 1e9) if gpus > 1 else 0.0
    memory_ms, compute_ms = weights_ms + kv_ms, linear_ms + attention_ms
    parts = {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes + kv_write, "linear_flops": linear,
             "attention_flops": attention, "allreduce_bytes": comm_bytes,
             "experts_touched": share * shape.experts, "weights_ms": weights_ms, "kv_ms": kv_ms,
             "memory_ms": memory_ms, "linear_ms": linear_ms, "attention_ms": attention_ms, "compute_ms": compute_ms,
             "allreduce_ms": comm_ms}
    bound = "memory" if memory_ms >= compute_ms else "compute"
    return Floor(context, nodes, batch, max(memory_ms, compute_ms) + comm_ms, bound, parts)


def break_even(shape: ModelShape, hw: Hardware, **kw: Any) -> float:
    """The avg_commit below which an N-node verify step cannot pay: its floor over a 1-token step's."""
    tree = step_floor(shape, hw, **kw)
    return tree.floor_ms / step_floor(shape, hw, **{**kw, "nodes": 1}).floor_ms


def floor_line(shape: ModelShape, hw: Hardware, contexts: list[float], **kw: Any) -> tuple[float, float]:
    """(a_ms, b_ms_per_token): the floor as a line through its ends over `contexts` (exact where one bound
    binds throughout, as it does where weights dominate)."""
    lo, hi = min(contexts), max(contexts)
    if hi - lo < 1:
        hi = lo + 1024
    f_lo = step_floor(shape, hw, context=lo, **kw).floor_ms
    b = (step_floor(shape, hw, context=hi, **kw).floor_ms - f_lo) / (hi - lo)
    return f_lo - b * lo, b


@dataclass
class FloorSpec:
    """What the floor assumes: model, hardware, layout and tree size (None: each point's own, as measured)."""
    shape: ModelShape
    hw: Hardware
    gpus: int = 1
    nodes: float | None = None
    batch: int = 1
    kv_dtype: str | None = None
    routing: str = "uniform"
    mla: str = "absorbed"

    def kw(self, nodes: float) -> dict[str, Any]:
        return {"nodes": nodes, "batch": self.batch, "gpus": self.gpus, "kv_dtype": self.kv_dtype,
                "routing": self.routing, "mla": self.mla}

    def floor(self, context: float, nodes: float) -> Floor:
        return step_floor(self.shape, self.hw, context=context, **self.kw(nodes))

    def break_even(self, context: float, nodes: float) -> float:
        return break_even(self.shape, self.hw, context=context, **self.kw(nodes))

    def assumed(self) -> dict[str, Any]:
        return {"hardware": {**self.hw.to_dict(), "gpus": self.gpus}, "model": self.shape.summary(),
                "nodes": self.nodes, "batch": self.batch, "kv_dtype": self.kv_dtype or self.shape.dtype,
                "routing": self.routing + (" (an estimate: real routing is skewed and touches fewer experts)"
                                           if self.shape.experts and self.routing == "uniform" else ""),
                "mla": self.mla if self.shape.attention.kind == "mla" else None}
