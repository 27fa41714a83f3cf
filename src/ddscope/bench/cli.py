"""`ddscope bench sweep|analyze|diagnose|trace|limit`: the arguments, and one call a command into the rooms
(running/commands.py, judging/judge.py, limit/cli.py). Heavy imports stay inside the handlers."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddscope.bench.collecting.server_log import END_SLACK_S
from ddscope.bench.errors import AnalysisError, BenchError, NothingMeasured, Stopped
from ddscope.bench.limit.cli import FloorArgsError, FloorRequest, add_floor_args, check_floor
from ddscope.bench.limit.cli import register as register_limit
from ddscope.bench.running.commands import (CONTEXTS, EMBEDDED_MAX_TOKENS, TRACE_EMBEDDED_MAX_TOKENS,
                                            TRACE_URL_MAX_TOKENS, URL_MAX_TOKENS)
from ddscope.util.options import add_model_args, at_least, budget_arg, int_list, number_in

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


# ---- handlers: one call each ------------------------------------------------------------------------------------

def _guard(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn expected failures into one clear line and exit code 2 (1: nothing measured, or a run stopped early);
    the floor options are checked first, before any server starts: a bad --hardware must not cost a sweep."""
    def run(args: argparse.Namespace) -> int:
        from ddscope.bench.limit import ConfigError, FloorError, HardwareError
        from ddscope.bench.running.workloads import WorkloadError

        try:
            args.floor = FloorRequest.from_args(args)
            if args.floor is not None:
                check_floor(args.floor)
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
    from ddscope.bench.running.commands import run_sweep

    return run_sweep(args)


@_guard
def cmd_diagnose(args: argparse.Namespace) -> int:
    from ddscope.bench.running.commands import run_diagnose

    return run_diagnose(args)


@_guard
def cmd_trace(args: argparse.Namespace) -> int:
    from ddscope.bench.running.commands import run_trace

    return run_trace(args)


@_guard
def cmd_analyze(args: argparse.Namespace) -> int:
    from ddscope.bench.judging.judge import analyze_files

    return analyze_files(args.files, args.out, args.baseline, args.window, args.json, args.point, args.predict,
                         args.allow_mismatch, args.floor, args.as_trace)
