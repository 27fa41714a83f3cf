"""Pretrain the demo pair's target: a small Qwen3ForCausalLM on the offline corpus, on CPU.

    python -m ddscope.training.pretrain --tokenizer runs/demo/tokenizer --run-dir runs/demo \\
        --time-budget-min 45 [--resume]

Pipeline: tokenize every domain/split once into uint16 memmaps (runs/demo/data/), sample
fixed-length windows from the packed streams with the domain mixture, train with AdamW +
warmup/cosine, finish with a long-sequence phase so the model stays sane up to ~6k context,
then evaluate held-out loss (per domain and per position bucket) and save an HF checkpoint.
The schedule is fixed from a throughput measurement at start and stored in the checkpoint, so
``--resume`` continues the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen3Config

from ddscope.training.corpus import DEFAULT_MIX, DOMAINS, Document, is_heldout, iter_documents

SPLITS = ("train", "heldout")
POSITION_BUCKETS = ((0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 6144))
EVAL_RESERVE_S = 180  # final eval + save; subtracted from the time budget up front


@dataclass
class Plan:
    """The step schedule; fixed at the first start and restored on --resume."""

    short_steps: int
    long_steps: int
    short_len: int
    short_batch: int
    long_len: int
    long_batch: int
    warmup_steps: int
    sec_per_long_step: float

    @property
    def total_steps(self) -> int:
        return self.short_steps + self.long_steps

    def shape(self, step: int) -> tuple[int, int]:
        """(batch, seq_len) at a given step: the long phase is the final steps."""
        if step < self.short_steps:
            return self.short_batch, self.short_len
        return self.long_batch, self.long_len


# --- data -------------------------------------------------------------------------------------

def tokenize_split(tok: Tokenizer, docs: list[Document], out: Path, eos_id: int) -> None:
    """Encode documents, each followed by eos, into a flat uint16 file (written atomically)."""
    tmp = out.with_suffix(".tmp")
    with tmp.open("wb") as f:
        for i in range(0, len(docs), 256):
            for enc in tok.encode_batch([d.text for d in docs[i:i + 256]], add_special_tokens=False):
                np.asarray(enc.ids + [eos_id], dtype=np.uint16).tofile(f)
    os.replace(tmp, out)


def prepare_data(tokenizer_dir: Path, data_dir: Path, eos_id: int) -> dict[tuple[str, str], np.ndarray]:
    """Memmaps keyed by (domain, split); built once, then reused across runs and resumes."""
    data_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    streams = {}
    for domain in DOMAINS:
        paths = {s: data_dir / f"{domain}.{s}.bin" for s in SPLITS}
        if not all(p.exists() for p in paths.values()):
            start = time.time()
            docs = list(iter_documents(domain))
            for split, path in paths.items():
                chosen = [d for d in docs if (split == "heldout") == is_heldout(d.key)]
                tokenize_split(tok, chosen, path, eos_id)
            print(f"data: tokenized {domain} ({len(docs)} docs) in {time.time() - start:.0f}s", flush=True)
        for split, path in paths.items():
            streams[domain, split] = np.memmap(path, dtype=np.uint16, mode="r")
    for (domain, split), arr in streams.items():
        print(f"data: {domain:5s} {split:8s} {len(arr) / 1e6:8.2f}M tokens", flush=True)
    return streams


class Batcher:
    """Random windows from the packed train streams, domain drawn per row by mixture weight."""

    def __init__(self, streams: dict[str, np.ndarray], mix: dict[str, float], seed: int):
        self.domains = list(mix)
        self.streams = streams
        weights = np.array([mix[d] for d in self.domains])
        self.weights = weights / weights.sum()
        self.rng = np.random.default_rng(seed)

    def sample(self, batch: int, seq_len: int) -> torch.Tensor:
        """[batch, seq_len + 1] token ids (inputs plus the shifted target)."""
        rows = []
        for d in self.rng.choice(len(self.domains), size=batch, p=self.weights):
            arr = self.streams[self.domains[d]]
            start = int(self.rng.integers(0, len(arr) - seq_len - 1))
            rows.append(np.asarray(arr[start:start + seq_len + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


# --- model ------------------------------------------------------------------------------------

def build_model(args: argparse.Namespace, tokenizer_dir: Path) -> PreTrainedModel:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    # Chat turns end with <|im_end|>; plain text with <|endoftext|>: stop generation on either.
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def token_losses(model: PreTrainedModel, batch: torch.Tensor) -> torch.Tensor:
    """Per-token next-token cross entropy, shape [batch, seq_len]."""
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().transpose(1, 2), batch[:, 1:], reduction="none")


def lr_lambda(plan: Plan, min_ratio: float = 0.1):
    def f(step: int) -> float:
        if step < plan.warmup_steps:
            return (step + 1) / plan.warmup_steps
        progress = min(1.0, (step - plan.warmup_steps) / max(1, plan.total_steps - plan.warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def time_step(model: PreTrainedModel, batcher: Batcher, batch: int, seq_len: int) -> float:
    """Seconds for one forward+backward at this shape (gradients discarded, RNG restored)."""
    state = batcher.rng.bit_generator.state
    x = batcher.sample(batch, seq_len)
    batcher.rng.bit_generator.state = state
    start = time.time()
    token_losses(model, x).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.time() - start


def make_plan(args: argparse.Namespace, model: PreTrainedModel, batcher: Batcher, train_s: float) -> Plan:
    """Split the remaining wall time: (1 - long_frac) short steps, long_frac long steps."""
    short_batch = max(1, args.batch_tokens // args.seq_len)
    long_batch = max(1, args.batch_tokens // args.long_seq_len)
    time_step(model, batcher, short_batch, args.seq_len)  # warm-up (allocator, kernels)
    t_short = time_step(model, batcher, short_batch, args.seq_len) * 1.05  # + optimizer step
    t_long = time_step(model, batcher, long_batch, args.long_seq_len) * 1.05
    short_steps = max(1, int(train_s * (1 - args.long_frac) / t_short))
    long_steps = max(1, int(train_s * args.long_frac / t_long))
    print(f"plan: short {short_batch}x{args.seq_len} {t_short:.2f}s/step "
          f"({short_batch * args.seq_len / t_short:.0f} tok/s) x {short_steps}; "
          f"long {long_batch}x{args.long_seq_len} {t_long:.2f}s/step "
          f"({long_batch * args.long_seq_len / t_long:.0f} tok/s) x {long_steps}", flush=True)
    return Plan(short_steps, long_steps, args.seq_len, short_batch, args.long_seq_len, long_batch,
                warmup_steps=min(200, max(1, short_steps // 20)), sec_per_long_step=t_long)


# --- evaluation -------------------------------------------------------------------------------

def eval_windows(arr: np.ndarray, n: int, seq_len: int, eos_id: int, doc_aligned: bool) -> torch.Tensor:
    """Up to n evenly spaced windows; doc_aligned ones start right after an eos (a document start)."""
    if len(arr) < seq_len + 1:
        return torch.empty(0, seq_len + 1, dtype=torch.long)
    starts = np.linspace(0, len(arr) - seq_len - 1, n).astype(np.int64)
    if doc_aligned:
        eos_pos = np.flatnonzero(np.asarray(arr[:len(arr) - seq_len - 1]) == eos_id) + 1
        eos_pos = np.concatenate([[0], eos_pos])
        starts = np.unique(eos_pos[np.searchsorted(eos_pos, starts, side="right") - 1])
    return torch.from_numpy(np.stack([np.asarray(arr[s:s + seq_len + 1], dtype=np.int64) for s in starts]))


@torch.no_grad()
def heldout_loss(model: PreTrainedModel, streams: dict, mix: dict[str, float], eos_id: int,
                 n: int, seq_len: int) -> dict[str, float]:
    """Mean held-out loss per domain on seq_len windows, plus the mixture-weighted overall."""
    model.eval()
    out = {}
    for domain in mix:
        x = eval_windows(streams[domain, "heldout"], n, seq_len, eos_id, doc_aligned=False)
        out[domain] = float(torch.cat([token_losses(model, x[i:i + 8]) for i in range(0, len(x), 8)]).mean())
    out["overall"] = sum(out[d] * w for d, w in mix.items()) / sum(mix.values())
    model.train()
    return out


@torch.no_grad()
def position_bucket_losses(model: PreTrainedModel, streams: dict, mix: dict[str, float], eos_id: int,
                           n: int, seq_len: int) -> dict[str, dict[str, float]]:
    """Held-out loss by absolute position, on long windows starting at a document start."""
    model.eval()
    per_domain: dict[str, torch.Tensor] = {}
    for domain in mix:
        x = eval_windows(streams[domain, "heldout"], n, seq_len, eos_id, doc_aligned=True)
        if len(x):
            per_domain[domain] = torch.cat([token_losses(model, x[i:i + 1]) for i in range(len(x))])
    model.train()
    result: dict[str, dict[str, float]] = {}
    for name, losses in [*per_domain.items(), ("overall", torch.cat(list(per_domain.values())))]:
        result[name] = {f"{lo}-{hi}": float(losses[:, lo:hi].mean())
                        for lo, hi in POSITION_BUCKETS if hi <= losses.shape[1]}
        result[name]["windows"] = losses.shape[0]
    return result


# --- checkpointing ----------------------------------------------------------------------------

def save_checkpoint(path: Path, model, optimizer, scheduler, plan: Plan, step: int,
                    tokens: int, batcher: Batcher) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "plan": asdict(plan), "step": step, "tokens": tokens,
        "numpy_rng": batcher.rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
    }, tmp)
    os.replace(tmp, path)  # never leave a half-written checkpoint behind


def save_hf(model: PreTrainedModel, tokenizer_dir: Path, out: Path) -> None:
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)


# --- main loop --------------------------------------------------------------------------------

def train(args: argparse.Namespace) -> None:
    t0 = time.time()
    deadline = t0 + args.time_budget_min * 60 - EVAL_RESERVE_S
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    run_dir: Path = args.run_dir
    ckpt_path = run_dir / "target_ckpt" / "ckpt.pt"
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "target_train.jsonl"

    eos_id = AutoTokenizer.from_pretrained(args.tokenizer).eos_token_id
    streams = prepare_data(args.tokenizer, run_dir / "data", eos_id)
    batcher = Batcher({d: streams[d, "train"] for d in DEFAULT_MIX}, DEFAULT_MIX, args.seed)
    model = build_model(args, args.tokenizer)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params ({model.config.num_hidden_layers}L "
          f"h{model.config.hidden_size} ffn{model.config.intermediate_size})", flush=True)

    ckpt = torch.load(ckpt_path, weights_only=False) if args.resume and ckpt_path.exists() else None
    if ckpt:
        plan = Plan(**ckpt["plan"])
    else:
        if log_path.exists():
            log_path.unlink()  # a fresh run starts a fresh curve
        plan = make_plan(args, model, batcher, deadline - time.time())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(plan))
    step, tokens = 0, 0
    if ckpt:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        step, tokens = ckpt["step"], ckpt["tokens"]
        batcher.rng.bit_generator.state = ckpt["numpy_rng"]
        torch.set_rng_state(ckpt["torch_rng"])
        print(f"resume: step {step}/{plan.total_steps}, {tokens / 1e6:.1f}M tokens seen", flush=True)

    def checkpoint() -> None:
        save_checkpoint(ckpt_path, model, optimizer, scheduler, plan, step, tokens, batcher)

    last_ckpt = last_log = time.time()
    interval_loss, interval_n, interval_tokens = 0.0, 0, 0
    with log_path.open("a") as log:
        while step < plan.total_steps:
            now = time.time()
            if now > deadline:
                print(f"time budget reached at step {step}/{plan.total_steps}", flush=True)
                break
            # Behind schedule: cut the short phase so the long-context phase still happens.
            long_needed = (plan.total_steps - max(step, plan.short_steps)) * plan.sec_per_long_step
            if step < plan.short_steps and now > deadline - long_needed:
                print(f"behind schedule: skipping to the long phase at step {step}", flush=True)
                step = plan.short_steps
                scheduler.last_epoch = step - 1
                scheduler.step()
            batch, seq_len = plan.shape(step)
            loss = token_losses(model, batcher.sample(batch, seq_len)).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += batch * seq_len
            interval_loss, interval_n, interval_tokens = interval_loss + loss.item(), interval_n + 1, interval_tokens + batch * seq_len

            if step % args.log_every == 0 or step == plan.total_steps:
                now = time.time()
                rate = interval_tokens / (now - last_log)
                eta = (plan.total_steps - step) * (now - last_log) / interval_n
                row = {"step": step, "tokens": tokens, "seq_len": seq_len, "loss": interval_loss / interval_n,
                       "lr": scheduler.get_last_lr()[0], "tok_per_s": rate, "elapsed_s": now - t0}
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(f"step {step}/{plan.total_steps} len {seq_len} loss {row['loss']:.3f} "
                      f"lr {row['lr']:.2e} {rate:.0f} tok/s eta {eta / 60:.1f} min", flush=True)
                last_log, interval_loss, interval_n, interval_tokens = now, 0.0, 0, 0
            if time.time() - last_ckpt > args.ckpt_every_min * 60:
                held = heldout_loss(model, streams, DEFAULT_MIX, eos_id, n=8, seq_len=plan.short_len)
                log.write(json.dumps({"step": step, "tokens": tokens, "heldout": held}) + "\n")
                checkpoint()
                print(f"checkpoint at step {step}; held-out {held['overall']:.3f}", flush=True)
                last_ckpt = last_log = time.time()
        checkpoint()

    start_eval = time.time()
    report = {
        "step": step, "planned_steps": plan.total_steps, "tokens": tokens, "params": n_params,
        "plan": asdict(plan), "train_wall_s": start_eval - t0,
        "heldout_512": heldout_loss(model, streams, DEFAULT_MIX, eos_id, n=args.eval_windows, seq_len=plan.short_len),
        "position_buckets": position_bucket_losses(model, streams, DEFAULT_MIX, eos_id,
                                                   n=args.eval_long_windows, seq_len=plan.long_len),
        "heldout_tokens": {d: len(streams[d, "heldout"]) for d in DOMAINS},
        "train_tokens_available": {d: len(streams[d, "train"]) for d in DOMAINS},
    }
    report["eval_wall_s"] = time.time() - start_eval
    save_hf(model, args.tokenizer, args.out)
    (run_dir / "target_eval.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), flush=True)
    print(f"saved {args.out} (total {(time.time() - t0) / 60:.1f} min)", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ddscope.training.pretrain",
        description="Pretrain the demo target (Qwen3 architecture, fp32, CPU) on the offline corpus "
                    "within a wall-clock budget; resumable; ends with held-out eval and an HF save.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder (HF layout)")
    p.add_argument("--run-dir", type=Path, default=Path("runs/demo"),
                   help="data cache, checkpoints, training curve and eval report go here")
    p.add_argument("--out", type=Path, default=None, help="HF checkpoint folder (default RUN_DIR/target)")
    p.add_argument("--time-budget-min", type=float, required=True,
                   help="wall-clock minutes for this process, including data prep, eval and save")
    p.add_argument("--resume", action="store_true", help="continue from RUN_DIR/target_ckpt/ckpt.pt")
    g = p.add_argument_group("model geometry")
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--intermediate-size", type=int, default=768)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=64)
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=1.5e-3, help="peak AdamW learning rate")
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--batch-tokens", type=int, default=16384, help="tokens per optimizer step")
    g.add_argument("--seq-len", type=int, default=512, help="sequence length of the main phase")
    g.add_argument("--long-seq-len", type=int, default=6144, help="sequence length of the final phase")
    g.add_argument("--long-frac", type=float, default=0.15, help="share of training time in the long phase")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    g.add_argument("--ckpt-every-min", type=float, default=5.0, help="minutes between checkpoints")
    g.add_argument("--eval-windows", type=int, default=64, help="512-token held-out windows per domain")
    g.add_argument("--eval-long-windows", type=int, default=6, help="long held-out windows per domain")
    args = p.parse_args(argv)
    args.out = args.out or args.run_dir / "target"
    return args


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
