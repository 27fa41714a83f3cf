"""Smoke coverage of benchmarks/engine/speed.py --quick on the bundled demo pair (no timing assertions)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_speed_quick_runs_every_arm(tmp_path):
    out = tmp_path / "speed.json"
    env = {"DDSCOPE_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine" / "speed.py"), "--quick", "--threads", "1",
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
    assert {r["arm"] for r in summary if "auto_over_arm" in r} == arms - {"ddtree-auto"}
    assert "| code | 0 | 0 | ddtree-8 |" in proc.stdout.split("auto / arm")[1]


def run_benchmark(name: str, *args: str, tmp_path: Path) -> str:
    """Runs benchmarks/NAME (a path under benchmarks/, its room first) on one thread; its stdout."""
    env = {"DDSCOPE_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), "--threads", "1", *args],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_calibration_table_counts_tested_tokens(tmp_path):
    out = run_benchmark("engine/calibration.py", "--workloads", "code", "--temperatures", "0", "--prompts", "1",
                        "--max-tokens", "24", tmp_path=tmp_path)
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 0.")]
    assert rows, out
    assert sum(int(r[1]) + int(r[4]) for r in rows) > 0  # the root's children are tested every round
    for r in rows:  # shares are probabilities
        assert all(c.strip() == "-" or 0 <= float(c) <= 1 for c in (r[2], r[3], r[5], r[6]))


def test_policy_overhead_reports_both_budgets(tmp_path):
    out = run_benchmark("engine/policy_overhead.py", "--prompts", "1", "--max-tokens", "32", tmp_path=tmp_path)
    labels = {tuple(c.strip() for c in line.split("|")[1:3]) for line in out.splitlines()[2:]}
    assert {("16", "tree"), ("auto", "tree"), ("auto", "observe")} <= labels


def test_slot_confidence_reports_a_chain_and_probabilities(tmp_path):
    out = run_benchmark("drafter/slot_confidence.py", "--contexts", "13,40", "--max-tokens", "40", "--skip", "8",
                        "--stride", "4", "--feature-tail", "20", tmp_path=tmp_path)
    rows = {r[0]: r[1:] for r in ([c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
                                  if line.startswith("| ") and line[2].isdigit())}
    assert set(rows) == {"13", "40"}, out
    for chain, probs in rows.values():
        p = [float(x) for x in probs.split()]
        assert 1.0 <= float(chain) <= 16.0 and len(p) == 15 and all(0.0 <= x <= 1.0 for x in p)


def test_prefill_bench_times_every_arm(tmp_path):
    out = run_benchmark("engine/prefill.py", "--contexts", "700", "--repeats", "1", tmp_path=tmp_path)
    row = next(line for line in out.splitlines() if line.startswith("| 700 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "no" and len(cells) == 6 and all(float(c) > 0 for c in cells[2:])
