"""`ddscope serve`: registered on the top-level parser; the heavy imports happen in the handler."""
from __future__ import annotations

import argparse
import logging
from typing import Any

from ddscope.engine.limits import DEFAULT_BUDGET, KV_CACHE_MB, MAX_NUM_SEQS, MAX_PREFILL_TOKENS, MAX_WHITESPACE
from ddscope.structured.tool_parsers import PARSERS  # --tool-call-parser: vLLM's names
from ddscope.util.options import add_model_args, add_prefill_threads_arg, add_threads_arg, budget_arg, set_threads

SPEC_DECODE_LEVELS = ("none", "summary", "detailed")  # vLLM's --per-request-spec-decode-metrics levels


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible server with acceptance telemetry and Prometheus metrics",
        description="Serve a target/drafter pair (default: the bundled demo pair) over an OpenAI-compatible "
                    "HTTP API. See docs/server.md.")
    add_model_args(p)
    p.add_argument("--method", choices=("ddtree", "dflash", "ar"), default=None,
                   help="default decoding method; requests may override it (default: ddtree with a drafter, else ar)")
    p.add_argument("--budget", type=budget_arg, default=DEFAULT_BUDGET,
                   help="default DDTree node budget, or auto (sized each step for the whole batch from measured "
                        "costs); requests may override it (default: %(default)s)")
    add_threads_arg(p)
    add_prefill_threads_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, help="cap on prompt + generated tokens (default: the model's)")
    p.add_argument("--kv-cache-mb", type=int, default=KV_CACHE_MB, metavar="MB",
                   help="memory for the paged KV cache that every running request shares, allocated at start-up "
                        "(at most what --max-num-seqs sequences of --max-model-len fill); its free blocks are the "
                        "prefix cache (default: %(default)s)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not reuse a repeated prompt head's blocks (every prompt is prefilled whole)")
    p.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS,
                   help="requests decoded together in one batch; more wait (default: %(default)s)")
    p.add_argument("--max-prefill-tokens", type=int, default=MAX_PREFILL_TOKENS,
                   help="prompt tokens prefilled a step, over all requests: a longer prompt is prefilled in chunks "
                        "beside the running requests' steps (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait beyond the running batch; beyond it the server answers 503 "
                        "(default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds from arrival until a request is cancelled with 408 (default: %(default)s)")
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between decode log lines (default: %(default)s)")
    p.add_argument("--per-request-spec-decode-metrics", choices=SPEC_DECODE_LEVELS, default="summary",
                   help="vLLM's per-request acceptance in each response's metrics.speculative_decoding: none, summary, "
                        "or detailed (with per-step arrays) (default: %(default)s)")
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="vLLM's per-request timing fields under metrics too: TTFT, queue, generation time, mean ITL, "
                        "tokens per second")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown (default: %(default)s)")
    _add_surface_args(p)
    p.set_defaults(func=_run)


def _add_surface_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for what a team exposes to agents: keys, names, CORS, structured outputs and tools."""
    g = p.add_argument_group("API surface (vLLM's flags)")
    g.add_argument("--api-key", nargs="+", metavar="KEY",
                   help="accept only requests to /v1 that send one of these keys as a Bearer token (default: "
                        "$DDSCOPE_API_KEY, else $VLLM_API_KEY, else open); /health, /ping, /version and /metrics stay "
                        "open")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model names requests may send and /v1/models lists; responses report the first "
                        "(default: the target directory's name)")
    g.add_argument("--structured-outputs-config", metavar="JSON",
                   help='defaults of every structured-output request, e.g. \'{"backend": "xgrammar", '
                        '"disable_any_whitespace": true}\' (backend: auto, xgrammar or guidance; auto: xgrammar '
                        'where it enforces the whole schema, else llguidance). JSON\'s free whitespace is '
                        f'bounded to {MAX_WHITESPACE} characters a stretch (a newline and 20 spaces of indentation), '
                        'so that JSON finishes; "max_whitespace_cnt": N sets the bound, null lifts it')
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default once tools are sent), with --tool-call-parser')
    g.add_argument("--tool-call-parser", choices=list(PARSERS), metavar="NAME",
                   help="the model family's tool-call format, as vLLM names it: "
                        f"{', '.join(PARSERS)}. It reads `auto` calls and writes forced ones (required, named) "
                        "under a grammar (default: none: `auto` is refused, forced calls are vLLM's JSON)")
    g.add_argument("--allowed-origins", type=_json_list, default=[], metavar="JSON",
                   help='CORS origins, as a JSON list, e.g. \'["http://localhost:3000"]\' (default: none)')
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON", help="CORS methods (default: %(default)s)")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON", help="CORS headers (default: %(default)s)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS credentials")


def _json_list(text: str) -> list[str]:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError(f"a JSON list of strings, e.g. '[\"*\"]', not {text!r}")
    return value


def surface_of(args: argparse.Namespace) -> Any:
    """The Surface the flags describe; SystemExit naming a bad flag."""
    import os

    from ddscope.server.constraints import StructuredOutputsConfig
    from ddscope.server.state import Surface

    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise SystemExit("ddscope serve: --enable-auto-tool-choice and --tool-call-parser go together")
    keys = args.api_key or [k for k in (os.environ.get("DDSCOPE_API_KEY") or os.environ.get("VLLM_API_KEY"),) if k]
    if any(not k for k in keys):
        raise SystemExit("ddscope serve: an empty --api-key")
    try:
        outputs = (StructuredOutputsConfig.parse(args.structured_outputs_config)
                   if args.structured_outputs_config else StructuredOutputsConfig())
    except ValueError as e:
        raise SystemExit(f"ddscope serve: {e}") from None
    return Surface(tuple(keys), tuple(args.served_model_name or ()), outputs, args.tool_call_parser,
                   tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                   args.allow_credentials)


def _run(args: argparse.Namespace) -> int:
    from ddscope.server.launch import serve

    if min(args.max_queue, args.max_num_seqs, args.max_prefill_tokens, args.kv_cache_mb) < 1 or \
            args.request_timeout <= 0 or args.log_interval <= 0:
        raise SystemExit("ddscope serve: --max-queue, --max-num-seqs, --max-prefill-tokens, --kv-cache-mb, "
                         "--request-timeout and --log-interval must be positive")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_threads(args.threads)
    surface = surface_of(args)
    try:
        serve(args.target, args.drafter, method=args.method, budget=args.budget, host=args.host, port=args.port,
              max_queue=args.max_queue, request_timeout=args.request_timeout, log_interval=args.log_interval,
              shutdown_timeout=args.shutdown_timeout, device=args.device, dtype=args.dtype,
              max_model_len=args.max_model_len, kv_cache_mb=args.kv_cache_mb,
              prefix_cache=not args.no_prefix_cache, max_num_seqs=args.max_num_seqs,
              max_prefill_tokens=args.max_prefill_tokens,
              prefill_threads=args.prefill_threads, spec_decode_metrics=args.per_request_spec_decode_metrics,
              per_request_metrics=args.enable_per_request_metrics, surface=surface)
    except (OSError, ValueError) as e:  # CheckpointError is a ValueError
        logging.getLogger("ddscope.server").error("cannot serve: %s", e)
        return 1
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once its graceful shutdown is done
        pass
    return 0
