"""After a cancel, timeout, preemption, abort or fault: the engine holds no request, and every block of its pool
is free (registered ones stay in the prefix cache, free) with a reference count of zero."""
from __future__ import annotations

import time


def assert_pool_empty(engine, timeout_s: float = 30.0) -> None:
    """Waits (bounded) for a server's worker to finish its last step first."""
    deadline = time.monotonic() + timeout_s
    while engine.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    blocks = engine.scheduler.blocks
    assert not engine.busy, "a request was left in the engine"
    assert blocks.used == 0 and not any(blocks.refs), f"blocks leaked: {blocks.used} in use"
