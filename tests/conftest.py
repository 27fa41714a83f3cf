import pytest

from ddscope.testing import make_tiny_pair


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
