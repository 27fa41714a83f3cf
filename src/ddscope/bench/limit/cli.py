"""`ddscope bench limit`, and the floor options that `analyze`, `sweep` and `diagnose` share."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddscope.bench.limit.floor import MLA_FORMS, ROUTINGS
from ddscope.bench.limit.shape import DTYPE_BYTES
from ddscope.util.options import at_least, int_list, number_in

KV_DTYPES = ("bfloat16", "float16", "fp8", "float32")


def add_floor_args(p: argparse.ArgumentParser, model_flags: tuple[str, ...], dtype: bool = True) -> None:
    """The physical floor's options. `model_flags`: --model where the command has no --model of its own."""
    g = p.add_argument_group("physical floor (docs/limit.md)")
    g.add_argument(*model_flags, dest="floor_model", type=Path, metavar="DIR_OR_CONFIG",
                   help="the served model's config.json or checkpoint directory (default: the directory the server's "
                        "/v1/models names as root, where it is local)")
    g.add_argument("--hardware", metavar="NAME",
                   help="a card (h100, h100-pcie, h200, b200, b300, rtx-pro-6000, l40s, a100, mi300x, mi325x, "
                        "rtx-5090), host (this machine, measured on every CPU; host:N on N threads), or "
                        "custom:bw=GBps,flops=TFLOPS[,fp8=TFLOPS][,link=GBps]")
    g.add_argument("--gpus", type=at_least(1), default=1, help="cards in tensor parallel (default: %(default)s)")
    g.add_argument("--nodes", type=number_in(1.0, 1e6),
                   help="tokens verified per sequence per step, tree root included (ddscope --budget 32 verifies 33; "
                        "plain decoding 1); default: what the server reports per request")
    g.add_argument("--batch", type=at_least(1), default=1, help="sequences per step (default: %(default)s)")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, help="KV cache dtype (default: the model's)")
    if dtype:
        g.add_argument("--dtype", dest="floor_dtype", choices=sorted(DTYPE_BYTES),
                       help="activation and unquantized weight dtype (default: the server's, else the config's)")
    g.add_argument("--routing", choices=ROUTINGS, default="uniform",
                   help="experts a step's tokens touch: uniform routing (an estimate) or top-k only (a strict "
                        "lower bound) (default: %(default)s)")
    g.add_argument("--mla", choices=MLA_FORMS, default="absorbed",
                   help="MLA attention as engines decode it (absorbed) or with the latent expanded (default: "
                        "%(default)s)")


@dataclass
class FloorRequest:
    """The floor options as given: kept in a sweep's results.json, so analyze recomputes the same floor."""
    hardware: str
    model: str | None = None
    gpus: int = 1
    nodes: float | None = None
    batch: int = 1
    kv_dtype: str | None = None
    dtype: str | None = None
    routing: str = "uniform"
    mla: str = "absorbed"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FloorRequest | None":
        if not getattr(args, "hardware", None):
            if getattr(args, "floor_model", None) or getattr(args, "gpus", 1) != 1:
                raise FloorArgsError("--model/--gpus set the physical floor: give --hardware too")
            return None
        model = args.floor_model
        dtype = getattr(args, "floor_dtype", None)
        embedded = "url" in args and not args.url  # a sweep that starts its own server knows what it serves
        if model is None and embedded:
            from ddscope.engine.limits import DEMO_DIR

            model, dtype = args.target or DEMO_DIR / "target", dtype or args.dtype
        return cls(args.hardware, str(model) if model else None, args.gpus, args.nodes, args.batch, args.kv_dtype,
                   dtype, args.routing, args.mla)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FloorArgsError(ValueError):
    """Floor options that cannot be used: printed as one line, exit 2."""


def floor_spec(req: FloorRequest, backend: dict[str, Any] | None = None) -> Any:
    """The FloorSpec for these options; the model and dtype default to what the run's server said."""
    from ddscope.bench.limit.floor import FloorSpec
    from ddscope.bench.limit.hardware import hardware_named
    from ddscope.bench.limit.shape import load_shape

    backend = backend or {}
    model = req.model or backend.get("model_root")
    if not model or not Path(model).exists():
        where = f" (the server names {model}, not a local path)" if model else ""
        raise FloorArgsError(f"the floor needs the model's config: pass --model DIR_OR_CONFIG{where}")
    shape = load_shape(Path(model), req.dtype or _known(backend.get("dtype")))
    return FloorSpec(shape, hardware_named(req.hardware), req.gpus, req.nodes, req.batch, req.kv_dtype, req.routing, req.mla)


def kept_floor(meta: dict[str, Any]) -> FloorRequest | None:
    """The floor options a run kept in its results (None where it kept none, or a shape this version cannot read)."""
    kept = (meta.get("config") or {}).get("floor")
    try:
        return FloorRequest(**kept) if isinstance(kept, dict) else None
    except TypeError:
        return None


def check_floor(req: FloorRequest) -> None:
    """The floor options' errors now: the hardware (host measured here, before a server competes for the CPUs),
    and the model and layout where the model is known before the run (--model-config, or the embedded server's)."""
    from ddscope.bench.limit.hardware import hardware_named

    if req.model is None:
        hardware_named(req.hardware)
    else:
        spec = floor_spec(req)
        spec.floor(1, req.nodes or 1)  # the layout: --gpus against the heads and experts


def _known(dtype: str | None) -> str | None:
    return dtype if dtype in DTYPE_BYTES else None


# ---- `ddscope bench limit` ----------------------------------------------------------------------------

def register(sub: Any) -> None:
    p = sub.add_parser("limit", help="the physical floor of a verify step, per context",
                       description="The least time one verify step of a model can take on a card: weights and KV "
                                   "read over memory bandwidth, FLOPs over peak, all-reduces over the link. Prints "
                                   "the floor per context with its parts, its line a + b*ctx, and the break-even "
                                   "avg_commit below which speculation cannot pay. --nodes defaults to 32 here (no "
                                   "server to ask). See docs/limit.md.")
    add_floor_args(p, ("--model", "--model-config"))
    p.add_argument("--contexts", type=int_list, default=[13, 1663, 3333, 5553],
                   help="context lengths in tokens (default: 13,1663,3333,5553)")
    p.add_argument("--json", action="store_true", help="print JSON: points, line, hardware, model")
    p.add_argument("--remeasure", action="store_true",
                   help="with --hardware host: measure this machine again first (its best rates are kept)")
    p.set_defaults(func=cmd_limit)


def limit_report(req: FloorRequest, contexts: list[int]) -> dict[str, Any]:
    from ddscope.bench.limit.floor import floor_line

    spec = floor_spec(req)
    nodes = req.nodes or 32.0
    points = [{**spec.floor(c, nodes).to_dict(), "break_even_commit": spec.break_even(c, nodes)} for c in contexts]
    a, b = floor_line(spec.shape, spec.hw, contexts, **spec.kw(nodes))
    assumed = spec.assumed()
    return {"points": points, "line": {"a_ms": a, "b_ms_per_token": b}, "hardware": assumed.pop("hardware"),
            "model": assumed.pop("model"), "assumed": {**assumed, "nodes": nodes}}


def cmd_limit(args: argparse.Namespace) -> int:
    from ddscope.bench.limit import ConfigError, FloorError, HardwareError

    try:
        if not args.hardware:
            raise FloorArgsError("give --hardware (a card name, host, or custom:...)")
        if args.floor_model is None:
            raise FloorArgsError("give --model DIR_OR_CONFIG")
        if args.remeasure:
            if not args.hardware.startswith("host"):
                raise FloorArgsError("--remeasure measures this machine: it goes with --hardware host[:THREADS]")
            from ddscope.bench.limit.hardware import hardware_named, host

            host(hardware_named(args.hardware).measured.get("threads"), remeasure=True)
        report = limit_report(FloorRequest.from_args(args), args.contexts)
    except (FloorArgsError, ConfigError, FloorError, HardwareError) as e:
        print(f"ddscope bench limit: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(limit_lines(report)))
    return 0


def limit_lines(r: dict[str, Any]) -> list[str]:
    m, hw, assumed = r["model"], r["hardware"], r["assumed"]
    gpus = hw.get("gpus", 1)
    lines = [f"floor of one verify step: {m['name']} ({m['params'] / 1e9:.2f}B params, {m['attention']}, "
             f"{m['quantization']}, {m['dtype']}) on {gpus} x {hw['name']} ({hw['bandwidth_gbps']:g} GB/s, "
             f"bf16 {hw['tflops']['bf16']:g} TFLOPS), {assumed['nodes']:g} nodes x batch {assumed['batch']}",
             "", f"{'context':>8} {'floor ms':>9} {'bound':>8} {'weights':>8} {'kv':>7} {'compute':>8} "
                 f"{'allreduce':>9} {'break-even':>10}"]
    for p in r["points"]:
        q = p["parts"]
        lines.append(f"{p['prompt_tokens']:>8.0f} {p['floor_ms']:>9.3f} {p['bound']:>8} {q['weights_ms']:>8.3f} "
                     f"{q['kv_ms']:>7.3f} {q['compute_ms']:>8.3f} {q['allreduce_ms']:>9.3f} "
                     f"{p['break_even_commit']:>10.2f}")
    line = r["line"]
    lines += ["", f"floor line: {line['a_ms']:.3f} ms + {1e3 * line['b_ms_per_token']:.4f} ms per 1k tokens",
              "break-even: the avg_commit below which this tree cannot pay, even at the floor (its floor over a "
              "1-token step's)"]
    if m["experts"]:
        lines.append(f"experts: {assumed['routing']}")
    lines += [f"note: {n}" for n in m["notes"]]
    lines.append("ms per part per card; the floor is max(weights + kv, compute) + allreduce (docs/limit.md)")
    return lines
