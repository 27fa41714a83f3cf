"""Torch threads for a prefill.

A decode step's small ops run best on few threads (options.default_threads: a busy core stalls every op
of a many-thread step). A long prompt's forward is large matmuls and attention, which split well: on
the 2-core Xeon here a 5553-token prefill takes 404 ms on 2 threads against 741 on 1, bitwise the same.
Beside a busy process, though, 2 threads took 1168 ms (benchmarks/prefill.py --busy). So by default a
prefill takes the CPUs that are idle when it starts, and the decode keeps --threads.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PARALLEL_PREFILL_MIN = 256  # new prompt tokens; below it a second thread costs more than it saves
READS, READ_GAP_S = 3, 0.0005  # procs_running is a snapshot: the least of a few shuts out our own blips


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


def idle_cpus() -> int:
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


def prefill_threads(new_tokens: int, setting: int | None) -> int:
    """Threads for a prefill of `new_tokens`: `setting` when fixed; None: this thread's own plus the
    idle CPUs, for a prompt long enough to split, never fewer than the decode's."""
    decode = torch.get_num_threads()
    if setting is not None:
        return setting
    if new_tokens < PARALLEL_PREFILL_MIN:
        return decode
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
