"""The main job's embedded server against a standalone `ddscope serve`, timed by the same bench.

`ddscope bench sweep` without --url starts its own server; it must measure the engine, not itself.
This runs the main job (embedded) and the same sweep against a standalone `ddscope serve` in turns
(A B A B ...), each sweep a separate `ddscope` process, and prints the median tok/s per context and
the per-round ratio embedded / standalone; docs/results/embedded-vs-standalone.md keeps the output.

    python benchmarks/embedded_vs_standalone.py [--rounds 2] [--out docs/results/embedded-vs-standalone.md]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

from ddscope.bench.cli import EMBEDDED_MAX_TOKENS
from ddscope.bench.embedded import serve_process
from ddscope.bench.sweep import cpu_model


def sweep(out: Path, url: str | None, flags: list[str]) -> dict[int, float]:
    cmd = [sys.executable, "-m", "ddscope.cli", "bench", "sweep", "--out", str(out), *flags]
    if url:
        cmd += ["--url", url]
    subprocess.run(cmd, check=True, capture_output=True)
    records = json.loads((out / "results.json").read_text())["records"]
    by_ctx: dict[int, list[float]] = {}
    for r in records:
        by_ctx.setdefault(r["prompt_tokens"], []).append(r["tok_per_s"])
    return {ctx: median(v) for ctx, v in sorted(by_ctx.items())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds (default: %(default)s)")
    p.add_argument("--sweep-flags", default="", help="extra flags for both sweeps, e.g. '--max-tokens 256'")
    p.add_argument("--out", type=Path, help="also write the table as markdown here")
    args = p.parse_args()
    flags = args.sweep_flags.split()
    if "--max-tokens" not in flags:  # with --url the default is longer: both get the main job's length
        flags += ["--max-tokens", str(EMBEDDED_MAX_TOKENS)]
    rows: dict[int, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for arm in ("embedded", "standalone"):
                if arm == "embedded":
                    got = sweep(Path(tmp) / f"{arm}{i}", None, flags)
                else:  # fresh each round, as the embedded one is
                    with serve_process([], Path(tmp) / f"serve{i}.log") as url:
                        got = sweep(Path(tmp) / f"{arm}{i}", url, flags)
                for ctx, tps in got.items():
                    rows.setdefault(ctx, {"embedded": [], "standalone": []})[arm].append(tps)
                print(f"round {i + 1} {arm}: " + ", ".join(f"{c}: {t:.1f}" for c, t in got.items()), file=sys.stderr)
    lines = [f"CPU: {cpu_model()}; `ddscope bench sweep {' '.join(flags)}` (the main job), embedded vs "
             f"`--url` a standalone `ddscope serve` (started fresh each round) with the same defaults, {args.rounds} interleaved rounds; "
             "tok/s is the median of each sweep's repeats, the ratio the median of per-round ratios.", "",
             "| prompt_tok | embedded tok/s | standalone tok/s | embedded / standalone |", "|---|---|---|---|"]
    for ctx, arms in rows.items():
        ratio = median(e / s for e, s in zip(arms["embedded"], arms["standalone"]))
        lines.append(f"| {ctx} | {median(arms['embedded']):.1f} | {median(arms['standalone']):.1f} | {ratio:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"# Embedded main job vs standalone server\n\n"
                            f"`python benchmarks/embedded_vs_standalone.py --rounds {args.rounds}`\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
