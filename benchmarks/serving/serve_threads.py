"""Single-request decode tok/s of `ddscope serve` per --threads, alone and beside a busy CPU core.

One server per arm (`ddscope serve --method M --threads N`, or no --threads for the default) runs for the
whole measurement; every repeat walks the load conditions (nothing else running; one `while True: pass`
process, unpinned; the same pinned to CPU 0), and within each condition every arm in turn, so arms and
conditions are interleaved in time. A reading is the median `ddscope.decode_tok_per_s` of --requests
sequential greedy requests (--max-tokens, ignore_eos). The client only waits on HTTP to 127.0.0.1; every
request has a timeout and the whole run a deadline (--max-minutes).

On a shared machine other work lands in some readings: each reading also measures the CPU that
processes other than the server, the busy loop and this client used meanwhile (/proc/stat less their
/proc/PID/stat), and a reading with more than --max-background cores of it is taken again (up to
--attempts times; the last is kept and counted as noisy).

    python benchmarks/serving/serve_threads.py --arms 1,2,default --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from ddscope.bench.limit.hardware import cpu_model
from ddscope.util.options import default_threads

CONDITIONS = ("alone", "busy", "busy-cpu0")
PROMPT = "def fib(n):"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(arm: str, method: str, log_dir: Path, startup_s: float = 120.0) -> Iterator[tuple[str, int]]:
    """`ddscope serve --method METHOD` with --threads ARM (none for 'default'); yields (URL, pid) once healthy."""
    port = _free_port()
    cmd = [sys.executable, "-m", "ddscope.cli", "serve", "--method", method, "--port", str(port)]
    cmd += [] if arm == "default" else ["--threads", arm]
    with (log_dir / f"serve-{arm}.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server for arm {arm} did not come up; see {log_dir}/serve-{arm}.log")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def load(condition: str) -> Iterator[list[int]]:
    """A busy-loop process for the condition (none when 'alone'), ended when the readings are done; yields
    its pid (in a list, empty when alone)."""
    if condition == "alone":
        yield []
        return
    pin = (lambda: os.sched_setaffinity(0, {0})) if condition == "busy-cpu0" else None
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    try:
        time.sleep(1.0)  # let the scheduler place it
        yield [busy.pid]
    finally:
        busy.kill()
        busy.wait()


def _machine_jiffies() -> int:
    """CPU time spent by all processes (not idle, not iowait), in clock ticks."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return user + nice + system + irq + softirq + steal


def _process_jiffies(pid: int) -> int:
    """utime + stime of a process, all its threads, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _ticks(pids: list[int]) -> tuple[float, int, int]:
    return time.monotonic(), _machine_jiffies(), sum(_process_jiffies(p) for p in pids)


def decode_tok_s(client: httpx.Client, url: str, max_tokens: int) -> float:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["ddscope"]["decode_tok_per_s"]


def reading(client: httpx.Client, url: str, requests: int, max_tokens: int, pids: list[int]) -> tuple[float, float]:
    """(median decode tok/s, cores used meanwhile by processes other than `pids`)."""
    t0, machine0, ours0 = _ticks(pids)
    tok_s = statistics.median(decode_tok_s(client, url, max_tokens) for _ in range(requests))
    t1, machine1, ours1 = _ticks(pids)
    return tok_s, ((machine1 - machine0) - (ours1 - ours0)) / os.sysconf("SC_CLK_TCK") / (t1 - t0)


Reading = dict[str, float]  # {"tok_s", "background" (cores), "attempts"}


def clean_reading(client: httpx.Client, url: str, pids: list[int], args: argparse.Namespace) -> Reading:
    """A reading taken again while other processes used more than --max-background cores during it."""
    for attempt in range(1, args.attempts + 1):
        tok_s, background = reading(client, url, args.requests, args.max_tokens, pids)
        if background <= args.max_background:
            break
    return {"tok_s": tok_s, "background": background, "attempts": attempt}


def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, dict[str, list[Reading]]]:
    deadline = time.monotonic() + args.max_minutes * 60
    results: dict[str, dict[str, list[Reading]]] = {arm: {c: [] for c in args.conditions} for arm in args.arms}
    with ExitStack() as stack, httpx.Client(timeout=args.request_timeout) as client:
        servers = {arm: stack.enter_context(server(arm, args.method, log_dir)) for arm in args.arms}
        for url, _ in servers.values():  # warm-up: first requests pay for allocations and kernel selection
            reading(client, url, 2, args.max_tokens, [])
        for rep in range(args.repeats):
            for condition in args.conditions:
                with load(condition) as busy:
                    for arm, (url, pid) in servers.items():
                        if time.monotonic() > deadline:
                            print(f"--max-minutes reached after {rep} full repeats", file=sys.stderr)
                            return results
                        results[arm][condition].append(clean_reading(client, url, [pid, os.getpid(), *busy], args))
            print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    return results


def _cell(readings: list[Reading], max_background: float) -> tuple[float, str]:
    """(median tok/s, 'median (min-max) n=K') over the clean readings, or over all of them, starred, if none is."""
    clean = [r["tok_s"] for r in readings if r["background"] <= max_background]
    values = clean or [r["tok_s"] for r in readings]
    if not values:
        return float("nan"), "-"
    med = statistics.median(values)
    return med, f"{med:.0f} ({min(values):.0f}-{max(values):.0f}) n={len(clean)}" + ("" if clean else "*")


def report(results: dict[str, dict[str, list[Reading]]], max_background: float) -> str:
    """Medians over the readings during which other processes stayed under --max-background cores."""
    conditions = list(next(iter(results.values())))
    head = "| --threads | " + " | ".join(f"{c} tok/s" for c in conditions) + " | " + \
        " | ".join(f"{c} / alone" for c in conditions if c != "alone") + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for arm, by_cond in results.items():
        cells = {c: _cell(rs, max_background) for c, rs in by_cond.items()}
        ratios = [f"{cells[c][0] / cells['alone'][0]:.2f}" for c in conditions if c != "alone"] \
            if "alone" in cells else []
        label = f"default ({default_threads()})" if arm == "default" else arm
        lines.append(f"| {label} | " + " | ".join([cells[c][1] for c in conditions] + ratios) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="1,2,default", help="comma list of --threads values or 'default' "
                                                          "(default: %(default)s)")
    p.add_argument("--conditions", default=",".join(CONDITIONS),
                   help=f"comma list of {', '.join(CONDITIONS)} (default: %(default)s)")
    p.add_argument("--method", choices=("ar", "dflash", "ddtree"), default="ar",
                   help="the servers' --method (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="passes over conditions x arms (default: %(default)s)")
    p.add_argument("--requests", type=int, default=3, help="requests per reading (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds (default: %(default)s)")
    p.add_argument("--max-minutes", type=float, default=30.0, help="stop after this long (default: %(default)s)")
    p.add_argument("--max-background", type=float, default=0.15,
                   help="cores other processes may use during a reading before it is taken again "
                        "(default: %(default)s)")
    p.add_argument("--attempts", type=int, default=4, help="tries per reading (default: %(default)s)")
    p.add_argument("--json", type=Path, help="also write the readings here (default: none)")
    p.add_argument("--report-only", action="store_true", help="print the table of an earlier --json run")
    args = p.parse_args()
    args.arms = [a for a in args.arms.split(",") if a]
    args.conditions = [c for c in args.conditions.split(",") if c]
    if bad := set(args.conditions) - set(CONDITIONS):
        p.error(f"unknown conditions {sorted(bad)}")
    if args.report_only:
        if not (args.json and args.json.is_file()):
            p.error("--report-only needs the --json file of an earlier run")
        print(report(json.loads(args.json.read_text())["results"], args.max_background))
        return 0
    with tempfile.TemporaryDirectory(prefix="serve-threads-") as log_dir:
        results = measure(args, Path(log_dir))
    print(f"CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} usable CPUs; ddscope serve --method {args.method}, demo pair, "
          f"{args.max_tokens} tokens, median of {args.requests} requests per reading; median (min-max) over the "
          f"n readings of {args.repeats} repeats during which other processes used <= {args.max_background} cores "
          "(* = none did: all readings)")
    print(report(results, args.max_background))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "args": {k: v for k, v in vars(args).items()
                                                                      if k != "json"}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
