"""Run folders: a run staged beside its --out and swapped in whole, and runs read back side by side (tagged,
overlaid, merged, refused unless like for like)."""
from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ddscope.bench.limit.cli import FloorRequest
from ddscope.util.atomic import replaced_name


class BenchError(Exception):
    """A bad flag or unusable input: printed as one line, exit code 2."""


class Stopped(BenchError):
    """A sweep that stopped early (the server lost, Ctrl-C): printed as one line, exit code 1."""


def warn(message: str) -> None:
    print(f"ddscope bench: warning: {message}", file=sys.stderr)


def folder_name(workload: str, index: int) -> str:
    """A sweep's folder in a run of several workloads: its name, or file-N for a file's prompts."""
    return f"file-{index}" if workload.startswith("file:") else workload


def merge_aiperf(loaded: list[tuple[list[dict[str, Any]], dict[str, Any]]],
                  tags: list[str]) -> tuple[list[tuple[list[dict[str, Any]], dict[str, Any]]], list[str]]:
    """AIPerf runs, one per prompt length, as one sweep: their rows together under the first one's setup."""
    runs = [i for i, (_, meta) in enumerate(loaded) if (meta.get("backend") or {}).get("name") == "aiperf"]
    if len(runs) < 2:
        return loaded, tags
    rows = [row for i in runs for row in loaded[i][0]]
    errors: dict[str, int] = {}
    for i in runs:
        for msg, n in (loaded[i][1].get("errors") or {}).items():
            errors[msg] = errors.get(msg, 0) + n
    merged = (rows, {**loaded[runs[0]][1], "errors": errors})
    keep = [i for i in range(len(loaded)) if i not in runs[1:]]
    return [merged if i == runs[0] else loaded[i] for i in keep], ["aiperf" if i == runs[0] else tags[i] for i in keep]


def kept_floor(meta: dict[str, Any]) -> FloorRequest | None:
    """The floor options a run kept in its results (None where it kept none, or a shape this version cannot read)."""
    kept = (meta.get("config") or {}).get("floor")
    try:
        return FloorRequest(**kept) if isinstance(kept, dict) else None
    except TypeError:
        return None


def like_for_like(loaded: list[tuple[list[dict[str, Any]], dict[str, Any]]], tags: list[str],
                   allow_mismatch: bool) -> list[str]:
    """Refuse files whose runs differ in a setting that moves tok/s or acceptance by itself, unless allowed
    (then a warning, kept as the report's first note); and notes on the settings a file does not record."""
    from ddscope.bench.likeforlike import run_differences

    if len(loaded) < 2:
        return []
    differ, unknown = run_differences([(tag, meta, {row["label"] for row in rows})
                                       for (rows, meta), tag in zip(loaded, tags)])
    if not differ:
        return unknown
    what = f"runs differ in {', '.join(differ)}"
    if not allow_mismatch:
        raise BenchError(f"{what}: {' and '.join(tags)} are not like for like (--allow-mismatch compares them "
                         f"anyway)")
    warning = f"{what}: compared anyway (--allow-mismatch), so a gap between them is not like for like"
    warn(warning)
    return [f"WARNING: {warning}", *unknown]


def overlaid(loaded: list[tuple[list[dict[str, Any]], dict[str, Any]]]) -> bool:
    """Several files that share a workload label: runs to overlay (e.g. old and new drafter)."""
    seen: set[str] = set()
    for rows, _ in loaded:
        labels = {r["label"] for r in rows}
        if labels & seen:
            return True
        seen |= labels
    return False


def overlay(loaded: list[tuple[list[dict[str, Any]], dict[str, Any]]], tags: list[str],
             baseline: str | None) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """Label each file's rows `label [tag]`; returns the baseline as a tagged label (default: the
    first file's first curve) and each file's acceptance and tok/s setup by tag."""
    for (rows, _), tag in zip(loaded, tags):
        for row in rows:
            row["label"] = f"{row['label']} [{tag}]"
    labels = {row["label"] for rows, _ in loaded for row in rows}
    if baseline is None:
        baseline = next((row["label"] for row in loaded[0][0]), None)
    elif baseline not in labels:  # untagged ("padding"): the first file's curve of that name
        baseline = next((f"{baseline} [{t}]" for t in tags if f"{baseline} [{t}]" in labels), baseline)
    runs = {tag: {k: meta.get(k) for k in ("acceptance_source", "acceptance_refused", "tok_per_s")}
            for (_, meta), tag in zip(loaded, tags)}
    return baseline, runs


def tags_of(paths: list[Path]) -> list[str]:
    """A short distinct name per file: its folder (old/results.json -> old), else its path."""
    names = [p.resolve().parent.name or p.stem for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


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
