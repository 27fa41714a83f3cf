"""Smoke coverage of benchmarks/speed.py --quick on the bundled demo pair (no timing assertions)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_speed_quick_runs_every_arm(tmp_path):
    out = tmp_path / "speed.json"
    env = {"DDSCOPE_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speed.py"), "--quick", "--threads", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    arms = {r["arm"] for r in summary}
    assert arms == {"hf", "hf-lookup", "ar", "dflash", "ddtree-8", "ddtree-32", "ddtree-auto"}
    for row in summary:
        assert row["tok_per_s"] > 0 and row["speedup_vs_hf"] > 0
        if row["arm"] not in ("hf", "hf-lookup"):
            assert row["tau"] >= 1.0 and row["step_ms"] > 0 and 0 <= row["overhead_ms"] < row["step_ms"]
    assert "| ddtree-auto |" in proc.stdout
