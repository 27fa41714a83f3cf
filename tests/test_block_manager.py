"""The block manager's free blocks are runs, not a set: its answers equal a plain set's (a model check over random
operations), and an admission's bookkeeping does not grow with the pool (issue 41, audit item 7: it sorted every
empty block on each admission, 16 MB of list at 2M blocks)."""
from __future__ import annotations

import random
import tracemalloc

from ddscope.engine.block_manager import BlockManager, FreeRuns
from ddscope.models.kv_pool import Pages


def test_free_runs_answer_as_a_set_does():
    rng = random.Random(0)
    n = 300
    runs, model = FreeRuns(n), set(range(n))
    for _ in range(5000):
        if model and rng.random() < 0.5:
            b = rng.choice(sorted(model))
            length = 1
            while b + length in model and length < 5 and rng.random() < 0.5:
                length += 1
            runs.take(b, length)
            model -= set(range(b, b + length))
        elif len(model) < n:
            b = rng.choice(sorted(set(range(n)) - model))
            runs.add(b)
            model.add(b)
        assert len(runs) == len(model) and runs.lowest() == min(model, default=None)
        want = rng.randint(1, 8)
        fit = next((a for a in sorted(model) if set(range(a, a + want)) <= model), None)
        assert runs.first_fit(want) == fit
        probe = rng.randrange(n)
        assert (probe in runs) == (probe in model)


def test_admissions_cost_the_runs_not_the_pool():
    blocks = BlockManager(2_000_000)
    tracemalloc.start()
    try:
        for i in range(200):
            pages = Pages()
            blocks.grow(pages, 64 * 4, expect=64 * 40)  # 4 blocks now, a run of 40 kept to grow into
            assert pages.contiguous
            if i % 2:
                blocks.release(pages)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak / 2**20:.1f} MiB of bookkeeping for 200 admissions"
    assert blocks.used == 100 * 4 and len(blocks.soft) == 100 * 36 and len(blocks.plain.starts) <= 101
