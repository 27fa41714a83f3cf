"""Does a long-running server's paged pool slow a long generation down? A trace on a freshly started `ddscope serve`,
then the same trace after hundreds of requests of mixed lengths have churned its pool (block tables scattered
over the free list), then a fresh trace again, all on one server process and the same prompt (T=0: the same tokens
in the same steps, so the step times compare position for position).

    python benchmarks/serving/trace_churn.py [--churn 300] [--max-tokens 2048] [--out docs/results]

Writes OUT/trace-churn.md and .json: per phase, the median gap per step, the generation's fit, the step boundaries
checked against the server's rounds, and the engine's own step time.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

import httpx

from ddscope.bench.limit.hardware import cpu_model
from ddscope.bench.running.server import serve_process


def trace(url: str, out: Path, max_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "ddscope.cli", "bench", "trace", "--url", url, "--max-tokens", str(max_tokens),
           "--repeats", "2", "--prompt-tokens", "64", "--json", "--out", str(out)]
    summary = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    doc = json.loads((out / "results.json").read_text())
    steps = [s for r in doc["requests"] for s in r["steps"][2:]]
    return {"summary": summary["workloads"]["padding"], "median_gap_ms": median(s["gap_ms"] for s in steps),
            "median_engine_ms": median(s["engine_step_ms"] for s in steps),
            "rounds_equal": all(r["checks"].get("rounds_equal") for r in doc["requests"]),
            "by_quarter": [median(s["gap_ms"] for s in steps if q * max_tokens // 4 <= s["position"] <
                                  (q + 1) * max_tokens // 4) for q in range(4)]}


def churn(url: str, n: int, seed: int = 0) -> float:
    """`n` requests, 8 at a time, of 10-1500 prompt tokens and 8-128 out, each prompt its own (no prefix hits):
    blocks are taken and freed in an interleaved order."""
    rng = random.Random(seed)
    bodies = [{"prompt": [5 + (i * 131 + k * 7) % 7000 for k in range(rng.randint(10, 1500))],
               "max_tokens": rng.randint(8, 128), "temperature": 0.7, "seed": i, "ignore_eos": True}
              for i in range(n)]
    t0 = time.time()
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda b: client.post(f"{url}/v1/completions", json=b).status_code, bodies))
    assert all(c == 200 for c in codes), codes
    return time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--churn", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    phases = {}
    with tempfile.TemporaryDirectory() as tmp, serve_process(["--kv-cache-mb", "256"], Path(tmp) / "serve.log") as url:
        phases["fresh"] = trace(url, Path(tmp) / "fresh", args.max_tokens)
        churn_s = churn(url, args.churn)
        phases["churned"] = trace(url, Path(tmp) / "churned", args.max_tokens)
        phases["again"] = trace(url, Path(tmp) / "again", args.max_tokens)
    rows = ["| phase | median gap ms | engine step ms | gap by quarter of the generation | generation fit | "
            "steps = rounds |", "|---|---|---|---|---|---|"]
    for name, p in phases.items():
        fit = p["summary"]["fit"]
        rows.append(f"| {name} | {p['median_gap_ms']:.2f} | {p['median_engine_ms']:.2f} | "
                    f"{', '.join(f'{q:.2f}' for q in p['by_quarter'])} | {fit['a_ms']:.2f} + "
                    f"{1e3 * fit['b_ms_per_token']:.3f}/1k | {p['rounds_equal']} |")
    text = (f"# A long generation on a fresh and a churned pool ({cpu_model()})\n\n`python benchmarks/serving/trace_churn.py "
            f"--churn {args.churn} --max-tokens {args.max_tokens}`: demo pair, `ddscope serve --kv-cache-mb 256`, "
            f"padding prompt of 64 tokens, 2 traces a phase; {args.churn} churn requests took {churn_s:.0f} s.\n\n"
            + "\n".join(rows) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trace-churn.md").write_text(text)
    (args.out / "trace-churn.json").write_text(json.dumps({"cpu": cpu_model(), "churn_s": churn_s, **phases}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
