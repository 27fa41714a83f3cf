"""A/B of one engine change on floor.py's bandwidth-bound random Qwen3: the phases it moves, arms taking turns.

    python benchmarks/floor_ab.py --change packed-bf16 [--repeats 3]

Both arms load in this process (on every CPU's thread) and alternate A, B per repeat on distinct prompts; each
cell is the median over repeats of the median over the second half of a generation's rounds (tree, verify and
commit; the prefill row is the prefill). A is the engine without the change, B with it. Changes:

- `packed-bf16`: bf16 projections on oneDNN's packed weights (ddscope.models.layers.PackedLinear) against
  row-major weights, in bf16.
- `column-fp32`: fp32 projections of 2-64 rows as W @ x^T (ddscope.models.layers.ColumnLinear) against
  x @ W^T, in fp32.
- `bmm-attention-fp32`: a tree's masked grouped attention as two batched products against SDPA, in fp32.
- `panels-fp32`: fp32 projections on kernels.c's panelled weights (ddscope.models.layers.PanelLinear) against
  the `column-fp32` products.
- `panels-bf16`: bf16 projections on kernels.c's AMX panels, a decode row's layers in one C call each, against
  `packed-bf16`'s oneDNN products and the modules.
- `attention-fp32`, `attention-bf16`: a decode step's attention in one C call (ddscope.models.native.attend)
  against SDPA.
- `tree-attention-fp32`: a tree's masked attention as kernels.c's two panel products (`tree_attend`) against
  the grouped bias on batched products.
- `tree-attention-bf16`: a tree's masked attention in kernels.c's `attend` (each row the bits of a decode step
  over its keys) against SDPA.
  In both, arm A's tree rows run the modules (a tree's one C call a layer takes the kernels' boolean mask);
  its decode steps stay on kernels.c's calls.
- `pages-fp32`: panelled weights and the KV pool on 2 MiB pages (ddscope.models.pages) against 4 KiB ones.
- `causal-fp32`: a prefill's causal attention as kernels.c's tree products (ddscope.models.native.causal_attend)
  against SDPA.
- `kv-pages-fp32`, `kv-pages-bf16`: the KV pool on 2 MiB pages (ddscope.models.kv_pool.zeroed) against 4 KiB
  ones.
- `native-fp32`, `native-bf16`: RMSNorm and the heads' norm + RoPE as one C call each (ddscope.models.native)
  against torch's ops.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from floor_common import build, prompt

import ddscope.models.kv_pool as kv_pool
import ddscope.models.layers as layers
import ddscope.models.native as native
import ddscope.models.pages as pages
from ddscope.bench.sweep import cpu_model
from ddscope.engine import Engine


@contextmanager
def patched(name: str, value, module=layers) -> Iterator[None]:
    """`module`'s `name` as `value` inside the block: the engine without the change."""
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def _torch_ops():
    return patched("serves", lambda *tensors: False, native)


def _no_attention():
    return patched("attends", lambda *tensors: False, native)


def _small_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _small_kv_pages():
    return patched("zeroed", lambda shape, device, dtype: torch.zeros(shape, device=device, dtype=dtype), kv_pool)


def _no_causal_rows():
    return patched("causal_rows", lambda *tensors: False, native)


def _no_tree_attention_fp32():
    return patched("tree_rows", lambda *geometry: False, native)


def _no_exact_trees():
    return patched("EXACT_TREES", ())


CHANGES: dict[str, tuple[str, Callable]] = {"packed-bf16": ("bfloat16", lambda: patched("packs", lambda w: False)),
                                            "column-fp32": ("float32", lambda: patched("COLUMN_ROWS", 0)),
                                            "bmm-attention-fp32": ("float32", lambda: patched("BMM_ATTENTION", ())),
                                            "panels-fp32": ("float32", lambda: patched("paneled", lambda w: False, native)),
                                            "panels-bf16": ("bfloat16", lambda: patched("paneled", lambda w: False, native)),
                                            "attention-fp32": ("float32", _no_attention),
                                            "attention-bf16": ("bfloat16", _no_attention),
                                            "tree-attention-fp32": ("float32", _no_tree_attention_fp32),
                                            "tree-attention-bf16": ("bfloat16", _no_exact_trees),
                                            "pages-fp32": ("float32", lambda: patched("huge", _small_pages, pages)),
                                            "causal-fp32": ("float32", _no_causal_rows),
                                            "kv-pages-fp32": ("float32", _small_kv_pages),
                                            "kv-pages-bf16": ("bfloat16", _small_kv_pages),
                                            "native-fp32": ("float32", _torch_ops),
                                            "native-bf16": ("bfloat16", _torch_ops)}
CASES = (("ar decode @16", 16, dict(method="ar")), ("ar decode @4096", 4096, dict(method="ar")),
         ("verify 33 @1024", 1024, dict(method="ddtree", budget=32, lookup=False)),
         ("verify 33 @4096", 4096, dict(method="ddtree", budget=32, lookup=False)))


def load(target: Path, drafter: Path, dtype: str) -> Engine:
    return Engine.load(target, drafter, dtype=dtype, max_model_len=4200, max_prefill_tokens=4096, kv_cache_mb=2048)


def run(engine: Engine, context: int, seed: int, **kw) -> tuple[float, float]:
    out = engine.generate(prompt(context, seed), max_new_tokens=24, temperature=0.0, ignore_eos=True, **kw)
    late = out.stats.rounds[len(out.stats.rounds) // 2:]
    return statistics.median(r.step_ms - r.draft_ms for r in late), out.stats.prefill_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--change", choices=sorted(CHANGES), required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    dtype, without = CHANGES[args.change]
    cells: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = build(Path(tmp))
        with without():
            arms = {"A": load(target, drafter, dtype)}
        arms["B"] = load(target, drafter, dtype)
        for rep in range(args.repeats):
            for arm, engine in arms.items():
                for name, context, kw in CASES:
                    with without() if arm == "A" else nullcontext():
                        step, prefill = run(engine, context, 1000 * rep + ord(arm) * 10 + context % 7, **kw)
                    cells.setdefault((name, arm), []).append(step)
                    cells.setdefault((f"prefill {context}", arm), []).append(prefill)
    print(f"# {args.change} ({dtype}), {cpu_model()}, {torch.get_num_threads()} threads, {args.repeats} repeats\n")
    print("| phase | A ms | B ms | B/A |\n|---|---|---|---|")
    for name in dict.fromkeys(n for n, _ in cells):
        a, b = (statistics.median(cells[name, arm]) for arm in "AB")
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
