"""On-disk state shared between processes: the verify-cost cache (`budget="auto"`) and the tests' own."""
from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddscope.peers import venvs
from ddscope.peers import vllm as vllm_peer
from ddscope.policy.cost import NODE_GRID, VerifyCost

MAX_CTX = 1000  # calibrated at contexts 0, 512 and 1000


def stub_target() -> SimpleNamespace:
    """All `cached` reads of a target: its device and dtype, for the file's key."""
    return SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(1)))


def measured() -> VerifyCost:
    ctx = [0, 512, MAX_CTX]
    return VerifyCost(ctx, list(NODE_GRID), [[1.0 + 0.01 * n + 1e-4 * c for n in NODE_GRID] for c in ctx])


@pytest.fixture
def calibrations(tmp_path, monkeypatch) -> list[int]:
    """A fresh DDSCOPE_CACHE, and calibration replaced by `measured()`; the list counts the calibrations."""
    monkeypatch.setenv("DDSCOPE_CACHE", str(tmp_path / "cache"))
    calls: list[int] = []

    def calibrate(cls, target, max_ctx, repeats=5):
        calls.append(max_ctx)
        return measured()

    monkeypatch.setattr(VerifyCost, "calibrate", classmethod(calibrate))
    return calls


def cache_file() -> Path:
    [path] = Path(os.environ["DDSCOPE_CACHE"]).glob("verify-cost-*.json")
    return path


def test_calibrates_once_then_reads_the_file(calibrations):
    first = VerifyCost.cached(stub_target(), MAX_CTX, "model")
    again = VerifyCost.cached(stub_target(), MAX_CTX, "model")
    assert calibrations == [MAX_CTX] and again.to_dict() == first.to_dict() == measured().to_dict()


@pytest.mark.parametrize("content", [
    '{"ctx": [0.0, 512.0, 1000.0], "nodes": [1.0, 2.0',  # torn: a writer killed, or two racing
    "[]",
    '{"ctx": [0, 1000], "nodes": [1, 65], "ms": [[1, 2], [3, 4]]}',  # another version's grid
    json.dumps({**measured().to_dict(), "ms": [[float("nan")] * len(NODE_GRID)] * 3}),
    "\udcff",  # not UTF-8
], ids=["torn", "not-an-object", "other-grid", "nan", "not-utf8"])
def test_a_file_that_holds_no_calibration_is_calibrated_again_and_overwritten(calibrations, content):
    VerifyCost.cached(stub_target(), MAX_CTX, "model")
    cache_file().write_bytes(content.encode("utf-8", "surrogateescape"))
    cost = VerifyCost.cached(stub_target(), MAX_CTX, "model")
    assert cost.to_dict() == measured().to_dict() and len(calibrations) == 2
    assert json.loads(cache_file().read_text()) == measured().to_dict()


def test_an_unwritable_cache_still_answers(calibrations, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DDSCOPE_CACHE", str(blocker / "cache"))  # mkdir under a file fails
    assert VerifyCost.cached(stub_target(), MAX_CTX, "model").to_dict() == measured().to_dict()


def test_two_writers_at_once_both_write_whole_files(calibrations, monkeypatch):
    """Two calibrating at once (processes on one machine) both write, then both rename (os.replace waits
    for the other): with one fixed temp name, the second rename found the first had taken its file."""
    barrier, replace = threading.Barrier(2, timeout=10), os.replace

    def replace_together(src, dst):
        barrier.wait()
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_together)
    errors: list[BaseException] = []

    def calibrate() -> None:
        try:
            VerifyCost.cached(stub_target(), MAX_CTX, "model")
        except BaseException as e:  # noqa: BLE001 - reported below, from the main thread
            errors.append(e)

    threads = [threading.Thread(target=calibrate) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calibrations) == 2
    assert json.loads(cache_file().read_text()) == measured().to_dict()
    assert [p.name for p in cache_file().parent.iterdir()] == [cache_file().name]  # no temp file left


def test_tests_keep_their_calibrations_to_this_session(tmp_path_factory):
    """Not the user's cache, where earlier runs measured under other loads and code; the vLLM peer's venv
    (2 minutes to install) stays where runs reuse it."""
    cache = Path(os.environ["DDSCOPE_CACHE"])
    assert cache.is_relative_to(tmp_path_factory.getbasetemp())
    assert not vllm_peer.venv_dir().is_relative_to(cache)


def test_two_processes_needing_the_peer_at_once_install_it_once(tmp_path, monkeypatch):
    """The second finds the first's install (under its lock), rather than removing the half-built venv
    and installing into the same folder."""
    monkeypatch.setenv("DDSCOPE_VLLM_VENV", str(tmp_path / "venv"))
    both_installing = threading.Barrier(2, timeout=1)  # only where the two overlap
    built, active, most, count = [], [0], [0], threading.Lock()

    def run(cmd: list[str], what: str, *deadline: float) -> None:
        with count:
            active[0] += 1
            most[0] = max(most[0], active[0])
        if what == "python -m venv":
            built.append(cmd[-1])
            (Path(cmd[-1]) / "bin").mkdir(parents=True, exist_ok=True)
            (Path(cmd[-1]) / "bin" / "python").touch()
            with contextlib.suppress(threading.BrokenBarrierError):
                both_installing.wait()
        with count:
            active[0] -= 1

    monkeypatch.setattr(venvs, "_run", run)
    pythons: list[Path] = []
    threads = [threading.Thread(target=lambda: pythons.append(vllm_peer.ensure_installed(say=lambda msg: None)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and most[0] == 1
    assert pythons == [tmp_path / "venv" / "bin" / "python"] * 2
