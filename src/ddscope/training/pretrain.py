"""Pretrain the demo pair's target: a small Qwen3ForCausalLM on the offline corpus, on CPU.

    python -m ddscope.training.pretrain --tokenizer runs/demo/tokenizer --run-dir runs/demo \\
        --time-budget-min 60 --bf16 [--resume]

Pipeline: tokenize every domain/split once into uint16 memmaps (runs/demo/data/), sample
fixed-length windows from the packed streams with the domain mixture, train with AdamW +
warmup/cosine, finish with a long-sequence phase so the model stays sane up to ~6k context,
then evaluate held-out loss (per domain and per position bucket) and save an HF checkpoint.
The schedule is a function of elapsed training time (see Plan) and is stored in the checkpoint,
so ``--resume`` continues the same run, squeezed or stretched to the new budget.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen3Config

from ddscope.models.weights import umask_mode
from ddscope.training.corpus import DEFAULT_MIX, DOMAINS, Document, is_heldout, iter_documents
from ddscope.util.atomic import atomic_write_text, replacing

SPLITS = ("train", "heldout")
POSITION_BUCKETS = ((0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 6144))
EVAL_RESERVE_S = 180  # final eval + save; subtracted from the time budget up front


@dataclass
class Plan:
    """Batch shapes and the wall-clock schedule; restored on --resume.

    The schedule runs on *training time*, not steps: the CPU is shared, so throughput is not
    predictable, and a time-based schedule always ends (cosine at its floor, long phase done)
    exactly when the budget runs out.
    """

    short_len: int
    short_batch: int
    long_len: int
    long_batch: int
    long_frac: float
    warmup_steps: int
    train_s: float  # total training seconds; rescaled on resume to fit the new budget

    def progress(self, train_done_s: float) -> float:
        return min(1.0, train_done_s / self.train_s)

    def shape(self, progress: float) -> tuple[int, int]:
        """(batch, seq_len): the long-sequence phase is the final long_frac of training time."""
        if progress < 1 - self.long_frac:
            return self.short_batch, self.short_len
        return self.long_batch, self.long_len


# --- data -------------------------------------------------------------------------------------

def tokenize_split(tok: Tokenizer, docs: list[Document], out: Path, eos_id: int) -> None:
    """Encode documents, each followed by eos, into a flat uint16 file (written atomically)."""
    with replacing(out) as tmp, tmp.open("wb") as f:
        for i in range(0, len(docs), 256):
            for enc in tok.encode_batch([d.text for d in docs[i:i + 256]], add_special_tokens=False):
                np.asarray(enc.ids + [eos_id], dtype=np.uint16).tofile(f)


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


def learning_rate(peak: float, plan: Plan, step: int, progress: float, min_ratio: float = 0.1) -> float:
    """Linear warmup over the first steps, then cosine decay over training time."""
    warm = min(1.0, (step + 1) / plan.warmup_steps)
    return peak * warm * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


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

@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    train_done_s: float = 0.0  # wall seconds spent in training steps, summed over resumes


def save_checkpoint(path: Path, model: PreTrainedModel, optimizer: torch.optim.Optimizer,
                    plan: Plan, prog: Progress, batcher: Batcher) -> None:
    with replacing(path) as tmp:  # never leave a half-written checkpoint behind
        torch.save({
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "plan": asdict(plan), "progress": asdict(prog),
            "numpy_rng": batcher.rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
        }, tmp)


def save_hf(model: PreTrainedModel, tokenizer_dir: Path, out: Path) -> None:
    model.save_pretrained(out)
    for weights in out.glob("*.safetensors"):
        umask_mode(weights)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)


# --- main loop --------------------------------------------------------------------------------

def train_step(model: PreTrainedModel, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
               lr: float, grad_clip: float, bf16: bool) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    # bf16 autocast only speeds up the matmuls; master weights and optimizer state stay fp32.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = token_losses(model, batch).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


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
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    prog = Progress()
    if args.resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        batcher.rng.bit_generator.state = ckpt["numpy_rng"]
        torch.set_rng_state(ckpt["torch_rng"])
        plan, prog = Plan(**ckpt["plan"]), Progress(**ckpt["progress"])
        # Stretch or squeeze the rest of the schedule to fit this process's budget.
        plan.train_s = prog.train_done_s + max(0.0, deadline - time.time())
        print(f"resume: step {prog.step}, {prog.tokens / 1e6:.2f}M tokens, "
              f"{prog.train_done_s / 60:.1f} of {plan.train_s / 60:.1f} training min", flush=True)
    else:
        log_path.unlink(missing_ok=True)  # a fresh run starts a fresh curve
        plan = Plan(args.seq_len, max(1, args.batch_tokens // args.seq_len), args.long_seq_len,
                    max(1, args.batch_tokens // args.long_seq_len), args.long_frac,
                    args.warmup_steps, train_s=max(1.0, deadline - time.time()))
    print(f"plan: {plan}", flush=True)

    last_ckpt = time.time()
    window = {"loss": 0.0, "steps": 0, "tokens": 0, "seconds": 0.0}
    with log_path.open("a") as log:
        while prog.train_done_s < plan.train_s:
            start = time.time()
            progress = plan.progress(prog.train_done_s)
            batch, seq_len = plan.shape(progress)
            lr = learning_rate(args.lr, plan, prog.step, progress)
            loss = train_step(model, optimizer, batcher.sample(batch, seq_len), lr, args.grad_clip, args.bf16)
            elapsed = time.time() - start
            prog.step, prog.tokens = prog.step + 1, prog.tokens + batch * seq_len
            prog.train_done_s += elapsed
            window = {"loss": window["loss"] + loss, "steps": window["steps"] + 1,
                      "tokens": window["tokens"] + batch * seq_len, "seconds": window["seconds"] + elapsed}

            if prog.step % args.log_every == 0 or prog.train_done_s >= plan.train_s:
                row = {"step": prog.step, "tokens": prog.tokens, "seq_len": seq_len, "lr": lr,
                       "loss": window["loss"] / window["steps"], "progress": plan.progress(prog.train_done_s),
                       "tok_per_s": window["tokens"] / window["seconds"], "elapsed_s": time.time() - t0}
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(f"step {prog.step} len {seq_len} loss {row['loss']:.3f} lr {lr:.2e} "
                      f"{row['tok_per_s']:.0f} tok/s {prog.tokens / 1e6:.2f}M tok "
                      f"{100 * row['progress']:.0f}% eta {(plan.train_s - prog.train_done_s) / 60:.1f} min",
                      flush=True)
                window = dict.fromkeys(window, 0)
            if time.time() - last_ckpt > args.ckpt_every_min * 60:
                held = heldout_loss(model, streams, DEFAULT_MIX, eos_id, n=8, seq_len=plan.short_len)
                log.write(json.dumps({"step": prog.step, "tokens": prog.tokens, "heldout": held}) + "\n")
                save_checkpoint(ckpt_path, model, optimizer, plan, prog, batcher)
                print(f"checkpoint at step {prog.step}; held-out loss {held['overall']:.3f}", flush=True)
                last_ckpt = time.time()
                prog.train_done_s += last_ckpt - start - elapsed  # keep the schedule on wall time
        save_checkpoint(ckpt_path, model, optimizer, plan, prog, batcher)

    start_eval = time.time()
    report = {
        **asdict(prog), "params": n_params, "plan": asdict(plan), "wall_s_to_eval": start_eval - t0,
        "heldout_512": heldout_loss(model, streams, DEFAULT_MIX, eos_id, n=args.eval_windows, seq_len=plan.short_len),
        "position_buckets": position_bucket_losses(model, streams, DEFAULT_MIX, eos_id,
                                                   n=args.eval_long_windows, seq_len=plan.long_len),
        "heldout_tokens": {d: len(streams[d, "heldout"]) for d in DOMAINS},
        "train_tokens_available": {d: len(streams[d, "train"]) for d in DOMAINS},
    }
    report["eval_wall_s"] = time.time() - start_eval
    save_hf(model, args.tokenizer, args.out)
    atomic_write_text(run_dir / "target_eval.json", json.dumps(report, indent=2) + "\n")
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
    g.add_argument("--batch-tokens", type=int, default=8192, help="tokens per optimizer step")
    g.add_argument("--seq-len", type=int, default=512, help="sequence length of the main phase")
    g.add_argument("--long-seq-len", type=int, default=6144, help="sequence length of the final phase")
    g.add_argument("--long-frac", type=float, default=0.15, help="share of training time in the long phase")
    g.add_argument("--warmup-steps", type=int, default=30, help="linear learning-rate warmup")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 autocast for the matmuls (fp32 weights/optimizer; ~1.3x faster on AVX512-BF16)")
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
