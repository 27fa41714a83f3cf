"""Acceptance from the server's own log lines: `--server-log PATH` and `--log-cmd CMD`.

The fakes write each engine's real log line (tests/bench_fakes.py cites the format strings) while a
request decodes. Windowed formats print on their own schedule, so the first line of every request
also covers the end of the one before: it carries a wrong value (9.9) and must be dropped and counted.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from bench_fakes import TOKENS, LogWriter, llamacpp_app, plain_app, planted, serve, sglang_app, vllm_app

from ddscope.bench.serverlog import ServerLog
from ddscope.cli import main

# format -> (fake server, idle gap): vLLM stamps whole seconds, so its windows need more than 1 s apart.
FORMATS = {
    "sglang": (lambda log: sglang_app(generate=False, metrics=False, log=log), 0.6),
    "vllm": (lambda log: plain_app("vllm", log=log), 1.4),
    "llamacpp": (lambda log: llamacpp_app(counters=False, timings_draft=False, log=log), 0.6),
    "kv": (lambda log: plain_app(log=log), 0.6),
    "ddscope": (lambda log: plain_app(log=log), 0.6),
}
WINDOWED = {"sglang", "vllm", "kv", "ddscope"}  # formats with a straddling first line per request


def sweep(url: str, out: Path, *extra: str) -> dict[str, Any]:
    code = main(["bench", "sweep", "--url", url, "--contexts", "16,48", "--max-tokens", str(TOKENS),
                 "--repeats", "1", "--warmup", "0", "--out", str(out), *extra])
    assert code == 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_acceptance_from_server_log_lines(tmp_path, capsys, fmt):
    path = tmp_path / "server.log"
    path.write_text("[startup noise]\n")
    writer = LogWriter(path, fmt)
    make_app, gap = FORMATS[fmt]
    with serve(make_app(writer)) as url:
        doc = sweep(url, tmp_path / "out", "--server-log", str(path), "--log-gap", str(gap))
    source = doc["acceptance_source"]
    assert source["name"] == "server_log" and source["kind"] == "log"
    for r in doc["records"]:
        assert r["avg_commit"] == pytest.approx(planted(r["prompt_tokens"]), rel=0.03), r
        assert r["log_formats"] == fmt
        assert r["log_lines"] == (2 if fmt in WINDOWED else 1)
        assert r["log_straddling"] == (1 if fmt in WINDOWED else 0)
    summary = doc["server_log"]
    assert summary["formats"] == [fmt] and summary["lines_recognised"] == writer.lines
    if fmt in WINDOWED:  # probe's first line has nothing before it; the two timed requests' do
        assert summary["lines_straddling"] == 2
    printed = capsys.readouterr().out
    assert "server_log" in printed and "log lines" in printed and "straddling" in printed


@pytest.mark.skipif(shutil.which("tail") is None, reason="needs tail(1) to stand in for journalctl -f")
def test_log_cmd_follows_a_command_stdout(tmp_path):
    path = tmp_path / "server.log"
    path.touch()
    writer = LogWriter(path, "kv")
    with serve(plain_app(log=writer)) as url:
        doc = sweep(url, tmp_path / "out", "--log-cmd", f"tail -n 0 -s 0.05 -F {path}", "--log-gap", "0.6")
    assert doc["acceptance_source"]["name"] == "server_log"
    for r in doc["records"]:
        assert r["avg_commit"] == pytest.approx(planted(r["prompt_tokens"]), rel=0.03)
    assert doc["server_log"]["origin"].startswith("command: tail")


def test_no_line_in_a_window_is_null_not_a_guess(tmp_path):
    path = tmp_path / "server.log"
    path.touch()
    with serve(plain_app()) as url:  # writes no log lines at all
        doc = sweep(url, tmp_path / "out", "--server-log", str(path), "--log-gap", "0.3")
    assert doc["acceptance_source"]["name"] == "server_log"
    for r in doc["records"]:
        assert r["avg_commit"] is None and r["step_ms"] is None and r["log_lines"] == 0
        assert "no log line" in r["acceptance_note"]


def test_exact_source_wins_over_the_log(tmp_path):
    """The log ranks below exact per-request and counter sources; it is still recorded per request."""
    path = tmp_path / "server.log"
    path.touch()
    with serve(vllm_app(per_request=True, log=LogWriter(path, "vllm"))) as url:
        doc = sweep(url, tmp_path / "out", "--server-log", str(path), "--log-gap", "1.4")
    assert doc["acceptance_source"]["name"] == "vllm.response"
    assert all(r["log_avg_commit"] == pytest.approx(r["avg_commit"], rel=0.03) for r in doc["records"])


def test_window_attribution_rules(tmp_path):
    """Unit rules on explicit arrival times: a line belongs to the one window its write time and the
    interval it averages over lie in; one reaching into another window straddles."""
    path = tmp_path / "server.log"
    path.touch()
    log = ServerLog(path=path)
    try:
        first = log.window(100.0, 101.0)
        second = log.window(103.0, 104.0)
        log.add("accept_len=2.000", arrival=100.5)  # first line ever: nothing before it
        log.add("accept_len=3.000", arrival=100.9)  # since the previous line: inside the first window
        log.add("draft acceptance = 0.5 (4 accepted / 8 generated), mean len = 3.00", arrival=102.0)  # idle gap
        log.add("accept_len=9.900", arrival=103.4)  # since 100.9: reaches back into the first window
        log.add("no acceptance here", arrival=103.5)
        log.add("accept_len=5.000", arrival=103.8)
        a, b = log.read(first), log.read(second)
        assert (a.avg_commit, a.lines, a.straddling) == (pytest.approx(2.5), 2, 0)
        assert (b.avg_commit, b.lines, b.straddling) == (pytest.approx(5.0), 1, 1)
        summary = log.summary(gap_s=2.0)
        assert (summary["lines_seen"], summary["lines_recognised"]) == (6, 5)
        assert (summary["lines_used"], summary["lines_straddling"], summary["lines_outside_requests"]) == (3, 1, 1)
    finally:
        log.close()


def test_missing_log_file_is_a_clear_error(tmp_path, capsys):
    code = main(["bench", "sweep", "--url", "http://127.0.0.1:9", "--server-log", str(tmp_path / "nope.log"),
                 "--out", str(tmp_path)])
    assert code == 2
    assert "--server-log: no such file" in capsys.readouterr().err
