"""Prefill time of the target, side by side in one process: on 1 and 2 threads (optionally beside a busy
core), and with the last layer finishing every row ("all rows") or only the rows the first draft reads
("trimmed", the engine's way with a sliding-window drafter).

    python benchmarks/engine/prefill.py [--target DIR --drafter DIR] [--contexts 1663 3333 5553] [--repeats 3] [--busy]

Prompts are random tokens (the cost does not depend on them); arms alternate, one warm-up each, and cells
are the median ms over `--repeats`. The CPU is named in the first line.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
from pathlib import Path
import time
from collections.abc import Iterator

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from engine_args import load_engine, parser

from ddscope import Engine
from ddscope.bench.limit.hardware import cpu_model


@contextlib.contextmanager
def busy_core(on: bool) -> Iterator[None]:
    """One spinning Python process beside the measurement, as another tenant would be."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        if spinner:
            time.sleep(0.5)
        yield
    finally:
        if spinner:
            spinner.kill()
            spinner.wait()


def prefill_ms(engine: Engine, prompt: list[int], threads: int, trimmed: bool) -> float:
    """Wall ms of the engine's prefill of `prompt`; not trimmed: as if the drafter saw the whole context."""
    seq = engine.sequence(prompt, max_new_tokens=1, method="ddtree", budget=8)
    if not trimmed:
        seq.decoder.first_draft_reach = lambda prompt_len: 0
    engine.runner.prefill_threads = threads
    t0 = time.perf_counter()
    engine.add(seq)
    engine.step()  # the whole prompt in one chunk (load_engine's max_prefill_tokens), no prefix cache
    ms = 1000 * (time.perf_counter() - t0)
    engine.abort(seq)
    return ms


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[1663, 3333, 5553])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--busy", action="store_true", help="also measure beside one spinning process")
    args = p.parse_args(argv)
    if min(args.contexts) < 1 or args.repeats < 1:
        p.error("--contexts and --repeats must be positive")
    engine = load_engine(args)
    if max(args.contexts) >= engine.max_model_len:
        p.error(f"--contexts must be below the engine's max_model_len ({engine.max_model_len})")
    engine.scheduler.max_prefill_tokens = engine.max_model_len  # one forward a prompt
    engine.scheduler.blocks.prefix_cache = False  # every arm prefills the whole prompt
    print(f"{cpu_model()}, {len(os.sched_getaffinity(0))} CPUs usable; ms, median of {args.repeats}\n")
    arms = [(threads, trimmed) for threads in (1, 2) for trimmed in (False, True)]
    header = " | ".join(f"{t} thread{'s' * (t > 1)}, {'trimmed' if tr else 'all rows'}" for t, tr in arms)
    print(f"| prompt tokens | busy | {header} |\n|---|---|{'---|' * len(arms)}")
    gen = torch.Generator().manual_seed(0)
    for busy in (False, True) if args.busy else (False,):
        with busy_core(busy):
            for n in args.contexts:
                prompt = torch.randint(10, engine.target.cfg.vocab_size, (n,), generator=gen).tolist()
                times: dict[tuple[int, bool], list[float]] = {arm: [] for arm in arms}
                for rep in range(args.repeats + 1):
                    for arm in arms:
                        ms = prefill_ms(engine, prompt, *arm)
                        if rep:  # the first pass warms up
                            times[arm].append(ms)
                cells = " | ".join(f"{statistics.median(times[arm]):.0f}" for arm in arms)
                print(f"| {n} | {'yes' if busy else 'no'} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
