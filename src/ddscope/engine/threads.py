"""Torch threads for a large step: a prefill, or a batch.

A decode step's small ops run best on few threads (util.options.default_threads: a busy core stalls every op
of a many-thread step). A long prompt's forward is large matmuls and attention, which split well over more
threads, bitwise the same, unless another process keeps one of their cores busy (benchmarks/prefill.py
--busy). A batched step is large matmuls too (benchmarks/serve_ab.py); docs/server.md, Threads of large
steps, holds both measurements. So by default a long prefill, or a step of several sequences, takes the CPUs
that other processes leave idle, and a lone sequence's decode keeps --threads.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PARALLEL_PREFILL_MIN = 256  # new prompt tokens; below it a second thread costs more than it saves
READS, READ_GAP_S = 3, 0.0005  # procs_running is a snapshot: the least of a few shuts out our own blips
WINDOW_S, STALE_S = 0.2, 5.0  # idle CPUs are judged over at least this long, from readings at most this old


def _running() -> int | None:
    """Runnable tasks system-wide, this thread included (/proc/stat procs_running); None off Linux."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"procs_running"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _busy_s() -> float | None:
    """CPU seconds spent busy on all CPUs since boot, stolen time included (/proc/stat); None off Linux."""
    try:
        with open("/proc/stat", "rb") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    except (OSError, ValueError):  # ValueError: not the 8 numbers of a Linux 2.6.11+ `cpu` line
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _runnable_idle() -> int:
    """The usable CPUs that no other runnable task wants now (0 when that cannot be read)."""
    reads = []
    for i in range(READS):
        if i:
            time.sleep(READ_GAP_S)
        running = _running()
        if running is None:
            return 0
        reads.append(running)
    return max(0, len(os.sched_getaffinity(0)) - min(reads))


class _Window:
    """The last reading: when, the CPUs' busy seconds, this process's CPU seconds, and the answer."""
    at: float | None = None
    busy = ours = 0.0
    idle = 0


_last = _Window()


def idle_cpus() -> int:
    """The usable CPUs beyond this thread that other processes left free: over the last WINDOW_S or more,
    the CPUs' busy time less this process's own (a client that wakes now and then, as a load tool's
    streams do, takes a fraction of a core, not one; rounded at half a core). The first reading, or one
    after STALE_S without any, counts the tasks runnable now instead. Read at most once a WINDOW_S."""
    now, busy = time.monotonic(), _busy_s()
    if busy is None:
        return 0
    last, ours = _last, time.process_time()
    if last.at is not None and now - last.at < WINDOW_S:
        return last.idle
    if last.at is None or now - last.at > STALE_S:
        idle = _runnable_idle()
    else:
        others = max(0.0, (busy - last.busy) - (ours - last.ours)) / (now - last.at)
        idle = max(0, math.floor(len(os.sched_getaffinity(0)) - others + 0.5) - 1)
    last.at, last.busy, last.ours, last.idle = now, busy, ours, idle
    return idle


def step_threads(new_tokens: int, sequences: int, setting: int | None) -> int:
    """Threads for a step that prefills `new_tokens` beside the rounds of `sequences` in all: a large step
    (a prefill long enough to split, or a batch of several sequences: large matmuls and one attention per
    sequence) takes `setting` when fixed, else this thread's own plus the idle CPUs, never fewer than the
    decode's; one sequence's round keeps the decode's."""
    decode = torch.get_num_threads()
    if new_tokens < PARALLEL_PREFILL_MIN and sequences < 2:
        return decode
    if setting is not None:
        return setting
    return max(decode, 1 + idle_cpus())


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block, restored after."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)
