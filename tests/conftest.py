import pytest

from ddscope.bench.synthetic_models import make_tiny_pair


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    """DDSCOPE_CACHE (auto's verify-cost calibrations) in this session's temp dir: no test reads what an
    earlier run measured, under another load or code. The vLLM peer's venv is not kept there
    (ddscope.peers.vllm.venv_dir), so it stays installed across runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DDSCOPE_CACHE", str(tmp_path_factory.mktemp("ddscope-cache")))
        yield


@pytest.fixture(autouse=True, scope="session")
def _installs_are_announced(pytestconfig):
    """A peer's first install takes minutes: say so on the terminal, past pytest's output capture."""
    from ddscope.peers import venvs

    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    terminal = pytestconfig.pluginmanager.getplugin("terminalreporter")

    def say(message: str) -> None:
        with capture.global_and_fixture_disabled():
            terminal.write_line(f"ddscope: {message}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(venvs, "announce", say)
        yield


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, drafter_dir): a random Qwen3 target and a z-lab-layout drafter, block size 8."""
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_pair):
    from ddscope import Engine
    return Engine.load(*tiny_pair)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny test models run fastest single-threaded, and CI's two cores are then not oversubscribed."""
    import torch
    torch.set_num_threads(1)


@pytest.fixture
def virtual_time(monkeypatch):
    """Time that passes only in target forwards and drafts, at fixed prices (tests/support/virtual_time.py): for tests
    of what `auto` decides, which must not depend on this machine's speed."""
    from support.virtual_time import VirtualTime

    clock = VirtualTime(monkeypatch)
    clock.install()
    return clock


@pytest.fixture(autouse=True, scope="module")
def _hand_back_freed_memory():
    """After each file, the memory its engines freed goes back to Linux: an engine keeps freed memory for its next
    step (ddscope.models.pages.keep_freed), which in a process that loads engine after engine is its peak."""
    yield
    import gc

    from ddscope.models.pages import trim
    gc.collect()
    trim()
