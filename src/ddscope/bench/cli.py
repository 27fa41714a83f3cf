"""`ddscope bench sweep|analyze|diagnose`. Heavy imports stay inside the handlers."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from ddscope.bench.limit.cli import FloorRequest, add_floor_args
from ddscope.bench.limit.cli import register as register_limit
from ddscope.bench.runs import (BenchError, Stopped, folder_name, kept_floor, like_for_like, merge_aiperf, overlaid,
                                overlay, staged, tags_of, warn)
from ddscope.bench.serverlog import END_SLACK_S
from ddscope.util.options import add_model_args, at_least, budget_arg, int_list, number_in, stdout_console

# The experiment. On the embedded demo pair (a 2-core CPU) the output is shorter, so the
# main job ends in about two minutes; contexts that do not fit max_model_len shrink to fit.
CONTEXTS = "13,1663,3333,5553"
URL_MAX_TOKENS = 600
EMBEDDED_MAX_TOKENS = 128
SWEEP_BUDGET = 32  # the experiment's tree size: fixed, so that only the context moves
BACKEND_CHOICES = ("auto", "ddscope", "sglang", "vllm", "llamacpp", "openai")


MAX_CONCURRENCY = 256


def _levels(text: str) -> tuple[int, ...]:
    """Concurrency levels: distinct integers in [1, MAX_CONCURRENCY], ascending."""
    values = int_list(text)
    if max(values) > MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"concurrency above {MAX_CONCURRENCY}: {text!r}")
    return tuple(sorted(set(values)))


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    """--url and what it serves, or the embedded server's model and method."""
    g = p.add_argument_group("server")
    g.add_argument("--url", help="an OpenAI-compatible server (ddscope, SGLang, vLLM, llama.cpp); without it an "
                                 "embedded ddscope server is started on 127.0.0.1")
    g.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    g.add_argument("--api", choices=("completions", "chat"), default="completions", help="(default: %(default)s)")
    g.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="skip auto-detection (default: %(default)s)")
    g.add_argument("--tokenizer", type=Path, help="HF tokenizer dir for exact token-id prompts (default: the "
                                                  "server's /tokenize, else the model directory /v1/models names, "
                                                  "else sized from a probe, with a warning; embedded: the target's)")
    e = p.add_argument_group("embedded server (without --url)")
    add_model_args(e)
    e.add_argument("--method", choices=("ddtree", "dflash", "ar"), default="ddtree", help="(default: %(default)s)")
    e.add_argument("--budget", type=budget_arg, default=SWEEP_BUDGET,
                   help="DDTree node budget, held fixed at every context and sent with each request to a ddscope "
                        "server (--url too); auto lets the tree size move with context, a second variable beside "
                        "the one under test (default: %(default)s)")


def _add_sweep_flags(p: argparse.ArgumentParser, workload_default: str) -> None:
    _add_server_flags(p)
    s = p.add_argument_group("sweep")
    s.add_argument("--contexts", type=int_list,
                   help=f"prompt lengths in tokens (default {CONTEXTS}, shrunk to fit the server's max_model_len)")
    s.add_argument("--max-tokens", type=at_least(1),
                   help=f"fixed output length, ignore_eos (default {URL_MAX_TOKENS} with --url; "
                        f"{EMBEDDED_MAX_TOKENS} on the embedded server, so the sweep ends in minutes on a 2-core CPU)")
    s.add_argument("--repeats", type=at_least(1), default=3, help="timed requests per context (default: %(default)s)")
    s.add_argument("--concurrency", type=_levels, default=(1,), metavar="N[,N...]",
                   help="requests in flight at a time, e.g. 1,4,8,16: each level above 1 sends max(repeats, N) "
                        "new prompts per context, N at a time, and records their aggregate tok/s and TTFT "
                        "(default: 1, one after another)")
    s.add_argument("--warmup", type=at_least(0), default=1, help="untimed requests per context (default: %(default)s)")
    s.add_argument("--first-prompt", type=at_least(0), default=0,
                   help="the workload's prompt index of the first timed request; later ones follow it, one per "
                        "request (warm-ups take theirs from the set's end), so sweeps with different values send "
                        "different real prompts (default: %(default)s)")
    s.add_argument("--workload", default=workload_default,
                   help="padding|code|math|chat|reasoning|file:PATH (default: %(default)s)")
    s.add_argument("--temperature", type=number_in(0.0, 2.0), default=0.0, help="(default: %(default)s)")
    s.add_argument("--stream", action="store_true", help="stream (SSE) instead of one non-streaming response")
    s.add_argument("--timeout", type=number_in(0.0, 86400.0, low_open=True), default=600.0,
                   help="per-request timeout in seconds (default: %(default)s)")
    s.add_argument("--window", type=at_least(1), default=32,
                   help="generated tokens per window for acceptance against position (default: %(default)s)")
    lg = p.add_argument_group("server log (acceptance from the server's own log lines)")
    src = lg.add_mutually_exclusive_group()
    src.add_argument("--server-log", type=Path, metavar="PATH", help="a log file the server appends to")
    src.add_argument("--log-cmd", metavar="CMD",
                     help='a command whose stdout is the log stream, e.g. "journalctl -u sglang -f -n 0 -o '
                          'short-iso" (-n 0: no replay of old lines)')
    # Each window is extended by END_SLACK_S for trailing output: a gap at or below it makes windows touch.
    lg.add_argument("--log-gap", type=number_in(END_SLACK_S, 600.0, low_open=True), default=2.0, metavar="S",
                    help=f"idle seconds after each request so log lines never straddle two; above {END_SLACK_S:g} "
                         f"plus the log's timestamp resolution (1 s for vLLM, SGLang without ms) (default: 2)")


TRACE_URL_MAX_TOKENS, TRACE_EMBEDDED_MAX_TOKENS = 4096, 1024


def _add_trace_flags(p: argparse.ArgumentParser) -> None:
    _add_server_flags(p)
    t = p.add_argument_group("trace")
    t.add_argument("--workload", default="padding",
                   help="one or several, comma-separated: padding|code|math|chat|reasoning|file:PATH (default: "
                        "%(default)s)")
    t.add_argument("--prompt-tokens", type=at_least(1), default=64, help="prompt length (default: %(default)s)")
    t.add_argument("--max-tokens", type=at_least(2),
                   help=f"tokens to generate, ignore_eos (default {TRACE_URL_MAX_TOKENS} with --url, "
                        f"{TRACE_EMBEDDED_MAX_TOKENS} on the embedded server)")
    t.add_argument("--repeats", type=at_least(1), default=3, help="generations per workload (default: %(default)s)")
    t.add_argument("--concurrency", type=_levels, default=(1,), metavar="N[,N...]",
                   help="streams traced at once, e.g. 1,4: each level above 1 traces N generations together (each "
                        "its own steps, their steps together checked against the server's counters) after the "
                        "repeats alone, so the step along a generation is compared alone and under load "
                        "(default: 1)")
    t.add_argument("--first-prompt", type=at_least(0), default=0, help="the workload's first prompt index (default: 0)")
    t.add_argument("--temperature", type=number_in(0.0, 2.0), default=0.0, help="(default: %(default)s)")
    t.add_argument("--timeout", type=number_in(0.0, 86400.0, low_open=True), default=1800.0,
                   help="per-request timeout in seconds (default: %(default)s)")
    t.add_argument("--against", type=Path, metavar="SWEEP_RESULTS",
                   help="a prompt sweep's results.json on the same server: its step-time line is set against the "
                        "generation's")
    p.add_argument("--json", action="store_true", help="print the trace's summary as JSON")
    p.add_argument("--out", type=Path, default=Path("bench-out/trace"),
                   help="output folder, replaced once the trace is complete (else OUT.partial) (default: %(default)s)")


def register(subparsers: Any) -> None:
    """Add `bench` with `sweep`, `analyze`, `diagnose` and `limit` to the top-level ddscope parser."""
    bench = subparsers.add_parser("bench", help="context sweep, throughput decomposition and attribution")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    sweep = sub.add_parser("sweep", help="sweep prompt length at a fixed output length",
                           description="Sweep prompt length at a fixed output length and decompose "
                                       "tok/s = avg_commit / step_time. Writes results.json, results.csv, "
                                       "sweep.png and report.md to --out.")
    _add_sweep_flags(sweep, "padding")
    add_floor_args(sweep, ("--model-config",), dtype=False)
    sweep.add_argument("--out", type=Path, default=Path("bench-out/sweep"),
                       help="output folder, replaced once the sweep is complete; until then (and after a sweep "
                            "that fails or stops early) the run's files are in OUT.partial (default: %(default)s)")
    sweep.set_defaults(func=cmd_sweep)

    analyze = sub.add_parser("analyze", help="fit, predict and attribute from results.json or CSV files")
    analyze.add_argument("files", nargs="*", type=Path, metavar="FILE",
                         help="results.json (a sweep's or a trace's), an AIPerf run's artifact folder or "
                              "profile_export.jsonl (several at different prompt lengths make one sweep), or CSV with "
                              "prompt_tokens,tok_per_s,avg_commit[,label]; several files with the same workload are "
                              "overlaid, each labelled by its folder")
    analyze.add_argument("--baseline", help="label of the baseline curve (default: padding, else the first)")
    analyze.add_argument("--point", action="append", default=[], metavar="CTX:TPS:COMMIT[:LABEL]",
                         help='an observed point, e.g. 4000:45:3.1 for "45 tok/s at 4000 tokens, avg_commit 3.1"')
    analyze.add_argument("--predict", action="append", default=[], metavar="CTX:COMMIT",
                         help="tok/s the fitted step curve predicts, e.g. 8000:4 (avg_commit 4 at 8000 tokens)")
    analyze.add_argument("--window", type=at_least(1), default=32,
                         help="generated tokens per window for acceptance against position (default: %(default)s)")
    analyze.add_argument("--json", action="store_true", help="print the analysis as JSON")
    analyze.add_argument("--as-trace", action="store_true",
                         help="read a streamed AIPerf run as a trace: each chunk a step (checked against its "
                              "per-step record where the server gave one)")
    analyze.add_argument("--out", type=Path, help="also write sweep.png and report.md here (trace.png for a trace)")
    _add_allow_mismatch(analyze)
    add_floor_args(analyze, ("--model", "--model-config"))
    analyze.set_defaults(func=cmd_analyze)

    diagnose = sub.add_parser("diagnose", help="padding sweep + workload sweep, then the attribution report",
                              description="Run the padding sweep and a workload sweep on the same server "
                                          "(or --load two results files) and attribute the workload's gap "
                                          "to acceptance, context scaling or other step cost.")
    _add_sweep_flags(diagnose, "code")
    add_floor_args(diagnose, ("--model-config",), dtype=False)
    diagnose.add_argument("--load", nargs=2, type=Path, metavar=("PADDING_RESULTS", "WORKLOAD_RESULTS"),
                          help="analyse two earlier results files instead of sweeping")
    diagnose.add_argument("--out", type=Path, default=Path("bench-out/diagnose"),
                          help="output folder: report.md and sweep.png, the sweeps in OUT/padding and "
                               "OUT/<workload>; replaced once both sweeps are complete, as sweep --out "
                               "(default: %(default)s)")
    diagnose.add_argument("--json", action="store_true", help="print the analysis as JSON")
    _add_allow_mismatch(diagnose)
    diagnose.set_defaults(func=cmd_diagnose)

    trace = sub.add_parser("trace", help="one long generation, step by step from the server's stream",
                           description="Stream long generations (ignore_eos) and read every chunk as one step: its "
                                       "tokens the commit, the gap before it the step time, checked against the "
                                       "server's own counts. Writes results.json, report.md and trace.png to --out.")
    _add_trace_flags(trace)
    add_floor_args(trace, ("--model-config",), dtype=False)
    trace.set_defaults(func=cmd_trace)
    register_limit(sub)


def _add_allow_mismatch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-mismatch", action="store_true",
                   help="compare results files that differ in max_tokens, workload, temperature, method, backend "
                        "or model (refused without it), with a warning that names the differences")


# ---- handlers ------------------------------------------------------------------------------------

def _check_sweep_args(args: argparse.Namespace) -> None:
    from ddscope.bench.workloads import load_workload

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


def _tokenizer(args: argparse.Namespace, base_url: str, client: Any) -> tuple[Any, str]:
    """The tokenizer that sizes prompts exactly, and where it came from: --tokenizer; the embedded
    server's target; else the server's own /tokenize or model directory (ddscope.bench.tokens)."""
    from ddscope.bench.backends import Server
    from ddscope.bench.tokens import find_tokenizer, local_tokenizer

    directory = args.tokenizer
    if directory is None and not args.url:
        from ddscope.engine.limits import DEMO_DIR

        directory = args.target or DEMO_DIR / "target"
    if directory is None:
        return find_tokenizer(base_url, client, Server(base_url, client).models())
    try:
        return local_tokenizer(directory), f"--tokenizer {directory}" if args.tokenizer else f"the target {directory}"
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot load a tokenizer from {directory}: {e}") from e


def _embedded(args: argparse.Namespace, log_path: Path) -> Any:
    """`ddscope serve` in its own process, as the sweep's server (ddscope.bench.embedded)."""
    from ddscope.bench.embedded import serve_process

    flags = ["--method", args.method, "--budget", str(args.budget), "--device", args.device, "--dtype", args.dtype]
    for flag, value in (("--target", args.target), ("--drafter", args.drafter)):
        if value:
            flags += [flag, str(value)]
    return serve_process(flags, log_path)


def _check_reachable(base_url: str, client: Any) -> None:
    """Fail in one line where nothing answers at the URL, before the tokenizer search and the probe,
    whose own warnings and errors would bury the cause."""
    import httpx

    from ddscope.bench.backends import Server

    try:
        client.get(Server(base_url, client).base_url + "/v1/models", timeout=10.0)
    except (httpx.TransportError, httpx.InvalidURL) as e:
        raise BenchError(f"cannot reach the server at {base_url}: {e}") from e


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


def _server_log(args: argparse.Namespace) -> Any:
    """The followed server log (--server-log / --log-cmd) as a context manager, or a null one."""
    import contextlib

    from ddscope.bench.serverlog import LogError, ServerLog

    if getattr(args, "server_log", None) is None and getattr(args, "log_cmd", None) is None:
        return contextlib.nullcontext(None)
    try:
        log = ServerLog(path=args.server_log, command=args.log_cmd)
    except LogError as e:
        raise BenchError(str(e)) from e
    return contextlib.closing(log)


def _on_server(args: argparse.Namespace, root: Path, work: Callable[[str, Any, Any], Any]) -> Any:
    """`work(base_url, client, log)` against one server: embedded (its log in `root`) or --url."""
    import contextlib

    import httpx

    from ddscope.util.process import ServerFailed

    server = contextlib.nullcontext(args.url) if args.url else _embedded(args, root / "server.log")
    try:
        with server as base_url, httpx.Client() as client, _server_log(args) as log:
            _check_reachable(base_url, client)
            return work(base_url, client, log)
    except ServerFailed as e:
        raise BenchError(str(e)) from e


def _run_sweeps(args: argparse.Namespace, root: Path, workloads: list[str],
                dirs: list[Path]) -> tuple[list[Path], str | None]:
    """Run one sweep per workload on one server: (the results.json paths, why a sweep stopped early, ending the
    run, or None)."""
    return _on_server(args, root, lambda url, client, log: _sweep_each(args, workloads, dirs, url, client, log))


def _sweep_each(args: argparse.Namespace, workloads: list[str], dirs: list[Path], base_url: str, client: Any,
                log: Any) -> tuple[list[Path], str | None]:
    from ddscope.bench.sweep import RequestFailed, Sweep, SweepConfig

    tokenizer, origin = _tokenizer(args, base_url, client)
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


def _report(paths: list[Path], out: Path | None, baseline: str | None, window: int, as_json: bool,
            points: list[str] = (), predict: list[str] = (), allow_mismatch: bool = False,
            floor: FloorRequest | None = None) -> int:
    """Analyse results files (plus --point rows), print, and write outputs to `out`; with floor options (given,
    or kept in the first results file), each point beside its physical floor."""
    from ddscope.bench.analyze import analyze
    from ddscope.bench.fit import NothingMeasured
    from ddscope.bench.intervals import sweep_matrix
    from ddscope.bench.records import load_rows, parse_point, parse_prediction
    from ddscope.bench.report import print_report, write_outputs

    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    errors: dict[str, int] = {}
    loaded, tags = merge_aiperf([load_rows(path) for path in paths], tags_of(paths))
    notes = like_for_like(loaded, tags, allow_mismatch)
    if overlaid(loaded):
        baseline, meta["runs"] = overlay(loaded, tags, baseline)
    for file_rows, file_meta in loaded:
        rows += file_rows
        for msg, count in (file_meta.pop("errors", None) or {}).items():
            errors[msg] = errors.get(msg, 0) + count
        for key, value in file_meta.items():  # the first file (the baseline's) describes the setup
            meta.setdefault(key, value)
    meta["errors"] = errors
    rows += [parse_point(spec, i) for i, spec in enumerate(points, 1)]
    if not rows:
        details = "; ".join(f"{n} x {msg}" for msg, n in errors.items())
        raise NothingMeasured("no point could be measured" + (f": {details}" if details else ""))
    analysis = analyze(rows, baseline=baseline, window=window)
    analysis.notes[:0] = notes
    analysis.by_category = sweep_matrix(rows)
    kept = floor is None
    floor = floor or kept_floor(meta)
    if floor is not None:
        from ddscope.bench.limit import ConfigError, FloorError, HardwareError
        from ddscope.bench.limit.cli import FloorArgsError, floor_spec
        from ddscope.bench.limit.verdict import against_floor

        try:
            analysis.limit = against_floor(analysis, floor_spec(floor, meta.get("backend")))
        except (ConfigError, FloorError, HardwareError, FloorArgsError) as e:
            if not kept:
                raise
            analysis.notes.append(f"the run's floor options cannot be used here, so no floor: {e}")
    predictions = [analysis.predict(*parse_prediction(spec)) for spec in predict]
    if as_json:
        print(json.dumps(analysis.to_dict(predictions), indent=1))
    else:
        print_report(analysis, stdout_console(), meta, predictions)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_outputs(analysis, meta, out)
    return 0


def _check_floor(req: FloorRequest) -> None:
    """The floor options' errors now: the hardware (host measured here, before a server competes for the CPUs),
    and the model and layout where the model is known before the run (--model-config, or the embedded server's)."""
    from ddscope.bench.limit.cli import floor_spec
    from ddscope.bench.limit.hardware import hardware_named

    if req.model is None:
        hardware_named(req.hardware)
    else:
        spec = floor_spec(req)
        spec.floor(1, req.nodes or 1)  # the layout: --gpus against the heads and experts


def _guard(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn expected failures into one clear line and exit code 2 (1: nothing measured)."""
    def run(args: argparse.Namespace) -> int:
        from ddscope.bench.fit import AnalysisError, NothingMeasured
        from ddscope.bench.limit import ConfigError, FloorError, HardwareError
        from ddscope.bench.limit.cli import FloorArgsError
        from ddscope.bench.workloads import WorkloadError

        try:
            args.floor = FloorRequest.from_args(args)
            if args.floor is not None:
                _check_floor(args.floor)  # before any server starts: a bad --hardware must not cost a sweep
            return handler(args)
        except NothingMeasured as e:
            print(f"ddscope bench: {e}", file=sys.stderr)
            return 1
        except Stopped as e:
            print(f"ddscope bench: aborted: {e}", file=sys.stderr)
            return 1
        except (BenchError, WorkloadError, AnalysisError, ConfigError, FloorError, HardwareError, FloorArgsError) as e:
            print(f"ddscope bench: error: {e}", file=sys.stderr)
            return 2
    run.__doc__ = handler.__doc__
    return run


@_guard
def cmd_sweep(args: argparse.Namespace) -> int:
    """Sweep, then the table, sweep.png and report.md, which replace --out once complete; exit 1 when no
    point was measured or the sweep stopped early (its files then stay in OUT.partial)."""
    _check_sweep_args(args)
    workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    with staged(args.out) as stage:  # several workloads: one sweep each, in OUT/<workload>, reported together
        dirs = [stage] if len(workloads) == 1 else [stage / folder_name(w, i) for i, w in enumerate(workloads)]
        paths, stopped = _run_sweeps(args, stage, workloads, dirs)
        baseline = "padding" if "padding" in workloads else None
        code = _report(paths, stage, baseline, args.window, as_json=False, floor=args.floor)
        if stopped:
            raise Stopped(stopped)
    return code


def _trace_doc(path: Path) -> dict | None:
    """A `bench trace` results.json, else None."""
    from ddscope.bench.trace import SCHEMA

    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == SCHEMA else None


@_guard
def cmd_analyze(args: argparse.Namespace) -> int:
    if not args.files and not args.point:
        raise BenchError("give at least one FILE or --point")
    if args.as_trace:  # an AIPerf run's chunks as a trace
        from ddscope.bench.aiperf import as_trace

        if len(args.files) != 1:
            raise BenchError("--as-trace reads one AIPerf run")
        return _trace_report(args, as_trace(args.files[0]), args.out)
    traces = [(path, doc) for path in args.files if (doc := _trace_doc(path)) is not None]
    if traces:  # a trace, set against the prompt sweep given beside it
        sweeps = [path for path in args.files if path not in dict(traces)]
        if len(traces) > 1 or len(sweeps) > 1 or args.point:
            raise BenchError("analyze takes one trace, and at most one prompt sweep's results.json to set it against")
        return _trace_report(args, traces[0][1], args.out, sweeps[0] if sweeps else None)
    return _report(args.files, args.out, args.baseline, args.window, args.json, args.point, args.predict,
                   args.allow_mismatch, args.floor)


@_guard
def cmd_trace(args: argparse.Namespace) -> int:
    """Trace, then report.md and trace.png; exit 1 when a stream was dropped (the partial trace stays in
    OUT.partial, marked)."""
    from ddscope.bench.workloads import load_workload

    if args.against is not None and not args.against.is_file():
        raise BenchError(f"--against: file not found: {args.against}")
    workloads = [load_workload(w.strip()) for w in args.workload.split(",") if w.strip()]
    args.contexts, args.clamp_contexts = [args.prompt_tokens], False
    if args.max_tokens is None:
        args.max_tokens = TRACE_EMBEDDED_MAX_TOKENS if not args.url else TRACE_URL_MAX_TOKENS
    with staged(args.out) as stage:
        doc = _on_server(args, stage, lambda url, client, _: _trace(args, workloads, stage, url, client))
        return _trace_report(args, doc, stage, args.against)


def _trace(args: argparse.Namespace, workloads: list[Any], stage: Path, base_url: str, client: Any) -> dict:
    from ddscope.bench import tracing
    from ddscope.bench.sweep import Sweep, SweepConfig

    tokenizer, origin = _tokenizer(args, base_url, client)
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
        return tracing.run(sweep, workloads, run_cfg, stage, header, bar.advance)


def _trace_report(args: argparse.Namespace, doc: dict, stage: Path | None, against: Path | None = None) -> int:
    from ddscope.bench import tracing
    from ddscope.bench.limit.cli import floor_spec

    floor = args.floor or kept_floor(doc)
    summary = tracing.summarize(doc, against, floor_spec(floor, doc.get("backend")) if floor else None)
    if stage is not None:
        stage.mkdir(parents=True, exist_ok=True)
        tracing.write_report(doc, summary, stage)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print("\n".join(tracing.lines(doc, summary)))
    if doc["status"] != "complete":
        dropped = next((r["error"] for r in doc["requests"] if r["status"] != "complete"), "the run was interrupted")
        raise Stopped(f"the stream was dropped: {dropped}; the partial trace is kept, marked")
    return 0


@_guard
def cmd_diagnose(args: argparse.Namespace) -> int:
    if args.load:  # the report beside the files, which may lie in --out: nothing there is replaced
        return _report(list(args.load), args.out, "padding", args.window, args.json,
                       allow_mismatch=args.allow_mismatch, floor=args.floor)
    _check_sweep_args(args)
    if args.workload == "padding":
        raise BenchError("diagnose compares a workload with padding: pick --workload code|math|chat|file:PATH")
    label = args.workload.split(":", 1)[0]
    with staged(args.out) as stage:
        paths, stopped = _run_sweeps(args, stage, ["padding", args.workload], [stage / "padding", stage / label])
        if stopped:
            raise Stopped(stopped)
        return _report(paths, stage, "padding", args.window, args.json, floor=args.floor)
