"""Two `ddscope serve` arms side by side, request by request: `auto` against `ar` (by default) on sampled code.

peer_vllm.py runs each arm's requests of a cell back to back, so a cell's ratio carries the VM's minute with it.
Here the servers are up at once, each in its own process, and the arms take turns on each prompt (ABBA order,
the same seed for both). Each arm runs on two processes, started first and last (A B B A), its prompts alternating
between them: two identical `ar` servers on this machine ran 4-10 % apart, the first started the slower. Each
server's own telemetry (the response's `ddscope` extension) gives its mean step
and its phases a step. The statistic is the median of the per-prompt ratios of mean step; end-to-end latency is
reported beside it.

    python benchmarks/serving/serve_arms_ab.py [--contexts 13,5553] [--prompts 16] [--temperature 0.7]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import median

import httpx
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from ab_harness import abba, model_of

from ddscope.bench.limit.hardware import cpu_model
from ddscope.bench.running.workloads import fit_ids, load_workload
from ddscope.engine import Engine
from ddscope.util.process import free_port, server_process

ARMS = {"ar": ["--method", "ar"], "auto": ["--budget", "auto"]}


def start(stack: ExitStack, arm: str, log: Path) -> str:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ddscope.cli", "serve", "--port", str(port), *ARMS[arm]]
    stack.enter_context(server_process(cmd, url, log))
    return url


def ask(client: httpx.Client, url: str, prompt: str, args: argparse.Namespace, seed: int) -> dict:
    t0 = time.perf_counter()
    body = {"model": model_of(url), "prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "ignore_eos": True, "seed": seed}
    r = client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    ext = r.json()["ddscope"]
    steps = ext["verify_steps"]
    return {"latency_s": time.perf_counter() - t0, "step_ms": ext["mean_step_ms"], "drafted": ext["drafted_steps"],
            **{f"{p}_ms": ms / steps for p, ms in ext["phase_ms"].items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="13,5553", help="prompt tokens (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=16, help="timed prompts a context, after 2 warm-ups (default: 16)")
    p.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
    args = p.parse_args(argv)
    tokenizer = Engine.load().tokenizer
    code = load_workload("code")
    print(f"# `auto` against `ar`, request by request ({cpu_model()}, 2 cores)\n\n`python benchmarks/serving/serve_arms_ab.py "
          f"{' '.join(sys.argv[1:])}`: code at T={args.temperature:g}, {args.max_tokens} tokens out, "
          f"{args.prompts} prompts a context, each server at its default threads.\n")
    print("| context | `auto` / `ar` mean step (median of pairs) | `auto` / `ar` latency | step ms, ar | step ms, auto "
          "| drafted steps, auto |\n|---|---|---|---|---|---|")
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp, httpx.Client(timeout=600) as client:
        urls: dict[str, list[str]] = {arm: [] for arm in ARMS}
        for arm in (*ARMS, *reversed(ARMS)):  # A B B A: each arm started once early and once late
            urls[arm].append(start(stack, arm, Path(tmp) / f"{arm}-{len(urls[arm])}.log"))
        for context in (int(c) for c in args.contexts.split(",")):
            got: dict[str, list[dict]] = {arm: [] for arm in ARMS}
            for i in range(args.prompts + 2):
                prompt = tokenizer.decode(fit_ids(code, 300 + i, context, tokenizer))
                for arm in abba(i, ("ar", "auto")):
                    out = ask(client, urls[arm][i % 2], prompt, args, seed=i)
                    if i >= 2:
                        got[arm].append(out)
            pairs = list(zip(got["auto"], got["ar"]))
            step = median(a["step_ms"] / b["step_ms"] for a, b in pairs)
            latency = median(a["latency_s"] / b["latency_s"] for a, b in pairs)
            print(f"| {context} | {step:.3f} | {latency:.3f} | {median(r['step_ms'] for r in got['ar']):.3f} | "
                  f"{median(r['step_ms'] for r in got['auto']):.3f} | {sum(r['drafted'] for r in got['auto'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
