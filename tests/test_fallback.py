"""The path a machine without a C compiler runs (and `DDSCOPE_NATIVE=0` forces): torch's ops for everything, in fp32
(bf16 is refused there: tests/test_isas.py). The lossless
tests run on it in a process of their own (the kernels are chosen when the library loads), greedy and seeded,
with and without a grammar."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_the_fallback_path_is_lossless():
    env = {**os.environ, "DDSCOPE_NATIVE": "0"}
    probe = subprocess.run([sys.executable, "-c", "from ddscope.models import native; print(native.library())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and probe.stdout.strip() == "None", probe.stderr  # no kernel in that process
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                           "greedy_equals_ar or greedy_under_a_grammar or seeded",
                           str(TESTS / "test_lossless.py"), str(TESTS / "test_grammar.py")],
                          env=env, capture_output=True, text=True, timeout=900, cwd=TESTS.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
