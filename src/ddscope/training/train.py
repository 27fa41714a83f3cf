"""The training half of `ddscope train-drafter`, one process per rank: `python -m ddscope.training.train`.

    torchrun --nproc-per-node N -m ddscope.training.train --target T --out D [train-drafter options]

trains on the distilled cache already in WORK_DIR (distillation options are accepted and ignored), with
DDP over the drafter (gloo on CPU, nccl on CUDA, one device per rank). `ddscope train-drafter --nproc N`
distils first, then launches exactly this.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from ddscope.config import CheckpointError, read_json, text_config
from ddscope.models.hf_target import load_target
from ddscope.training.contexts import Bucket, parse_context_lengths, select_mix
from ddscope.training.distill import read_cache
from ddscope.models.drafter_ckpt import check_layer_ids, mask_token_id, pick_layer_ids
from ddscope.training.head import TargetHead
from ddscope.training.options import TRAIN_DESCRIPTION, add_train_args
from ddscope.training.served_features import ServedFeatures
from ddscope.training.train_drafter import DrafterPlan, TrainSpec, closing_line, train


@dataclass(frozen=True)
class Plan:
    """The options checked against the target's config and tokenizer, before any weights load."""

    layer_ids: list[int]
    mask_id: int
    mask_token: str  # its text, recorded beside the id (SGLang's loader reads either)
    work: Path
    mix: tuple[Bucket, ...] | None  # --train-context-lengths


DEFAULT_BUDGET_MIN = 30.0  # with neither --steps nor --time-budget-min: a run that ends, said up front


def train_spec(args: argparse.Namespace) -> TrainSpec:
    minutes = args.time_budget_min
    if minutes is None and args.steps is None:
        minutes = DEFAULT_BUDGET_MIN
        print(f"train-drafter: no --steps or --time-budget-min given: training for {minutes:g} minutes",
              file=sys.stderr)
    return TrainSpec(block_size=args.block_size, layers=args.layers, sliding_window=args.sliding_window,
                     batch_seqs=args.batch_seqs, grad_accum=args.grad_accum, anchors=args.anchors, lr=args.lr,
                     gamma=args.gamma, steps=args.steps, time_budget_s=minutes * 60 if minutes else None,
                     seed=args.seed)


def plan(args: argparse.Namespace) -> Plan:
    if args.target_device_map and max(args.nproc, int(os.environ.get("WORLD_SIZE", 1))) > 1:
        raise ValueError("--target-device-map shards the target over all GPUs for one process; use --nproc 1")
    if args.features_url and (args.target_device_map or args.target_backend == "transformers"):
        raise ValueError("--features-url runs the target in the server: drop --target-device-map and --target-backend")
    if args.features_concurrency < 1:
        raise ValueError(f"--features-concurrency must be >= 1, got {args.features_concurrency}")
    raw = text_config(read_json(Path(args.target) / "config.json"))
    n_layers, vocab = int(raw["num_hidden_layers"]), int(raw["vocab_size"])
    layer_ids = args.target_layer_ids or pick_layer_ids(n_layers, max(1, min(args.layers, n_layers - 1)))
    check_layer_ids(layer_ids, n_layers)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{args.target}: the target has no usable tokenizer ({str(e).splitlines()[0]})") from None
    if len(tokenizer) <= len(tokenizer.all_special_tokens):  # transformers falls back to an empty vocabulary
        raise CheckpointError(f"{args.target}: the target has no usable tokenizer (no tokenizer files found)")
    work = args.work_dir or args.out.with_name(args.out.name + ".work")
    mask_id = mask_token_id(tokenizer, args.mask_token_id, vocab)
    mix = parse_context_lengths(args.train_context_lengths, "--train-context-lengths") \
        if args.train_context_lengths else None
    return Plan(layer_ids, mask_id, tokenizer.convert_ids_to_tokens(mask_id), work, mix)


def train_from_args(args: argparse.Namespace, records: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """Load the target on this rank's device and train (on `records`, or the cache in WORK_DIR)."""
    p, spec = plan(args), train_spec(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda" and dist.is_initialized():  # one GPU per rank
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    dtype, features = getattr(torch, args.target_dtype), None
    if args.features_url:  # the target's decoder runs in the server: load its embedding and head alone
        rank = dist.get_rank() if dist.is_initialized() else 0
        features = ServedFeatures(args.features_url, p.layer_ids, p.work, args.features_concurrency,
                                  args.features_timeout, rank)  # a wrong URL fails before any shard is read
        target = TargetHead.load(Path(args.target), torch.device(device), dtype)
    else:
        target = load_target(Path(args.target), torch.device(device), dtype, args.target_backend,
                             args.target_device_map)
    records = read_cache(p.work) if records is None else records
    if p.mix is not None:
        records = select_mix(records, p.mix, args.seed)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"--train-context-lengths: training on {len(records)} of the distilled sequences", file=sys.stderr)
    try:
        drafter = DrafterPlan(p.mask_id, p.layer_ids, args.init_drafter, p.mask_token)
        return train(Path(args.target), target, records, spec, drafter, args.out, p.work, resume=args.resume,
                     checkpoint_every_s=args.checkpoint_min * 60, feature_cache_gb=args.feature_cache_gb,
                     features=features)
    finally:
        if features is not None:
            features.close()


def _parser() -> argparse.ArgumentParser:
    """`train-drafter`'s own options (training/options.py), so both entry points take the same command line."""
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m ddscope.training.train",
                                     description=TRAIN_DESCRIPTION)
    add_train_args(parser)
    return parser


def to_argv(args: argparse.Namespace) -> list[str]:
    """The options of `args` that differ from the defaults, as a train-drafter command line (no --nproc)."""
    argv: list[str] = []
    # argparse has no public way to list a parser's options: `_actions` is its long-standing internal list.
    for action in _parser()._actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or action.dest in ("help", "nproc") or value == action.default:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:  # store_true
            argv.append(flag)
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return argv


def launch(args: argparse.Namespace, nproc: int) -> None:
    """Run this module under torchrun with `nproc` ranks on this machine; raises if any rank fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "ddscope.training.train", *to_argv(args)]
    code = subprocess.run(cmd, check=False).returncode
    if code:
        raise ValueError(f"torchrun with {nproc} ranks failed (exit {code}); the ranks' errors are above")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    distributed = "WORLD_SIZE" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    try:
        result = train_from_args(args)
        if distributed:
            dist.barrier()  # rank 0 saves last: leave together, or gloo may abort a rank still shutting down
    except ValueError as e:  # CheckpointError included: one line per rank, no traceback
        print(f"ddscope: error: {e}", file=sys.stderr)
        return 2
    finally:
        if distributed:
            dist.destroy_process_group()
    if not distributed or int(os.environ["RANK"]) == 0:
        print(f"drafter written to {args.out}: {closing_line(result)}", file=sys.stderr)
    return 0


def leave(code: int) -> None:
    """Exit a torchrun rank without the interpreter's teardown: gloo's sometimes aborts a rank there ("terminate
    called without an active exception") after the ranks met, saved and destroyed their group, failing a run
    whose work is done. Everything the run writes is closed by then; stdio is flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if "WORLD_SIZE" in os.environ:
        leave(code)
    sys.exit(code)
