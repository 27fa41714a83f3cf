"""The floor checked on a real GPU: a Qwen3 of Llama-3-8B's shape (random bf16 weights, which cost what
trained ones do) served by ddscope's engine on CUDA, each step's time beside its `ddscope bench limit` floor.

    python benchmarks/floor/floor_gpu.py [--hardware h200] [--out results.json]

It measures the card first (a device-to-device copy and a bf16 matmul, against the table's datasheet
numbers), then times `ar` decode and oracle-drafted `ddtree` verify steps at 8, 32 and 64 nodes, at short
and long context, with torch's default attention backends and again without cuDNN's (whose host-side cost
per call a profile of the step shows). Every step must take at least its floor; the ratio is printed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ddscope.bench.limit import CARDS, step_floor
from ddscope.bench.limit.shape import load_shape

GEOMETRY = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=8192)


def measure_card() -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and dense bf16 matmul rate, best of 10 after warm-up."""
    def best_ms(fn, n: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return min(times)

    src = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = best_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm = best_ms(lambda: a @ a)
    return {"copy_gbps": 2 * 2 * 1024 ** 3 / copy / 1e6, "bf16_tflops": 2 * 8192 ** 3 / mm / 1e9}


def build(root: Path, device: str, geometry: dict) -> tuple[Path, Path]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddscope.bench.synthetic_models import make_drafter, save_tiny_tokenizer

    target = root / "target"
    save_tiny_tokenizer(target)
    cfg = Qwen3Config(**geometry, dtype="bfloat16", tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(target))
    del model
    torch.cuda.empty_cache()
    return target, make_drafter(root / "drafter", target, block_size=16)


def time_steps(engine, method: str, budget: int, context: int, tokens: int) -> list:
    prompt = [5 + i % 300 for i in range(context)]
    out = engine.generate(prompt, max_new_tokens=tokens, method=method, budget=budget, ignore_eos=True)
    return out.stats.rounds[2:]  # past the first steps' warm-up


def profile(engine) -> None:
    """Where an `ar` step's time goes: the ops that take the most time on the host, over 8 steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    time_steps(engine, "ar", 1, 128, 4)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        time_steps(engine, "ar", 1, 128, 10)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=50), flush=True)


def measure(eng, shape, hw, method: str, budget: int, context: int, sdp: str) -> dict:
    rounds = time_steps(eng, method, budget, context, 24 if method == "ar" else 48)
    verify = statistics.median(r.verify_ms for r in rounds)
    nodes = statistics.median(r.nodes + 1 for r in rounds)
    floor = step_floor(shape, hw, context=context, nodes=nodes)
    return {"sdp": sdp, "method": method, "budget": budget, "context": context, "nodes": nodes, "verify_ms": verify,
            "step_ms_without_draft": statistics.median(r.step_ms - r.draft_ms for r in rounds),  # oracle drafts
            "floor_ms": floor.floor_ms, "bound": floor.bound, "verify_over_floor": verify / floor.floor_ms,
            "steps": len(rounds), "min_verify_ms": min(r.verify_ms for r in rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--contexts", default="128,4096")
    ap.add_argument("--out", type=Path, default=Path("floor-gpu.json"))
    ap.add_argument("--dry-run", action="store_true", help="a small model on the CPU: checks the script, times nothing")
    args = ap.parse_args()
    from ddscope.bench.synthetic_models import oracle_engine
    from ddscope.engine import Engine

    hw = CARDS[args.hardware]
    device, geometry = ("cpu", {**GEOMETRY, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}) \
        if args.dry_run else ("cuda", GEOMETRY)
    card = {"name": "dry run", "torch": torch.__version__} if args.dry_run else \
        {"name": torch.cuda.get_device_name(), "torch": torch.__version__, **measure_card()}
    print(f"card: {card}; table: {hw.bandwidth_gbps} GB/s, bf16 {hw.tflops['bf16']} TFLOPS", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        target, drafter = build(Path(tmp), device, geometry)
        engine = Engine.load(target, drafter, device=device, dtype="bfloat16", max_model_len=8192,
                             kv_cache_mb=256 if args.dry_run else 8192)
        shape = load_shape(target, "bfloat16")
        print(f"built and loaded {shape.params / 1e9:.2f}B params in {time.time() - t0:.0f} s", flush=True)
        oracle = oracle_engine(engine, kv_cache_mb=256 if args.dry_run else 8192)
        arms = (("ar", 1, engine), ("ddtree", 8, oracle), ("ddtree", 32, oracle), ("ddtree", 64, oracle))
        for cudnn in (True, False):  # torch's default SDPA backend on Hopper, then the others alone
            if not args.dry_run:
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
            profile(engine)
            for context in (int(c) for c in args.contexts.split(",")):
                for method, budget, eng in arms if not cudnn else arms[:1] + arms[2:3]:
                    rows.append(measure(eng, shape, hw, method, budget, context, "cudnn" if cudnn else "no cudnn"))
                    print(json.dumps(rows[-1]), flush=True)
    below = [r for r in rows if r["min_verify_ms"] < r["floor_ms"]]
    args.out.write_text(json.dumps({"card": card, "hardware": hw.to_dict(), "rows": rows}, indent=1))
    print(f"{len(rows)} rows; {len(below)} with a step below its floor", flush=True)


if __name__ == "__main__":
    main()
