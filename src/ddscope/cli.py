"""The `ddscope` command: generate, serve, bench, train-drafter, eval-acceptance, features-server."""
from __future__ import annotations

import argparse
import json
import sys

from ddscope.config import CheckpointError
from ddscope.engine.limits import DEFAULT_BUDGET
from ddscope.speculative.sampling_fields import default
from ddscope.util.options import add_model_args, add_prefill_threads_arg, add_threads_arg, budget_arg, set_threads


def _generate(args: argparse.Namespace) -> int:
    from ddscope.engine import load_engine  # torch and transformers: only once a command runs

    set_threads(args.threads)
    engine = load_engine(args)
    out = engine.generate(args.prompt, max_new_tokens=args.max_tokens, method=args.method, budget=args.budget,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          ignore_eos=args.ignore_eos)
    stats = out.stats.to_dict(rounds=args.json)
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "stats": stats}, indent=2))
        return 0
    print(args.prompt + out.text)
    print(f"\n[{stats['method']} budget={stats['budget']}] {stats['completion_tokens']} tokens in "
          f"{stats['verify_steps']} steps, avg_commit {stats['avg_commit']:.2f}, "
          f"{stats['mean_step_ms']:.2f} ms/step, {stats['decode_tok_per_s']:.1f} tok/s, "
          f"prefill {stats['prefill_ms']:.1f} ms, finish={out.finish_reason}", file=sys.stderr)
    return 0


def _register_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt and print stats",
                       description="Generate with ar, dflash or ddtree and print the text and a one-line stats "
                                   "summary (or everything as JSON).")
    p.add_argument("prompt", help="prompt text")
    add_model_args(p)
    add_threads_arg(p)
    add_prefill_threads_arg(p)
    p.add_argument("--method", choices=("ddtree", "dflash", "ar"),
                   help="decoding method (default: ddtree with a drafter, else ar)")
    p.add_argument("--budget", type=budget_arg, default=DEFAULT_BUDGET,
                   help="DDTree node budget, or auto (sized each step from measured costs, as serve) "
                        "(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=200, help="new tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=default("temperature"),
                   help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=default("top_p"), help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=default("top_k"), help="0 disables top-k (default: %(default)s)")
    p.add_argument("--seed", type=int, default=default("seed"), help="sampling seed (default: none, a fresh one)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--json", action="store_true", help="print text, ids and full stats (with rounds) as JSON")
    p.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    from ddscope.bench.cli import register as register_bench
    from ddscope.peers.cli import register as register_features
    from ddscope.server.cli import register as register_serve
    from ddscope.training.cli import register as register_training

    parser = argparse.ArgumentParser(prog="ddscope", description="DDTree speculative decoding you can see into.")
    sub = parser.add_subparsers(dest="command", required=True)
    _register_generate(sub)
    register_serve(sub)
    register_bench(sub)
    register_training(sub)
    register_features(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (CheckpointError, ValueError) as e:
        print(f"ddscope: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ddscope: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
