"""Helper module shared by serving/concurrency.py, serve_ab.py and serve_arms_ab.py, engine/engine_ab.py,
peers/peer_vllm.py and floor/kernels_ab.py (not a benchmark itself): A/B plumbing."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from statistics import median

import httpx
import torch

from ddscope.bench.running.workloads import load_workload
from ddscope.engine import Engine
from ddscope.util.process import free_port, server_process

Server = Callable[[Path], AbstractContextManager[str]]
WORK = Path("/tmp") / "ddscope-concurrency"  # the baseline's worktree


def baseline_tree(commit: str, work: Path) -> Path:
    """The source folder of an earlier commit, checked out as a git worktree under `work` (once)."""
    tree = work / f"ddscope-{commit}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], check=True, capture_output=True)
    return tree / "src"


def baseline_server(commit: str, work: Path) -> Server:
    """`ddscope serve` of an earlier commit (a git worktree), with its default settings and `--budget auto`."""
    src = baseline_tree(commit, work)

    def start(log: Path) -> AbstractContextManager[str]:
        port = free_port()
        cmd = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); from ddscope.cli import main; "
               "sys.exit(main())", str(src), "serve", "--port", str(port), "--budget", "auto"]
        return _url(server_process(cmd, f"http://127.0.0.1:{port}", log), port)

    return start


class _url:
    """A server_process context that yields its URL."""

    def __init__(self, ctx: AbstractContextManager, port: int):
        self.ctx, self.url = ctx, f"http://127.0.0.1:{port}"

    def __enter__(self) -> str:
        self.ctx.__enter__()
        return self.url

    def __exit__(self, *exc) -> None:
        self.ctx.__exit__(*exc)


def prompts_for(engine: Engine, first: int, n: int) -> list[str]:
    """`n` code prompts, the `first`-th on, of 10 to 1000 tokens (evenly spread, in a scrambled order): each
    begins with its own number, so no two share a block of the prefix cache, and runs on through the
    workload's prompts (at most 428 tokens each) until it is long enough, cut there."""
    code = load_workload("code").prompts
    out = []
    for i in range(n):
        j = first + i
        length = 10 + 990 * ((7 * i) % n) // max(n - 1, 1)
        ids = engine.encode(f"# {j}\n")
        k = j
        while len(ids) < length:
            ids += engine.encode(code[k % len(code)] + "\n")
            k += 1
        out.append(engine.tokenizer.decode(ids[:length]))
    return out


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, temperature: float,
               seed: int | None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    t0, first, text, usage, ext = time.perf_counter(), None, [], None, {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            ext = chunk.get("ddscope") or ext  # ddscope's telemetry rides on the last chunk
            for c in chunk.get("choices", []):
                if c.get("text"):
                    first = first or time.perf_counter()
                    text.append(c["text"])
    return {"ttft": (first or time.perf_counter()) - t0, "tokens": usage["completion_tokens"], "text": "".join(text),
            "preemptions": ext.get("preemptions", 0)}


async def load(url: str, model: str, prompts: list[str], concurrency: int, temperature: float = 0.0,
               seeds: list[int] | None = None) -> dict:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def run(i: int) -> dict:
            async with gate:
                return await _one(client, url, model, prompts[i], 128 if i % 2 == 0 else 256, temperature,
                                  seeds[i] if seeds else None)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    return {"tok_s": sum(r["tokens"] for r in results) / wall, "ttft_p50": median(r["ttft"] for r in results),
            "texts": [r["text"] for r in results], "tokens": sum(r["tokens"] for r in results),
            "preemptions": sum(r["preemptions"] for r in results)}


def model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def abba(i: int, arms: tuple[str, str]) -> tuple[str, str]:
    """The order of the two arms in pair `i` (ABBA BAAB ...): each runs first as often as second, and the
    machine's drift over a pair falls on both alike."""
    return arms if i % 4 in (0, 3) else arms[::-1]


def alternate(run, repeats: int, what: str, reorders: bool = False) -> tuple[float, float]:
    """Median seconds of `run(arm)` for arms A and B, taking turns; B's output checked bitwise against A's
    (`reorders`: a change to the order of a sum, checked close to A's and its largest difference printed)."""
    times: dict[str, list[float]] = {"A": [], "B": []}
    for rep in range(repeats):
        outs = {}
        for name in ("AB" if rep % 2 == 0 else "BA"):
            seconds, outs[name] = run(name)
            times[name].append(seconds)
        if not reorders and not torch.equal(outs["A"], outs["B"]):
            raise SystemExit(f"{what}: B's outputs differ from A's")
    if reorders:
        a, b = (outs[name].float() for name in "AB")
        print(f"{what}: B's largest difference from A's, {(a - b).abs().max().item():.3g} (A's largest value "
              f"{a.abs().max().item():.3g})")
        torch.testing.assert_close(b, a, rtol=2e-2 if outs["A"].dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    a, b = (median(times[name]) for name in "AB")
    return a, b
