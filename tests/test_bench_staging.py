"""`bench sweep` writes a run into OUT.partial, which replaces --out only once the run is complete: a run
that fails or stops early leaves the last complete results in place. Nothing listening at --url fails
first, in one line."""
from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from ddscope.cli import main
from support.bench_fakes import TOKENS, serve, vllm_app


def sweep(url: str, out: Path) -> int:
    return main(["bench", "sweep", "--url", url, "--contexts", "16,48", "--max-tokens", str(TOKENS),
                 "--repeats", "1", "--warmup", "0", "--out", str(out), "--timeout", "5"])


def dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def earlier_run(out: Path) -> dict[str, bytes]:
    """The files a complete earlier run left, by name."""
    out.mkdir()
    files = {"results.json": b'{"status": "complete", "records": []}', "report.md": b"# the last good report\n"}
    for name, data in files.items():
        (out / name).write_bytes(data)
    return files


def test_unreachable_url_fails_first_in_one_line_and_keeps_the_last_results(tmp_path, capsys):
    out = tmp_path / "sweep"
    before = earlier_run(out)
    url = dead_url()
    assert sweep(url, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # no tokenizer warning, no progress bar, no traceback before it
    assert err[0].startswith(f"ddscope bench: error: cannot reach the server at {url}: ")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["sweep"]  # no OUT.partial left behind


def test_a_complete_sweep_replaces_the_folder_and_says_where(tmp_path, capsys):
    out = tmp_path / "sweep"
    earlier_run(out)
    (out / "server.log").write_text("an embedded server's log from the earlier run\n")
    with serve(vllm_app()) as url:
        assert sweep(url, out) == 0
    assert json.loads((out / "results.json").read_text())["status"] == "complete"
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.csv", "results.json", "sweep.png"]
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"ddscope bench: files in {out}: report.md, results.csv, results.json, sweep.png"
    assert [p.name for p in tmp_path.iterdir()] == ["sweep"]


def test_a_sweep_that_stops_early_leaves_the_last_complete_one(tmp_path, capsys, monkeypatch):
    import ddscope.bench.running.sweep as sweep_mod

    out = tmp_path / "sweep"
    with serve(vllm_app()) as url:
        assert sweep(url, out) == 0
    complete = {p.name: p.read_bytes() for p in out.iterdir()}
    real_post, dead, calls = sweep_mod.post, dead_url(), {"n": 0}

    def post(client: Any, url: str, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] >= 3:  # probe, 1 timed request, then the server is gone
            url = dead + url[url.index("/", len("http://")):]
        return real_post(client, url, *args, **kwargs)

    monkeypatch.setattr(sweep_mod, "post", post)
    with serve(vllm_app()) as url:
        assert sweep(url, out) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == complete
    partial = tmp_path / "sweep.partial"
    assert json.loads((partial / "results.json").read_text())["status"] == "aborted"
    err = capsys.readouterr().err
    assert f"its files are in {partial}; {out} keeps the last complete run" in err
    assert "ddscope bench: aborted: " in err


def test_an_out_folder_with_other_files_is_not_replaced(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine\n")
    with serve(vllm_app()) as url:
        assert sweep(url, tmp_path) == 2
    assert "holds files no bench run writes (notes.txt)" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
