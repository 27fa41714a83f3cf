"""NVIDIA's AIPerf 0.13.0, the load tool users run against vLLM and SGLang, in its own cached venv: a real client
nobody here wrote. Its run writes an artifact folder (profile_export.jsonl, one record a request)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddscope.peers.venvs import InstallFailed, cache_root, ensure_venv, in_ci

AIPERF = "aiperf==0.13.0"
INSTALL_TIMEOUT_S = 1500


def aiperf() -> Path:
    """The venv's `aiperf` executable; under CI a failed install fails the test, elsewhere it skips, saying why."""
    try:
        python = ensure_venv(cache_root() / AIPERF.replace("==", "-"), [AIPERF], "import aiperf",
                             timeout_s=INSTALL_TIMEOUT_S)
    except InstallFailed as e:
        if in_ci():
            pytest.fail(f"CI=true, but AIPerf is not available: {e}", pytrace=False)
        pytest.skip(f"AIPerf is not available here: {e}")
    return python.parent / "aiperf"


def profile(url: str, model: str, tokenizer: Path, out: Path, *, prompts: Path, requests: int, concurrency: int,
            max_tokens: int, extra: dict | None = None, timeout_s: float = 900) -> Path:
    """`aiperf profile` streamed at T=0 with ignore_eos over `prompts` (one {"text"} a line); the artifact folder."""
    inputs = {"temperature": 0, "ignore_eos": True, "max_tokens": max_tokens, **(extra or {})}
    cmd = [str(aiperf()), "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", str(tokenizer), "--custom-dataset-type", "single_turn", "--input-file", str(prompts),
           "--request-count", str(requests), "--concurrency", str(concurrency), "--use-server-token-count",
           "--export-level", "records", "--artifact-dir", str(out), "--ui-type", "none",
           *[a for k, v in inputs.items() for a in ("--extra-inputs", f"{k}:{json.dumps(v)}")]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    exports = list(out.rglob("profile_export.jsonl"))
    assert exports, f"AIPerf wrote no profile_export.jsonl under {out}: {done.stdout[-2000:]}"
    return exports[0].parent


def write_prompts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


if __name__ == "__main__":  # install ahead: python tests/support/aiperf_peer.py
    print(aiperf(), file=sys.stderr)
