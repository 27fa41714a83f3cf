"""A real SGLang as a peer: SGLang 0.5.23 on this CPU, in a virtual environment of its own (cached), serving a
target plain or with DFLASH and a drafter, for the standing tests (tests/test_real_sglang.py).

The recipe, tried on this machine kind (docs/bench.md, "A real SGLang"): sglang's requirements that install without
CUDA, then `torch==2.14.1` and `torchvision==0.29.1` from PyPI (their default build runs on a CPU; torchvision is a
hard import), then sglang itself without its dependencies. No CPU `sgl_kernel` exists on the registry:
assets/sglang_plugin holds ddscope's pure-PyTorch stand-in for the helpers SGLang's CPU engine imports, and a general
plugin that lets the CPU engine serve DFLASH (each file says what it changes and why). Neither touches SGLang's
scheduler, DFLASH worker, server or telemetry.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ddscope.peers.peer import PeerUnavailable, first_raised, peer_server
from ddscope.peers.venvs import InstallFailed, cache_root, ensure_venv
from ddscope.util.process import free_port

SGLANG = "sglang==0.5.23"
# sglang 0.5.23's requirements (its METADATA) less the CUDA-only kernels and their toolchains (cuda-python,
# flash-attn-4, flashinfer, humming-kernels, nvidia-*, nvshmem4py, quack-kernels, sgl-deep-*, sgl-flash-mla,
# sglang-kernel, tilelang, torch_memory_saver, kernels, deepseek-recipe, smg-grpc-servicer, tml-renderers) and the
# media ones (torchaudio, torchcodec, av, decord2).
REQUIREMENTS = (
    "torch==2.14.1", "torchvision==0.29.1", "aiohttp", "anthropic>=0.20.0", "apache-tvm-ffi==0.1.11",
    "blobfile==3.0.0", "build", "compressed-tensors==0.18.0", "datasets", "distro", "easydict", "einops", "fastapi",
    "gguf", "interegular", "IPython", "llguidance>=1.7.6,<2", "mistral_common>=1.11.5", "modelscope", "msgspec",
    "ninja", "numba==0.65.1", "numpy", "nvidia-ml-py", "openai==2.8.0", "openai-harmony==0.0.4", "orjson",
    "outlines==0.1.11", "packaging", "partial_json_parser", "pillow", "prometheus-client>=0.20.0", "psutil", "py-spy",
    "pybase64", "pydantic", "python-dateutil<3", "python-multipart", "pyzmq>=25.1.2", "regex", "requests", "scipy",
    "sentencepiece==0.2.1", "setproctitle", "soundfile==0.13.1", "tiktoken", "timm==1.0.25", "tokenizers==0.23.2",
    "tqdm", "transformers==5.19.0", "uvicorn>=0.51", "uvloop", "watchfiles", "xgrammar==0.2.7", "xxhash", "zstandard")
INSTALL_TIMEOUT_S = 1800  # about 7 GB; 5 minutes here on a good network
STARTUP_TIMEOUT_S = 300.0
PLUGIN_DIR = Path(__file__).parents[1] / "assets" / "sglang_plugin"
# Success is "The server is fired up and ready to roll!"; a failed start's first traceback holds the cause, which a
# scheduler reports as "Scheduler hit an exception:" (srt/managers/scheduler.py:6372 in 0.5.23).
FAILURE_MARKERS = ("Scheduler hit an exception:", "Traceback (most recent call last):")


def venv_dir() -> Path:
    """Keyed by the requirement list, so a changed recipe is a fresh venv."""
    key = hashlib.sha256("\n".join((*REQUIREMENTS, SGLANG)).encode()).hexdigest()[:12]
    return Path(os.environ.get("DDSCOPE_SGLANG_VENV", cache_root() / f"sglang-0.5.23-{key}"))


def ensure_installed(say: Callable[[str], None] | None = None) -> Path:
    """The venv's python, installing SGLang first if the cache has no complete install."""
    try:
        return ensure_venv(venv_dir(), REQUIREMENTS, "import sglang, torchvision", no_deps=(SGLANG,),
                           timeout_s=INSTALL_TIMEOUT_S, say=say)
    except InstallFailed as e:
        raise PeerUnavailable(str(e)) from e


def command(python: Path, target: Path, drafter: Path | None, port: int, max_total_tokens: int = 16384,
            extra: tuple[str, ...] = ()) -> list[str]:
    """SGLang on the CPU engine with torch_native attention, in fp32; `max_total_tokens` sizes its KV cache (it
    would otherwise take a share of the machine's memory)."""
    cmd = [str(python), "-m", "sglang.launch_server", "--model-path", str(target), "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
           "--disable-overlap-schedule", "--enable-metrics", "--max-total-tokens", str(max_total_tokens), *extra]
    if drafter is not None:
        cmd += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(drafter)]
    return cmd


def environment(plugin: bool = True) -> dict[str, str]:
    """SGLang's CPU engine (without it SGLang imports vllm: layers/rotary_embedding/base.py:138), with ddscope's
    stand-in always and its DFLASH plugin unless `plugin` is False."""
    paths = [str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    if not plugin:
        env["SGLANG_PLUGINS"] = "none"  # a whitelist naming no plugin (srt/plugins/__init__.py:51-55)
    return env


def root_cause(log: str) -> str | None:
    """The first exception SGLang raised while it started."""
    lines = log.splitlines()
    for marker in FAILURE_MARKERS:
        starts = [i for i, line in enumerate(lines) if marker in line]
        if starts and (cause := first_raised(lines[starts[0]:])):
            return cause
    return None


@contextmanager
def sglang_server(target: Path, drafter: Path | None, log_path: Path, plugin: bool = True,
                  extra: tuple[str, ...] = (), startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """An SGLang server on a free 127.0.0.1 port (DFLASH with `drafter`, plain without); yields its URL. Raises
    PeerUnavailable when it cannot be installed or does not come up."""
    python, port = ensure_installed(), free_port()
    with peer_server(command(python, target, drafter, port, extra=extra), port, log_path, startup_timeout_s,
                     environment(plugin), "SGLang", root_cause) as url:
        yield url

