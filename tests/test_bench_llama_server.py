"""A real llama.cpp `llama-server` with speculative decoding, swept by `ddscope bench`.

Needs a `llama-server` binary and a llama.cpp source tree (for `convert_hf_to_gguf.py` and its
`gguf-py`); docs/bench.md ("A real llama-server") has the recipe, which builds both under
/opt/llama. Set LLAMA_SERVER and LLAMA_CPP_DIR to use others. Skips, with the reason, without them.

The demo target is converted to GGUF and drafts for itself with a synthetic acceptance length
(`--spec-synth-len`), so acceptance is neither 1 nor the draft length. The sweep's avg_commit (from
the server's exact counters) must equal the server's own per-request `mean len` log line.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ddscope.cli import main
from ddscope.engine.limits import DEMO_DIR
from ddscope.util.process import free_port

LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", "/opt/llama/src"))
LLAMA_SERVER = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server") or "/opt/llama/build/bin/llama-server"
STARTUP_S = 120

# The demo tokenizer is a byte-level BPE of our own: the converter would look for a SentencePiece
# model first and then reject the unknown tokenizer hash. It splits text with the GPT-2 regex, so
# tell the converter exactly that and run it unchanged otherwise.
CONVERT = """
import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
def no_sentencepiece(self, *args, **kwargs):
    raise FileNotFoundError("byte-level BPE: no tokenizer.model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def _missing() -> str | None:
    if not (Path(LLAMA_SERVER).is_file() and os.access(LLAMA_SERVER, os.X_OK)):
        return f"no llama-server binary (LLAMA_SERVER, PATH or {LLAMA_SERVER}); recipe in docs/bench.md"
    if not (LLAMA_CPP_DIR / "convert_hf_to_gguf.py").is_file():
        return f"no llama.cpp source tree with convert_hf_to_gguf.py at {LLAMA_CPP_DIR} (LLAMA_CPP_DIR)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "demo-target.gguf"
    done = subprocess.run([sys.executable, "-c", CONVERT, str(LLAMA_CPP_DIR), str(DEMO_DIR / "target"),
                           "--outfile", str(out), "--outtype", "f32"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.fixture
def llama_server(gguf: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """llama-server on 127.0.0.1 drafting for itself; yields (url, its log file)."""
    port, log = free_port(), tmp_path / "llama-server.log"
    cmd = [LLAMA_SERVER, "-m", str(gguf), "-md", str(gguf), "--spec-type", "draft-simple", "--spec-draft-n-max", "4",
           "--spec-synth-len", "2.5", "--host", "127.0.0.1", "--port", str(port), "-c", "1024", "-np", "1",
           "-t", "1", "--metrics"]
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"llama-server did not start: {log.read_text()[-2000:]}")
        yield url, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_sweep_reads_the_servers_exact_acceptance(llama_server, tmp_path, capsys):
    url, log = llama_server
    out = tmp_path / "out"
    code = main(["bench", "sweep", "--url", url, "--tokenizer", str(DEMO_DIR / "target"), "--contexts", "16,200",
                 "--max-tokens", "64", "--repeats", "1", "--warmup", "0", "--server-log", str(log),
                 "--log-gap", "0.6", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    assert doc["backend"]["name"] == "llamacpp" and doc["backend"]["max_model_len"] == 1024
    assert doc["acceptance_source"]["name"] == "llamacpp.counters"
    for r in doc["records"]:
        assert not r["error"] and r["completion_tokens"] == 64 and r["prompt_tokens"] == r["context"]
        assert 1.2 < r["avg_commit"] < 5.0  # drafting happened, and not all of it was accepted
        # the server's own `mean len = %5.2f` for this request, matched by wall-clock window
        assert r["log_lines"] == 1 and r["server_avg_commit"] == pytest.approx(r["log_avg_commit"], abs=0.006)
