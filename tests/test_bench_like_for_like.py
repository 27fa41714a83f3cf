"""`bench analyze A B` compares runs only like for like: runs that differ in output length, workload,
temperature, method, backend or model are refused unless --allow-mismatch, which warns and keeps the
warning in the report."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ddscope.cli import main

CONTEXTS = (13, 1663, 3333)
CONFIG = {"max_tokens": 128, "workload": "padding", "temperature": 0.0}
BACKEND = {"name": "ddscope", "model": "demo", "method": "ddtree"}


def results(folder: Path, label: str = "padding", commit: float = 4.0, config: dict[str, Any] = CONFIG,
            backend: dict[str, Any] = BACKEND) -> str:
    """FOLDER/results.json as a sweep writes it: its records, config and backend."""
    records = [{"label": label, "context": c, "prompt_tokens": c, "tok_per_s": 1000.0 * commit / (20 + 0.004 * c),
                "avg_commit": commit, "error": None} for c in CONTEXTS]
    folder.mkdir()
    path = folder / "results.json"
    path.write_text(json.dumps({"records": records, "config": config, "backend": backend}))
    return str(path)


def analyze(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["bench", "analyze", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("section, key, new_value, difference", [
    ("config", "max_tokens", 600, "max_tokens (128 vs 600)"),
    ("config", "temperature", 0.7, "temperature (0.0 vs 0.7)"),
    ("backend", "method", "dflash", "method (ddtree vs dflash)"),
    ("backend", "name", "sglang", "backend (ddscope vs sglang)"),
    ("backend", "model", "other", "model (demo vs other)"),
])
def test_runs_that_differ_are_refused_in_one_line(tmp_path, capsys, section, key, new_value, difference):
    old = results(tmp_path / "old")
    settings = {"config": dict(CONFIG), "backend": dict(BACKEND)}
    settings[section][key] = new_value
    new = results(tmp_path / "new", commit=6.0, **settings)
    code, out, err = analyze(capsys, old, new)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"ddscope bench: error: runs differ in {difference}: old and new are not "
                                        f"like for like (--allow-mismatch compares them anyway)"]


def test_allow_mismatch_warns_and_keeps_the_warning_in_the_report(tmp_path, capsys):
    old = results(tmp_path / "old")
    new = results(tmp_path / "new", commit=6.0, config={**CONFIG, "max_tokens": 600},
                  backend={**BACKEND, "method": "dflash"})
    report = tmp_path / "report"
    code, out, err = analyze(capsys, old, new, "--allow-mismatch", "--out", str(report))
    assert code == 0
    warning = "runs differ in max_tokens (128 vs 600), method (ddtree vs dflash): compared anyway (--allow-mismatch)"
    assert f"ddscope bench: warning: {warning}" in err
    assert f"note: WARNING: {warning}" in " ".join(out.split())
    assert f"- WARNING: {warning}" in (report / "report.md").read_text()
    code, out, _ = analyze(capsys, old, new, "--allow-mismatch", "--json")
    assert code == 0 and json.loads(out)["notes"][0].startswith(f"WARNING: {warning}")


def test_a_setting_a_file_does_not_record_is_unknown_not_a_mismatch(tmp_path, capsys):
    """An older results.json has no backend.method: the runs are compared, and the report says what was not."""
    old = results(tmp_path / "old", backend={"name": "ddscope", "model": "demo"})
    new = results(tmp_path / "new", commit=6.0)
    code, out, _ = analyze(capsys, old, new, "--json")
    assert code == 0
    assert "old does not record method: not compared with the other runs" in json.loads(out)["notes"]


def test_a_workload_beside_padding_is_what_diagnose_compares(tmp_path, capsys):
    """Different workloads on different curves (padding, code) are the comparison itself; the same curve
    from two workload files of one name is not like for like."""
    padding = results(tmp_path / "padding")
    code_run = results(tmp_path / "code", label="code", commit=3.0, config={**CONFIG, "workload": "code"})
    assert main(["bench", "diagnose", "--load", padding, code_run, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["baseline"] == "padding"
    first = results(tmp_path / "a", label="file:p.jsonl", config={**CONFIG, "workload": "file:a/p.jsonl"})
    second = results(tmp_path / "b", label="file:p.jsonl", config={**CONFIG, "workload": "file:b/p.jsonl"})
    code, _, err = analyze(capsys, first, second)
    assert code == 2 and "runs differ in workload (file:a/p.jsonl vs file:b/p.jsonl)" in err
