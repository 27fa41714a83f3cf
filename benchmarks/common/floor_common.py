"""Helper module shared by floor/floor.py and floor/floor_check.py (not a benchmark itself): model and requests."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def build(root: Path) -> tuple[Path, Path]:
    from ddscope.bench.synthetic_models import make_drafter, make_target

    target = make_target(root / "target", "qwen3", hidden=1024, layers=24, max_len=8192)
    return target, make_drafter(root / "drafter", target, block_size=16)


def prompt(context: int, i: int) -> list[int]:
    return [(7 * i + 3 * k) % 300 + 5 for k in range(context)]  # distinct per request: no prefix-cache hits


def send(url: str, body: dict, stream: bool) -> dict:
    """One completion; streamed: the gaps between its chunks, in ms."""
    with httpx.Client(timeout=900) as client:
        if not stream:
            return client.post(f"{url}/v1/completions", json=body).json()
        gaps, last = [], None
        with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(1e3 * (now - last))
                    last = now
        return {"gaps": gaps}


def together(url: str, bodies: list[dict], stream: bool = False) -> list[dict]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: send(url, b, stream), bodies))


def late(values: list) -> list:
    """The second half of a run's steps: past its warm-up."""
    return values[len(values) // 2:]
