"""A run's folder: staged beside its --out as OUT.partial and swapped in whole once the run completes, so a run
that fails or stops early leaves the last complete one in place; never a folder that holds the user's files."""
from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddscope.bench.errors import BenchError
from ddscope.util.atomic import replaced_name


def folder_name(workload: str, index: int) -> str:
    """A sweep's folder in a run of several workloads: its name, or file-N for a file's prompts."""
    return f"file-{index}" if workload.startswith("file:") else workload


OUTPUTS = ("results.json", "results.csv", "sweep.png", "trace.png", "report.md", "server.log")


def foreign_files(folder: Path, depth: int = 1) -> list[str]:
    """What in `folder` no bench run writes: anything but OUTPUTS (and their temp files) and, `depth`
    levels down, folders of them (diagnose's sweeps)."""
    if not folder.is_dir():
        return [folder.name] if folder.exists() else []
    return [entry.name for entry in sorted(folder.iterdir())
            if not (entry.is_file() and (replaced_name(entry.name) or entry.name) in OUTPUTS
                    or depth and entry.is_dir() and not foreign_files(entry, depth - 1))]


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A folder beside `out`, OUT.partial, to write a run into. It replaces `out` when the block ends
    without an exception, so a run that fails or stops early leaves the last complete one in place,
    and its own files in OUT.partial."""
    out = out.resolve()
    stage = out.with_name(f"{out.name}.partial")
    for folder in (out, stage):  # both are replaced: never one that holds files of the user's
        if foreign := foreign_files(folder):
            raise BenchError(f"{folder} holds files no bench run writes ({', '.join(foreign[:5])}): it would be "
                             "replaced; pick another --out")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        yield stage
    except BaseException:
        if any(stage.iterdir()):
            kept = f"; {out} keeps the last complete run" if out.is_dir() and any(out.iterdir()) else ""
            print(f"ddscope bench: the run did not complete: its files are in {stage}{kept}", file=sys.stderr)
        else:
            stage.rmdir()
        raise
    shutil.rmtree(out, ignore_errors=True)
    stage.rename(out)
    names = ", ".join(e.name + "/" * e.is_dir() for e in sorted(out.iterdir()))
    print(f"ddscope bench: files in {out}: {names}", file=sys.stderr)
