"""Acceptance from the server's own log lines: `--server-log PATH` and `--log-cmd CMD`.

The fakes write each engine's real log line (tests/support/bench_fakes.py cites the format strings) while a
request decodes. Windowed formats print on their own schedule, so the first line of every request
also covers the end of the one before: it carries a wrong value (9.9) and must be dropped and counted.
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ddscope.bench.collecting.server_log import END_SLACK_S, POLL_S, ServerLog
from ddscope.bench.judging.sweep_report import setup_lines
from ddscope.cli import main
from support.bench_fakes import TOKENS, LogWriter, llamacpp_app, plain_app, planted, serve, sglang_app, vllm_app

# format -> (fake server, idle gap): vLLM stamps whole seconds, so its windows need more than 1 s apart.
FORMATS = {
    "sglang": (lambda log: sglang_app(sglext=False, generate=False, metrics=False, log=log), 0.6),
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
    assert all(r["log_avg_commit"] == pytest.approx(r["server_avg_commit"], rel=0.03) for r in doc["records"])


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


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_file_follower_reopens_after_rotation_and_truncation(tmp_path):
    """Rotation (rename, then a new file larger than the old position: only the inode tells) and
    truncation (same inode, smaller): both are followed from the new start, and the old file's
    unfinished last line is dropped rather than glued to the new first line."""
    path = tmp_path / "server.log"
    path.touch()
    log = ServerLog(path=path)

    def append(text: str) -> None:
        with path.open("a") as f:
            f.write(text)

    values = lambda: [ln.avg_commit for ln in log.lines]  # noqa: E731
    try:
        for _ in range(100):  # the follower starts at the file's end: sync on a line it reads
            append("noise\n")
            if wait_for(lambda: log.seen > 0, timeout_s=0.1):
                break
        append("accept_len=1.0\naccept_len=7")  # unfinished: the server is mid-write
        assert wait_for(lambda: values() == [1.0])
        time.sleep(4 * POLL_S)
        path.rename(tmp_path / "server.log.1")
        path.write_text("x" * 2000 + "\naccept_len=2.0\n")
        assert wait_for(lambda: len(values()) == 2) and values() == [1.0, 2.0]
        append("accept_len=8")
        time.sleep(4 * POLL_S)
        path.write_text("accept_len=3.0\n")  # copytruncate: same file, shorter
        assert wait_for(lambda: len(values()) == 3) and values() == [1.0, 2.0, 3.0]
    finally:
        log.close()


@pytest.mark.parametrize("gap", ["0.25", "0.1"])
def test_log_gap_must_exceed_the_window_slack(tmp_path, capsys, gap):
    path = tmp_path / "server.log"
    path.touch()
    with pytest.raises(SystemExit) as exc:
        main(["bench", "sweep", "--url", "http://127.0.0.1:9", "--server-log", str(path), "--log-gap", gap])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--log-gap: must be in ({END_SLACK_S:g}, 600]" in err


def test_header_warns_when_the_gap_is_within_the_timestamp_resolution(tmp_path):
    """Whole-second timestamps stretch a line over [t, t + 1): with a gap under slack + 1 s, windows
    can share a line, so the setup header says so."""
    path = tmp_path / "server.log"
    path.touch()
    log = ServerLog(path=path)
    try:
        log.window(1e9 - 1.0, 1e9 + 1.0)
        log.add("2001-09-09T01:46:40Z accept_len=3.0", arrival=1e9 + 0.5)  # unix 1e9, 1 s resolution
    finally:
        log.close()
    short, enough = log.summary(gap_s=0.6), log.summary(gap_s=1.4)
    assert short["min_gap_s"] == pytest.approx(END_SLACK_S + 1.0)
    assert any("warning: --log-gap 0.6 s" in line for line in setup_lines({"server_log": short}))
    assert not any("warning" in line for line in setup_lines({"server_log": enough}))


def _log(tmp_path: Path) -> ServerLog:
    path = tmp_path / "server.log"
    path.touch()
    return ServerLog(path=path)


def test_vllm_lines_weigh_by_their_draft_count(tmp_path):
    """'mean 1.00 / 100 drafts' and 'mean 4.00 / 100 drafts' average to 2.5, whatever the rounding."""
    def line(accepted: int, drafted: int) -> str:
        mean = 1 + accepted / (drafted / 3)
        return (f"(APIServer pid=7) INFO 12-01 10:00:00 [metrics.py:120] SpecDecoding metrics: Mean acceptance "
                f"length: {mean:.2f}, Accepted throughput: 1.00 tokens/s, Drafted throughput: 3.00 tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance rate: 0.500, "
                f"0.400, 0.300, Avg Draft acceptance rate: 10.0%")
    log = _log(tmp_path)
    try:
        log.window(90.0, 95.0)  # an earlier request: a line with nothing known before it reaches into it
        window = log.window(100.0, 110.0)
        log.add(line(0, 300), arrival=101.0)   # the first line: straddles
        log.add(line(0, 300), arrival=102.0)   # 100 drafts, nothing accepted
        log.add(line(300, 300), arrival=103.0)  # 100 drafts, 3 accepted each
        assert log.read(window).avg_commit == pytest.approx(2.5)
    finally:
        log.close()


def test_ansi_colour_and_ranks(tmp_path):
    """Colour codes do not hide the timestamp; each rank chains its own lines."""
    log = _log(tmp_path)
    try:
        log.window(190.0, 195.0)
        window = log.window(200.0, 210.0)
        for at, rank, avg in ((201, "TP0", 2.0), (201, "TP1", 4.0), (202, "TP0", 3.0), (202, "TP1", 5.0)):
            when = datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S")
            log.add(f"\x1b[32m[{when} {rank}]\x1b[0m Decode batch, #running-req: 1, accept len: {avg:.2f}, "
                    f"accept rate: 0.50", arrival=at + 0.5)
        got = log.read(window)
        # the first line of each rank has nothing before it; the second of each covers only its own rank's second
        assert (got.avg_commit, got.lines) == (pytest.approx(4.0), 2)
    finally:
        log.close()


@pytest.mark.skipif(shutil.which("tail") is None, reason="needs tail(1)")
def test_sglang_default_format_on_stderr_end_to_end(tmp_path):
    """SGLang's default line (no ms, no TP suffix), read from a command that writes it to stderr."""
    path = tmp_path / "server.log"
    path.touch()
    writer = LogWriter(path, "sglang_default", interval_s=0.5)
    with serve(sglang_app(sglext=False, generate=False, metrics=False, log=writer)) as url:
        doc = sweep(url, tmp_path / "out", "--log-cmd", f"tail -n 0 -s 0.05 -F {path} 1>&2", "--log-gap", "1.4")
    assert doc["acceptance_source"]["name"] == "server_log"
    for r in doc["records"]:
        assert r["avg_commit"] == pytest.approx(planted(r["prompt_tokens"]), rel=0.03), r
        assert r["log_formats"] == "sglang"


def test_colour_codes_do_not_hide_vllms_timestamp():
    from ddscope.bench.collecting.server_log import parse_line

    now = time.time()
    stamp = datetime.fromtimestamp(now).strftime("%m-%d %H:%M:%S")
    line = (f"(APIServer pid=7) \x1b[32mINFO\x1b[0m \x1b[2m{stamp}\x1b[0m [metrics.py:120] SpecDecoding metrics: "
            f"Mean acceptance length: 2.00, Accepted throughput: 1.00 tokens/s, Drafted throughput: 3.00 tokens/s, "
            f"Accepted: 10 tokens, Drafted: 30 tokens, Per-position acceptance rate: 0.5, 0.3, 0.2, Avg Draft "
            f"acceptance rate: 33.3%")
    got = parse_line(line, arrival=now + 5)  # arrived 5 s late: only its own timestamp places it
    assert got is not None and got.hi - got.lo == 1.0 and abs(got.lo - int(now)) <= 1
