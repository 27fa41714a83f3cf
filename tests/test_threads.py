"""Threads for a large step (a long prefill, a batch): the idle CPUs, never fewer than the decode's, with equal
outputs."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from ddscope.engine import threads
from ddscope.engine.threads import PARALLEL_PREFILL_MIN, idle_cpus, step_threads, torch_threads


def test_a_fixed_setting_is_kept_and_a_lone_round_stays_on_the_decode_threads(monkeypatch):
    monkeypatch.setattr(threads, "idle_cpus", lambda: 3)
    assert step_threads(10_000, 1, 2) == 2
    assert step_threads(PARALLEL_PREFILL_MIN - 1, 1, None) == torch.get_num_threads() == 1
    assert step_threads(0, 1, 2) == 1  # a lone sequence's round: the setting is for large steps only
    assert step_threads(PARALLEL_PREFILL_MIN, 1, None) == 4
    assert step_threads(0, 2, None) == 4  # a batch


def test_no_idle_cpu_leaves_the_decode_threads(monkeypatch):
    monkeypatch.setattr(threads, "idle_cpus", lambda: 0)
    assert step_threads(10_000, 8, None) == 1


def test_torch_threads_are_restored_after_the_block():
    with torch_threads(2):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
    with pytest.raises(RuntimeError), torch_threads(2):
        raise RuntimeError("restored on the way out too")
    assert torch.get_num_threads() == 1


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="CPU time is read from Linux's /proc/stat")
def test_a_busy_process_takes_its_cpu_out_of_the_idle_ones(monkeypatch):
    """Both readings: the first (tasks runnable now) and the windowed one (other processes' CPU time)."""
    monkeypatch.setattr(threads, "_last", threads._Window())
    usable = len(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert idle_cpus() <= usable - 2  # this process and the busy one are both runnable
        time.sleep(threads.WINDOW_S + 0.3)
        assert idle_cpus() <= usable - 2  # the busy one took a core over the window
    finally:
        busy.kill()
        busy.wait()


def test_a_quiet_machine_leaves_the_other_cpus_idle(monkeypatch):
    """Over a window in which no other process ran (the busy time all this process's own), every other
    usable CPU is idle; and within a window the last answer is reused, without reading again."""
    monkeypatch.setattr(threads, "_last", threads._Window())
    clock = iter([100.0, 100.5, 100.6])
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    cpu = iter([10.0, 10.4, 10.4])
    monkeypatch.setattr(threads.time, "process_time", lambda: next(cpu))
    busy = iter([50.0, 50.4, 50.4])
    monkeypatch.setattr(threads, "_busy_s", lambda: next(busy))
    monkeypatch.setattr(threads, "_runnable_idle", lambda: 0)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    assert idle_cpus() == 0  # the first reading: tasks runnable now
    assert idle_cpus() == 1  # 0.4 s busy in 0.5 s, all of it ours: the other CPU is idle
    assert idle_cpus() == 1  # 0.1 s later: the same answer


def test_outputs_and_stats_do_not_depend_on_the_prefill_threads(tiny_engine, monkeypatch):
    monkeypatch.setattr(tiny_engine.scheduler.blocks, "prefix_cache", False)  # both runs prefill the whole prompt
    prompt = [(7 * i) % 300 + 5 for i in range(PARALLEL_PREFILL_MIN + 40)]
    runs = []
    for setting in (1, 2):
        monkeypatch.setattr(tiny_engine.runner, "prefill_threads", setting)
        out = tiny_engine.generate(prompt, max_new_tokens=12, method="ddtree", ignore_eos=True)
        assert out.stats.prefill_threads == setting and out.stats.cached_tokens == 0
        assert torch.get_num_threads() == 1  # the decode's threads again
        runs.append(out.token_ids)
    assert runs[0] == runs[1]
