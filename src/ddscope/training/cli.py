"""`ddscope train-drafter` and `ddscope eval-acceptance`. Heavy imports stay inside the handlers."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddscope.training.options import TRAIN_DESCRIPTION, add_train_args
from ddscope.util.atomic import atomic_write_text
from ddscope.util.options import add_threads_arg, any_int_list, set_threads


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def _train_drafter(args: argparse.Namespace) -> int:
    import torch

    from ddscope.engine import Engine
    from ddscope.training.distill import DistillSpec, distill, read_cache
    from ddscope.training.head import has_decoder
    from ddscope.training.train import launch, plan, train_from_args, train_spec
    from ddscope.training.train_drafter import closing_line

    if args.distill_workers < 1 or args.nproc < 1:
        raise ValueError("--distill-workers and --nproc must be >= 1")
    # Check the options against the target, and the training options, before distilling for hours.
    work = plan(args).work
    whole = has_decoder(Path(args.target))
    if not whole and not args.features_url and not args.distill_only:
        raise ValueError(f"{args.target} holds only part of the target (no decoder layers): train from the serving "
                         "engine's hidden states with --features-url URL (ddscope features-server), or give the "
                         "whole target")
    if not args.distill_only:
        train_spec(args)  # only to validate: each training process builds its own
    dspec = DistillSpec(data=args.data, prompts=args.prompts, max_prompt_tokens=args.max_prompt_tokens,
                        max_new_tokens=args.max_new_tokens, sampled_frac=args.sampled_frac, seed=args.seed,
                        context_lengths=args.context_lengths or "")
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    budget_s = args.distill_min * 60 if args.distill_min else None
    if args.distill_url:
        from ddscope.training.remote_distill import remote_distill

        records, counts = remote_distill(args.distill_url, args.target, dspec, work, args.distill_concurrency,
                                         budget_s, args.distill_timeout)
        print(f"distilled from {args.distill_url}: {counts.summary()}", file=sys.stderr)
    elif not whole:  # nothing to generate with here: train on the records already distilled
        records = read_cache(work)
        if not records:
            raise ValueError(f"{args.target} holds no decoder layers, so it cannot distil in this process: give "
                             f"--distill-url (a server of the same target) or put distilled records in {work}")
    else:
        records = distill(args.target, dspec, work, drafter=args.distill_drafter, method=args.distill_method,
                          time_budget_s=budget_s, workers=args.distill_workers,
                          threads=max(1, threads // args.distill_workers), device=args.device)
    print(f"distilled: {len(records)} sequences, {sum(len(r['ids']) - r['prompt_len'] for r in records)} "
          f"generated tokens in {work}", file=sys.stderr)
    if args.distill_only:
        return 0
    # Every rank checks this too (train_drafter.train), but failing here saves starting torchrun's ranks.
    if args.nproc > len(records):
        raise ValueError(f"--nproc {args.nproc} is larger than the data: {len(records)} distilled sequences")
    if args.nproc > 1:
        launch(args, args.nproc)
    else:
        result = train_from_args(args, records)
        print(f"drafter written to {args.out} in {result['train_s'] / 60:.1f} min: {closing_line(result)}",
              file=sys.stderr)
    if not whole:
        print(f"engine check skipped: {args.target} holds only part of the target; load {args.out} with the whole "
              "target (ddscope eval-acceptance --target FULL --drafter OUT) to check it", file=sys.stderr)
        return 0
    # The drafter must read back, with the target loaded as it was for training.
    Engine.load(args.target, args.out, device=args.device, dtype=args.target_dtype, target_backend=args.target_backend,
                device_map=args.target_device_map)
    return 0


def _eval_acceptance(args: argparse.Namespace) -> int:
    from ddscope.engine import Engine
    from ddscope.training.evaluate import EvalSpec, evaluate, parse_methods, print_table

    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    set_threads(args.threads)
    spec = EvalSpec(workloads=tuple(w for w in args.workloads.split(",") if w), methods=parse_methods(args.methods),
                    temperatures=tuple(args.temperatures), prompts=args.prompts, max_new_tokens=args.max_tokens,
                    chat_template=args.chat_template, contexts=tuple(args.contexts), warmup=args.warmup)
    engine = Engine.load(args.target, args.drafter, device=args.device, dtype=args.dtype,
                         target_backend=args.target_backend, device_map=args.target_device_map)
    report = evaluate(engine, spec)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    if args.out:
        atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")
    if report["mismatches"]:
        print(f"ddscope: LOSSLESS CHECK FAILED on {len(report['mismatches'])} prompt(s): greedy output differs "
              "from ar (details in the JSON 'mismatches')", file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-drafter", help="self-distil a DFlash drafter for a target", description=TRAIN_DESCRIPTION)
    add_train_args(p)
    p.set_defaults(func=_train_drafter)

    e = sub.add_parser(
        "eval-acceptance", help="measure real acceptance (tau) per workload, method and temperature",
        description="Run the engine over held-out prompt sets (code = HumanEval, math = GSM8K test, chat = MT-Bench "
                    "first turns) and report tau = tokens committed per verify step (bonus included) and tok/s. "
                    "At T=0 with ar among the methods, every method's output must equal ar's token for token.")
    e.add_argument("--target", help="target directory (default: the bundled demo pair)")
    e.add_argument("--drafter", help="drafter directory (default: the demo drafter with the demo target)")
    e.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: %(default)s)")
    e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="target and drafter dtype (default: %(default)s)")
    e.add_argument("--target-backend", choices=("auto", "native", "transformers"), default="auto",
                   help="auto: native Qwen3/Llama, transformers for other architectures (default: %(default)s)")
    e.add_argument("--target-device-map", metavar="auto",
                   help="shard the target over all visible GPUs (transformers) (default: one device)")
    add_threads_arg(e)
    e.add_argument("--workloads", default="code,math,chat",
                   help="comma list of code, math, chat, file:PATH (default: %(default)s)")
    e.add_argument("--methods", default="ar,dflash,ddtree:8,ddtree:32",
                   help="comma list of ar, dflash, ddtree:BUDGET, ddtree:auto (default: %(default)s)")
    e.add_argument("--temperatures", type=_float_list, default=[0.0, 1.0], help="comma list (default: 0,1)")
    e.add_argument("--prompts", type=int, default=20, help="prompts per workload (default: %(default)s)")
    e.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default: %(default)s)")
    e.add_argument("--chat-template", choices=("auto", "never"), default="auto",
                   help="auto: wrap math and chat prompts in the tokenizer's chat template when it has one; code "
                        "prompts stay raw (HumanEval is a completion task) (default: %(default)s)")
    e.add_argument("--contexts", type=any_int_list, default=[0],
                   help="prompt lengths in tokens, e.g. 0,1024,4096: each prompt is fitted to each length (earlier "
                        "prompts of the set prepended, as the bench does), tau is reported per length; 0 = the "
                        "prompt as it is (default: 0)")
    e.add_argument("--warmup", type=int, default=1,
                   help="untimed generations per method before measuring, so tok/s and 'vs ar' exclude one-off "
                        "allocation and kernel selection (default: %(default)s)")
    e.add_argument("--json", action="store_true", help="print the full report as JSON instead of the table")
    e.add_argument("--out", type=Path, help="also write the full report (JSON) here (default: none)")
    e.set_defaults(func=_eval_acceptance)
