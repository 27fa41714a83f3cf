"""`bench sweep`, `diagnose` and `trace` as runs: the arguments checked before any server starts, the run staged
in OUT.partial (`run_folder.py`) against one server (`server.py`), a progress bar, and the rows handed to
judging (`bench/judging/judge.py`, `trace_report.py`) once the run is done.

The defaults are the issue's experiment. On the embedded demo pair (a 2-core CPU) the output is shorter, so the
main job ends in about two minutes; contexts that do not fit max_model_len shrink to fit."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Self

from ddscope.bench.errors import BenchError, Stopped, warn
from ddscope.bench.running.run_folder import folder_name, staged
from ddscope.bench.running.server import on_server, tokenizer_for
from ddscope.util.options import int_list

CONTEXTS = "13,1663,3333,5553"
URL_MAX_TOKENS = 600
EMBEDDED_MAX_TOKENS = 128
TRACE_URL_MAX_TOKENS, TRACE_EMBEDDED_MAX_TOKENS = 4096, 1024


def run_sweep(args: argparse.Namespace) -> int:
    """Sweep, then the table, sweep.png and report.md, which replace --out once complete; exit 1 when no
    point was measured or the sweep stopped early (its files then stay in OUT.partial)."""
    from ddscope.bench.judging.judge import judge_files

    _check_sweep_args(args)
    workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    with staged(args.out) as stage:  # several workloads: one sweep each, in OUT/<workload>, reported together
        dirs = [stage] if len(workloads) == 1 else [stage / folder_name(w, i) for i, w in enumerate(workloads)]
        paths, stopped = _run_sweeps(args, stage, workloads, dirs)
        baseline = "padding" if "padding" in workloads else None
        code = judge_files(paths, stage, baseline, args.window, as_json=False, floor=args.floor)
        if stopped:
            raise Stopped(stopped)
    return code


def run_diagnose(args: argparse.Namespace) -> int:
    """The padding sweep and a workload sweep on one server (or two earlier results files), then the attribution
    report."""
    from ddscope.bench.judging.judge import judge_files

    if args.load:  # the report beside the files, which may lie in --out: nothing there is replaced
        return judge_files(list(args.load), args.out, "padding", args.window, args.json,
                           allow_mismatch=args.allow_mismatch, floor=args.floor)
    _check_sweep_args(args)
    if args.workload == "padding":
        raise BenchError("diagnose compares a workload with padding: pick --workload code|math|chat|file:PATH")
    label = args.workload.split(":", 1)[0]
    with staged(args.out) as stage:
        paths, stopped = _run_sweeps(args, stage, ["padding", args.workload], [stage / "padding", stage / label])
        if stopped:
            raise Stopped(stopped)
        return judge_files(paths, stage, "padding", args.window, args.json, floor=args.floor)


def run_trace(args: argparse.Namespace) -> int:
    """Trace, then report.md and trace.png; exit 1 when a stream was dropped (the partial trace stays in
    OUT.partial, marked)."""
    from ddscope.bench.judging.judge import judge_trace
    from ddscope.bench.running.workloads import load_workload

    if args.against is not None and not args.against.is_file():
        raise BenchError(f"--against: file not found: {args.against}")
    workloads = [load_workload(w.strip()) for w in args.workload.split(",") if w.strip()]
    args.contexts, args.clamp_contexts = [args.prompt_tokens], False
    if args.max_tokens is None:
        args.max_tokens = TRACE_EMBEDDED_MAX_TOKENS if not args.url else TRACE_URL_MAX_TOKENS
    with staged(args.out) as stage:
        doc = on_server(args, stage, lambda url, client, _: _trace(args, workloads, stage, url, client))
        return judge_trace(doc, stage, args.against, args.floor, args.json)


def _check_sweep_args(args: argparse.Namespace) -> None:
    from ddscope.bench.running.workloads import load_workload

    if args.url and (args.target or args.drafter):
        raise BenchError("--target/--drafter start an embedded server; they cannot be combined with --url")
    if args.drafter and not args.target:
        raise BenchError("--drafter needs --target (without both, the bundled demo pair is served)")
    for flag, path in (("--tokenizer", args.tokenizer), ("--target", args.target), ("--drafter", args.drafter)):
        if path is not None and not Path(path).is_dir():
            raise BenchError(f"{flag}: no such directory: {path}")
    for workload in args.workload.split(","):  # fail now, with its message, rather than after the server starts
        load_workload(workload.strip())
    embedded = not args.url
    args.clamp_contexts = args.contexts is None
    if args.contexts is None:
        args.contexts = int_list(CONTEXTS)
    if args.max_tokens is None:
        args.max_tokens = EMBEDDED_MAX_TOKENS if embedded else URL_MAX_TOKENS


def _run_sweeps(args: argparse.Namespace, root: Path, workloads: list[str],
                dirs: list[Path]) -> tuple[list[Path], str | None]:
    """Run one sweep per workload on one server: (the results.json paths, why a sweep stopped early, ending the
    run, or None)."""
    return on_server(args, root, lambda url, client, log: _sweep_each(args, workloads, dirs, url, client, log))


def _sweep_each(args: argparse.Namespace, workloads: list[str], dirs: list[Path], base_url: str, client: Any,
                log: Any) -> tuple[list[Path], str | None]:
    from ddscope.bench.running.sweep import RequestFailed, Sweep, SweepConfig

    tokenizer, origin = tokenizer_for(args, base_url, client)
    if tokenizer is None:
        warn("no tokenizer for exact prompt lengths (the server has no /tokenize and /v1/models names no "
             "local model directory): prompts are sized from a probe, so lengths will be off; the rows "
             "show the lengths the server counted. Pass --tokenizer DIR for exact ones.")
    paths = []
    for workload, out in zip(workloads, dirs):
        cfg = SweepConfig(contexts=args.contexts, max_tokens=args.max_tokens, repeats=args.repeats,
                          warmup=args.warmup, first_prompt=args.first_prompt, workload=workload, api=args.api,
                          temperature=args.temperature, stream=args.stream, model=args.model, backend=args.backend,
                          timeout_s=args.timeout,
                          clamp_contexts=args.clamp_contexts, log_gap_s=args.log_gap, concurrency=args.concurrency,
                          floor=args.floor.to_dict() if args.floor else None, budget=args.budget)
        sweep = Sweep(cfg, base_url, client, tokenizer, log, origin)
        total = len(cfg.contexts) * (cfg.repeats * (1 in cfg.concurrency) + cfg.warmup
                                     + sum(cfg.group_size(c) for c in cfg.levels))
        try:
            with _Progress(total, f"{sweep.workload.label} on {sweep.backend}") as bar:
                status = sweep.run(out, bar.advance)
        except RequestFailed as e:
            raise BenchError(f"{base_url}: {e}") from e
        paths.append(out / "results.json")
        if status != "complete":
            why = f"{base_url}: {sweep.lost}" if sweep.lost else status
            return paths, f"{why}; the {sweep.workload.label} sweep stopped early"
    return paths, None


def _trace(args: argparse.Namespace, workloads: list[Any], stage: Path, base_url: str, client: Any) -> dict:
    from ddscope.bench.running import trace
    from ddscope.bench.running.sweep import Sweep, SweepConfig

    tokenizer, origin = tokenizer_for(args, base_url, client)
    cfg = SweepConfig(contexts=[args.prompt_tokens], max_tokens=args.max_tokens, workload=workloads[0].label
                      if not workloads[0].label.startswith("file:") else args.workload.split(",")[0],
                      temperature=args.temperature, stream=True, model=args.model, backend=args.backend,
                      timeout_s=args.timeout, budget=args.budget)
    sweep = Sweep(cfg, base_url, client, tokenizer, None, origin)
    header = {k: v for k, v in sweep.header().items() if k in ("environment", "backend")}
    run_cfg = {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "repeats": args.repeats,
               "first_prompt": args.first_prompt, "timeout_s": args.timeout, "temperature": args.temperature,
               "workloads": [w.label for w in workloads], "floor": args.floor.to_dict() if args.floor else None,
               "concurrency": list(args.concurrency)}
    total = len(workloads) * (args.repeats + sum(c for c in args.concurrency if c > 1))
    with _Progress(total, f"trace on {sweep.backend}") as bar:
        return trace.run(sweep, workloads, run_cfg, stage, header, bar.advance)


class _Progress:
    """A rich progress bar on stderr; `advance(note)` after each request."""

    def __init__(self, total: int, title: str):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        # No refresh thread: nothing in the client's process competes with the server for a core.
        self.bar = Progress(TextColumn(title), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.description}"), console=Console(stderr=True), auto_refresh=False)
        self.task = self.bar.add_task("", total=total)

    def __enter__(self) -> Self:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def advance(self, note: str) -> None:
        self.bar.update(self.task, advance=1, description=note)
        self.bar.refresh()
