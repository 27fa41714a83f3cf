"""Threads for a prefill: the idle CPUs at its start, never fewer than the decode's, with equal outputs."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from ddscope import threads
from ddscope.threads import PARALLEL_PREFILL_MIN, idle_cpus, prefill_threads, torch_threads


def test_a_fixed_setting_is_kept_and_a_short_prompt_stays_on_the_decode_threads(monkeypatch):
    monkeypatch.setattr(threads, "idle_cpus", lambda: 3)
    assert prefill_threads(10_000, 2) == 2
    assert prefill_threads(PARALLEL_PREFILL_MIN - 1, None) == torch.get_num_threads() == 1
    assert prefill_threads(PARALLEL_PREFILL_MIN, None) == 4


def test_no_idle_cpu_leaves_the_decode_threads(monkeypatch):
    monkeypatch.setattr(threads, "idle_cpus", lambda: 0)
    assert prefill_threads(10_000, None) == 1


def test_torch_threads_are_restored_after_the_block():
    with torch_threads(2):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
    with pytest.raises(RuntimeError), torch_threads(2):
        raise RuntimeError("restored on the way out too")
    assert torch.get_num_threads() == 1


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="procs_running is read from Linux's /proc/stat")
def test_a_busy_process_takes_its_cpu_out_of_the_idle_ones():
    usable = len(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert idle_cpus() <= usable - 2  # this process and the busy one are both runnable
    finally:
        busy.kill()
        busy.wait()


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
