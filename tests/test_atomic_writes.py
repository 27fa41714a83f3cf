"""Files on disk are written whole or not at all: two writers never share a temp file, a writer killed
mid-write leaves the previous file, and dropping a torn record line never rewrites the records before it."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddscope.bench.running.sweep import ResultsWriter
from ddscope.models.drafter_ckpt import save_drafter
from ddscope.training.distill import append_whole_lines


class Killed(BaseException):
    """Stands for a kill mid-write: a BaseException, so no `except Exception` lets the writer carry on."""


def kill_at_first_write(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """The first open for writing of a file in `folder` truncates it, then the writer dies."""
    real_open = io.open

    def open_(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if "w" in mode and isinstance(file, str | os.PathLike) and Path(file).parent == folder:
            monkeypatch.setattr(io, "open", real_open)
            real_open(file, mode).close()
            raise Killed
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", open_)


def test_two_results_writers_interleaved_both_finish_and_leave_one_whole_file(tmp_path, monkeypatch):
    first, second = ResultsWriter(tmp_path, {"run": "first"}), ResultsWriter(tmp_path, {"run": "second"})
    real_replace, interleaved = os.replace, []

    def replace(src, dst) -> None:
        if not interleaved:  # the second writer flushes whole between the first's write and its rename
            interleaved.append(src)
            second.add({"label": "b"})
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    first.add({"label": "a"})  # a shared temp name: the second writer renamed it away first
    assert interleaved
    doc = json.loads((tmp_path / "results.json").read_text())  # the first writer's rename came last
    assert (doc["run"], doc["records"]) == ("first", [{"label": "a"}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv", "results.json"]


def test_a_writer_killed_mid_write_leaves_the_previous_file(tmp_path, monkeypatch):
    state = {"fc.weight": torch.zeros(2, 2)}
    save_drafter(tmp_path, {"version": 1}, state)
    kill_at_first_write(monkeypatch, tmp_path)
    with pytest.raises(Killed):
        save_drafter(tmp_path, {"version": 2}, state)
    assert json.loads((tmp_path / "config.json").read_text()) == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def records_file(path: Path, records: list[dict[str, int]], torn: str) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)


def test_a_torn_last_line_is_dropped_and_the_records_before_it_kept(tmp_path):
    path, records = tmp_path / "distill.0.jsonl", [{"i": 0}, {"i": 1}]
    records_file(path, records, torn='{"i": 2, "tok')
    with append_whole_lines(path) as f:
        f.write(json.dumps({"i": 3}) + "\n")
    assert [json.loads(line) for line in path.read_text().splitlines()] == [*records, {"i": 3}]


def test_dropping_a_torn_line_killed_midway_keeps_the_records(tmp_path, monkeypatch):
    path, records = tmp_path / "distill.0.jsonl", [{"i": 0}, {"i": 1}]
    records_file(path, records, torn='{"i": 2, "tok')
    kill_at_first_write(monkeypatch, tmp_path)  # a rewrite of the file would die right after truncating it
    append_whole_lines(path).close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == records


def killed_inside_replacing(path: Path) -> None:
    """A writer in a child process that dies (os._exit: no cleanup) inside `replacing(path)`."""
    code = ("import os, sys; from pathlib import Path; from ddscope.util.atomic import replacing\n"
            "with replacing(Path(sys.argv[1])) as tmp:\n    tmp.write_text('half'); os._exit(9)")
    subprocess.run([sys.executable, "-c", code, str(path)], check=False)


def test_a_temp_file_a_killed_bench_writer_left_does_not_block_the_next_run(tmp_path):
    # the --out check: it refuses folders holding files of the user's
    from ddscope.bench.running.run_folder import foreign_files

    (tmp_path / "results.json").write_text("{}")
    killed_inside_replacing(tmp_path / "results.json")
    assert len(list(tmp_path.iterdir())) == 2  # the killed writer's temp file stayed
    assert foreign_files(tmp_path) == []
