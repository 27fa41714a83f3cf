"""`ddscope serve`: registered on the top-level parser; the heavy imports happen in the handler."""
from __future__ import annotations

import argparse
import logging

from ddscope.engine.limits import KV_CACHE_MB, MAX_NUM_SEQS, MAX_PREFILL_TOKENS
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
    p.add_argument("--budget", type=budget_arg, default="auto",
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
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ddscope.server.launch import serve

    if min(args.max_queue, args.max_num_seqs, args.max_prefill_tokens, args.kv_cache_mb) < 1 or \
            args.request_timeout <= 0 or args.log_interval <= 0:
        raise SystemExit("ddscope serve: --max-queue, --max-num-seqs, --max-prefill-tokens, --kv-cache-mb, "
                         "--request-timeout and --log-interval must be positive")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_threads(args.threads)
    try:
        serve(args.target, args.drafter, method=args.method, budget=args.budget, host=args.host, port=args.port,
              max_queue=args.max_queue, request_timeout=args.request_timeout, log_interval=args.log_interval,
              shutdown_timeout=args.shutdown_timeout, device=args.device, dtype=args.dtype,
              max_model_len=args.max_model_len, kv_cache_mb=args.kv_cache_mb,
              prefix_cache=not args.no_prefix_cache, max_num_seqs=args.max_num_seqs,
              max_prefill_tokens=args.max_prefill_tokens,
              prefill_threads=args.prefill_threads, spec_decode_metrics=args.per_request_spec_decode_metrics,
              per_request_metrics=args.enable_per_request_metrics)
    except (OSError, ValueError) as e:  # CheckpointError is a ValueError
        logging.getLogger("ddscope.server").error("cannot serve: %s", e)
        return 1
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once its graceful shutdown is done
        pass
    return 0
