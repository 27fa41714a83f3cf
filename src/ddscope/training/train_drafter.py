"""Train a DFlash drafter on a frozen target's hidden states (SpecForge's DFlash recipe).

A step takes a few distilled sequences, runs the frozen target over each to get its features at
`target_layer_ids`, samples anchors `a` in the generated part, and trains the drafter to fill the
block `[tok[a], MASK x (B-1)]`: block position k predicts tok[a+k] (no shift), seeing context
strictly before `a` and its own block bidirectionally, never another block. That is exactly what
the drafter sees at inference, where the root (last committed token) sits at position `start`
and the drafter cache holds features for `[0, start)`.

Under torchrun every rank runs `train`: DDP over the drafter, the frozen target on each rank, and each
step's global batch split across ranks. The batch and its anchors are functions of (seed, step), so a
run resumes on any world size, and N ranks compute the same step as one process.
"""
from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from ddscope.config import DrafterConfig, read_json
from ddscope.models.drafter import Drafter, drafter_state
from ddscope.models.hf_target import CacheLike, TargetLike
from ddscope.models.weights import load_into
from ddscope.training.distill import append_whole_lines
from ddscope.models.drafter_ckpt import MASK_TOKEN, drafter_config, save_drafter
from ddscope.training.head import TargetHead
from ddscope.util.atomic import atomic_write_text, replacing

TAIL_STEPS = 20  # the closing line's recent window, beside the mean over all steps
# What training reads the embedding and head of: a whole target, or its head alone (features served).
Frozen = TargetLike | TargetHead


@dataclass(frozen=True)
class TrainSpec:
    block_size: int = 16
    layers: int = 1
    sliding_window: int | None = None  # drafter attention window in positions; None = all context
    batch_seqs: int = 8          # distilled sequences per optimizer step, over all ranks
    grad_accum: int = 1          # micro-batches per rank and step (memory, not maths: the step is the same)
    anchors: int = 16            # anchor blocks per sequence (fewer if the sequence is short)
    lr: float = 6e-4
    warmup: float = 0.04         # share of the schedule spent warming up
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None   # position-weight decay; None = 7 * B / 16 (7 at B=16, as in DFlash)
    steps: int | None = None     # the schedule ends at whichever bound comes first
    time_budget_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block size must be >= 2, got {self.block_size}")
        if self.layers < 1 or self.batch_seqs < 1 or self.anchors < 1 or self.grad_accum < 1:
            raise ValueError("layers, batch_seqs, anchors and grad_accum must be >= 1")
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise ValueError(f"sliding window {self.sliding_window} must be >= the block size {self.block_size}")
        if self.steps is None and self.time_budget_s is None:
            raise ValueError("give a step count or a time budget (or both)")
        if (self.steps is not None and self.steps < 1) or (self.time_budget_s is not None and self.time_budget_s <= 0):
            raise ValueError("steps and time budget must be positive")

    @property
    def position_weights(self) -> torch.Tensor:
        """Weight of block position k: 0 at the anchor itself, exp(-(k-1)/gamma) after it."""
        gamma = self.gamma if self.gamma is not None else 7.0 * self.block_size / 16
        k = torch.arange(self.block_size, dtype=torch.float32)
        return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros(()))

    def progress(self, step: int, train_s: float) -> float:
        return max(step / self.steps if self.steps else 0.0,
                   train_s / self.time_budget_s if self.time_budget_s else 0.0)

    def lr_at(self, progress: float) -> float:
        """Linear warmup, then cosine decay to zero."""
        if progress < self.warmup:
            return self.lr * max(progress / self.warmup, 0.01)
        return self.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - self.warmup) / (1 - self.warmup))))


@dataclass
class Blocks:
    """One sequence's anchor blocks, ready for `Drafter.run`."""

    features: torch.Tensor    # [n, k*H] target hidden states of the whole sequence
    ctx_pos: torch.Tensor     # [n] 0..n-1
    block_ids: torch.Tensor   # [A*B] token ids: tok[a], then MASK
    block_pos: torch.Tensor   # [A*B] a + k
    labels: torch.Tensor      # [A*B] tok[a + k], -1 where none (k = 0 or past the end)
    mask: torch.Tensor        # [A*B, n + A*B] True = may attend


def block_mask(n_ctx: int, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block j sees context positions strictly before its anchor and all of its own block
    (bidirectional), never another block: [A*B, n_ctx + A*B]."""
    ctx = torch.arange(n_ctx, device=anchors.device)[None, :] < anchors[:, None]
    own = torch.eye(anchors.numel(), dtype=torch.bool, device=anchors.device)
    own = own.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    return torch.cat([ctx.repeat_interleave(block_size, 0), own], dim=1)


def sample_anchors(prompt_len: int, n: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct anchors whose block predicts generated tokens only: a in [P-1, n-2]."""
    first = max(prompt_len - 1, 0)
    span = n - 1 - first
    if span < 1:
        raise ValueError(f"a sequence of {n} tokens with a {prompt_len}-token prompt has nothing to predict")
    return first + torch.randperm(span, generator=gen)[:count].sort().values


def batch_indices(n: int, batch: int, step: int, seed: int) -> list[int]:
    """The global batch of `step`: items [step*batch, +batch) of a stream of per-epoch shuffles of range(n)."""
    orders: dict[int, list[int]] = {}
    picks = []
    for pos in range(step * batch, (step + 1) * batch):
        epoch, k = divmod(pos, n)
        if epoch not in orders:
            orders[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        picks.append(orders[epoch][k])
    return picks


def anchor_generator(seed: int, step: int, j: int) -> torch.Generator:
    """The anchors of the j-th sequence of a step's batch, whichever rank draws them."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + j)


def target_features(target: TargetLike, cache: CacheLike, ids: list[int], capture: tuple[int, ...]) -> torch.Tensor:
    """The frozen target's hidden states at `capture` for a whole sequence, [n, k*H]."""
    dev = target.lm_head.weight.device
    cache.length = 0
    # Target.forward runs under inference_mode: copy so autograd may use the features, in the drafter's fp32.
    return target(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), cache,
                  capture=capture).features.to(torch.float32, copy=True)


def make_blocks(features: torch.Tensor, record: dict[str, Any], spec: TrainSpec, mask_token_id: int,
                gen: torch.Generator) -> Blocks:
    """Random anchor blocks of one distilled sequence (which must have a generated token)."""
    dev, B = features.device, spec.block_size
    ids = torch.tensor(record["ids"], dtype=torch.long)
    n = ids.numel()
    anchors = sample_anchors(record["prompt_len"], n, spec.anchors, gen)
    pos = anchors[:, None] + torch.arange(B)[None, :]                       # [A, B]
    labels = torch.where(pos < n, ids[pos.clamp(max=n - 1)], -1)
    labels[:, 0] = -1
    block = torch.full_like(pos, mask_token_id)
    block[:, 0] = ids[anchors]
    return Blocks(features, torch.arange(n, device=dev), block.flatten().to(dev), pos.flatten().to(dev),
                  labels.flatten().to(dev), block_mask(n, anchors, B).to(dev))


class FeatureSource(Protocol):
    """Target hidden states at the run's layer ids for whole sequences, [n, k*H] each, in fp32: from the
    target in this process (`TargetFeatures`) or from the engine serving it (served_features.py)."""

    def features(self, seqs: list[list[int]]) -> list[torch.Tensor]: ...


class TargetFeatures:
    """The frozen target's forward in this process, one sequence after another."""

    def __init__(self, target: TargetLike, capture: tuple[int, ...], max_len: int):
        self.target, self.capture = target, capture
        self.cache = target.new_cache(max_len)

    def features(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        return [target_features(self.target, self.cache, ids, self.capture) for ids in seqs]


class FeatureStore:
    """Target features per sequence, kept up to a byte budget: the target's forward (with its full-vocab
    head) costs about as much as a drafter step, and the data is revisited many times. A step's missing
    sequences go to the source together, so a served source can fetch them concurrently."""

    def __init__(self, source: FeatureSource, budget_bytes: int):
        self.source, self.budget = source, budget_bytes
        self.kept: dict[int, torch.Tensor] = {}
        self.used = 0

    def get(self, items: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        missing = list({i: ids for i, ids in items if i not in self.kept}.items())
        fetched = dict(zip((i for i, _ in missing), self.source.features([ids for _, ids in missing])))
        for i, features in fetched.items():
            size = features.numel() * features.element_size()
            if self.used + size <= self.budget:
                self.kept[i] = features
                self.used += size
        return [self.kept[i] if i in self.kept else fetched[i] for i, _ in items]


class BlockDrafter(nn.Module):
    """The drafter over the anchor blocks of a batch, once per sequence (blocks never see other sequences,
    so packing them would only add masked-out attention). This is the module DDP wraps: DDP syncs the
    gradients of what runs through its forward. The frozen target stays outside (DDP would broadcast it)."""

    def __init__(self, drafter: Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, embeds: list[torch.Tensor], batch: list[Blocks]) -> torch.Tensor:
        d = self.drafter
        return torch.cat([d.run(e, b.block_pos, d.context(b.features), b.ctx_pos, b.mask)
                          for e, b in zip(embeds, batch)])


def block_weight(batch: list[Blocks], weights: torch.Tensor) -> torch.Tensor:
    """Total position weight of the labelled block positions: the loss's normaliser."""
    B = weights.numel()
    return sum((weights.to(b.labels.device).repeat(b.labels.numel() // B)[b.labels >= 0].sum() for b in batch),
               torch.zeros((), device=batch[0].labels.device))


def block_loss(model: nn.Module, target: Frozen, batch: list[Blocks], weights: torch.Tensor,
               norm: torch.Tensor | None = None) -> tuple[torch.Tensor, float, int]:
    """(weighted cross-entropy over `norm` (default: this batch's own weight), sum of 1/commit, anchors).

    `model` is a BlockDrafter (or DDP of one); the shared head and the loss run once over all blocks. The
    acceptance estimate is tau of the greedy chain: per anchor the commit c = 1 (bonus) + leading block
    positions whose argmax equals the label. Decoding visits one anchor per c tokens, so tau (tokens per
    step) is the harmonic mean of c over uniformly drawn anchors, anchors / sum(1/c); the plain mean
    overweights easy stretches.
    """
    B = weights.numel()
    h = model([target.embed(b.block_ids).float() for b in batch], batch)  # fp32 drafter, any target dtype
    labels = torch.cat([b.labels for b in batch])
    valid = labels >= 0
    logits = target.logits(h[valid].to(target.lm_head.weight.dtype)).float()
    w = weights.to(h.device).repeat(labels.numel() // B)[valid]
    ce = F.cross_entropy(logits, labels[valid], reduction="none")
    loss = (ce * w).sum() / (w.sum() if norm is None else norm)
    with torch.no_grad():
        hit = torch.zeros_like(valid)
        hit[valid] = logits.argmax(-1) == labels[valid]
        commit = 1 + hit.view(-1, B)[:, 1:].long().cumprod(1).sum(1)
    return loss, commit.float().reciprocal().sum().item(), commit.numel()


def _world() -> tuple[int, int]:
    """(world size, rank): (1, 0) unless torch.distributed is initialised (torchrun)."""
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op)
    return t


def _optimizer_step(model: nn.Module, target: Frozen, batch: list[Blocks], weights: torch.Tensor,
                    opt: torch.optim.Optimizer, spec: TrainSpec) -> tuple[float, float, int]:
    """One step over this rank's share of the global batch, in `grad_accum` micro-batches. Returns the global
    batch's (loss, offline acceptance, block tokens).

    Every micro-batch loss is normalised by the global batch's total weight and scaled by the world size,
    which DDP's gradient mean divides out: the gradient is that of one process on the whole batch."""
    world = _world()[0]
    dev = batch[0].labels.device
    norm = _all_reduce(block_weight(batch, weights))
    opt.zero_grad(set_to_none=True)
    stats = torch.zeros(4, dtype=torch.float64, device=dev)  # loss, sum of 1/commit, anchors, block tokens
    parts = [batch[k::spec.grad_accum] for k in range(spec.grad_accum)]
    for k, part in enumerate(parts):
        # Gradients are all-reduced once per step, in the last micro-batch's backward.
        sync = k == len(parts) - 1 or not isinstance(model, DDP)
        with nullcontext() if sync else model.no_sync():
            loss, inv_commit, anchors = block_loss(model, target, part, weights, norm)
            (loss * world).backward()
        stats += torch.tensor([loss.item(), inv_commit, anchors, sum(b.labels.numel() for b in part)],
                              dtype=torch.float64, device=dev)
    torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
    opt.step()
    loss, inv_commit, anchors, tokens = _all_reduce(stats).tolist()
    return loss, anchors / inv_commit, int(tokens)


@dataclass(frozen=True)
class DrafterPlan:
    """The drafter to train: its mask token (id, and the text `train.plan` reads from the tokenizer), the target
    layers it reads, and the drafter whose weights it starts from (None: fresh)."""
    mask_token_id: int
    layer_ids: list[int]
    init: Path | None = None
    mask_token: str = MASK_TOKEN


def new_drafter(target_dir: Path, target: Frozen, spec: TrainSpec, plan: DrafterPlan) -> tuple[Drafter, dict[str, Any]]:
    """A freshly initialised drafter (seeded), or one starting from the weights of drafter `plan.init`
    (fine-tuning), and the z-lab config.json it will be saved with."""
    mask_token_id, layer_ids, init, mask_token = plan.mask_token_id, plan.layer_ids, plan.init, plan.mask_token
    config = drafter_config(read_json(target_dir / "config.json"), spec.layers, spec.block_size, mask_token_id,
                            layer_ids, mask_token=mask_token, sliding_window=spec.sliding_window)
    torch.manual_seed(spec.seed)
    cfg = DrafterConfig.from_dict(config, str(target_dir))
    drafter = Drafter(cfg).to(target.lm_head.weight.device)
    if init is not None:
        old = DrafterConfig.load(init)
        mine = (cfg.block_size, len(cfg.target_layer_ids), cfg.mask_token_id)
        theirs = (old.block_size, len(old.target_layer_ids), old.mask_token_id)
        if mine != theirs:
            raise ValueError(f"--init-drafter {init}: (block size, number of target layers, mask id) {theirs} "
                             f"differ from this run's {mine}")
        if old.target_layer_ids != cfg.target_layer_ids and _world()[1] == 0:
            # Moving a drafter onto other layers (e.g. off the target's last one) is a warm start, not a resume.
            print(f"--init-drafter {init}: trained on target layers {list(old.target_layer_ids)}; this run feeds it "
                  f"{list(cfg.target_layer_ids)}, so its first steps see other features", file=sys.stderr)
        load_into(drafter, drafter_state(init), init)
    return drafter, config


def _save_checkpoint(path: Path, config: dict[str, Any], drafter: Drafter, opt: torch.optim.Optimizer,
                     step: int, train_s: float) -> None:
    """Everything a resumed run needs: the schedule, the data order and the anchors are functions of step
    (and train_s), and DDP keeps the drafter and optimizer identical on every rank."""
    state = {"config": config, "model": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step,
             "train_s": train_s}
    with replacing(path) as tmp:  # a kill mid-save leaves the previous checkpoint intact
        torch.save(state, tmp)


def _restore(path: Path, config: dict[str, Any], drafter: Drafter, opt: torch.optim.Optimizer) -> tuple[int, float]:
    if not path.is_file():
        raise ValueError(f"--resume: no checkpoint at {path}")
    state = torch.load(path, map_location=drafter.fc.weight.device, weights_only=False)
    if state["config"] != config:
        raise ValueError(f"{path} was trained with a different drafter config; drop --resume or delete it")
    drafter.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return state["step"], state["train_s"]


def _trim_log(path: Path, step: int) -> None:
    """Drop log lines past the checkpoint: a killed run may have logged steps it never saved, and a torn
    last line (killed mid-write)."""
    if path.is_file():
        append_whole_lines(path).close()
        lines = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        atomic_write_text(path, "".join(line + "\n" for line in lines))


def train(target_dir: Path, target: Frozen, records: list[dict[str, Any]], spec: TrainSpec, plan: DrafterPlan,
          out_dir: Path, work_dir: Path, resume: bool = False, checkpoint_every_s: float = 300.0,
          feature_cache_gb: float = 2.0, features: FeatureSource | None = None) -> dict[str, float]:
    """Train, checkpointing to `work_dir/ckpt.pt` and logging to `work_dir/train_log.jsonl`, then export
    the drafter to `out_dir` (rank 0 writes). Returns the step count and `_closing_stats` of the steps run.
    `features` defaults to the target's own forward (`target` must then be a whole target, not a
    `TargetHead`)."""
    usable = [r for r in records if len(r["ids"]) - r["prompt_len"] >= 1]
    if not usable:
        raise ValueError("no distilled sequence has generated tokens to train on")
    world, rank = _world()
    if world > len(usable):
        raise ValueError(f"world size {world} is larger than the data: {len(usable)} usable sequences")
    if spec.batch_seqs < world * spec.grad_accum:
        raise ValueError(f"--batch-seqs {spec.batch_seqs} < world size {world} x --grad-accum {spec.grad_accum}: "
                         "every rank needs a sequence per micro-batch")
    target.requires_grad_(False)
    drafter, config = new_drafter(target_dir, target, spec, plan)
    layer_ids = plan.layer_ids
    opt = torch.optim.AdamW(drafter.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay)
    work_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path, lead = work_dir / "ckpt.pt", work_dir / "train_log.jsonl", rank == 0
    step, train_s = _restore(ckpt_path, config, drafter, opt) if resume else (0, 0.0)
    if lead and resume:
        _trim_log(log_path, step)
    elif lead:
        log_path.unlink(missing_ok=True)
    model = DDP(BlockDrafter(drafter)) if world > 1 else BlockDrafter(drafter)
    dev = drafter.fc.weight.device
    if features is None:
        features = TargetFeatures(target, tuple(layer_ids), max(len(r["ids"]) for r in usable))
    store = FeatureStore(features, int(feature_cache_gb * 2**30))
    weights = spec.position_weights
    drafter.train()
    last_ckpt, losses, accepts = time.monotonic(), [], []
    with tqdm(total=spec.steps, initial=step, desc="train-drafter", unit="step", dynamic_ncols=True,
              disable=not lead) as bar, (log_path.open("a") if lead else nullcontext()) as log:
        while spec.progress(step, train_s) < 1.0:
            t0 = time.monotonic()
            lr = spec.lr_at(spec.progress(step, train_s))
            for group in opt.param_groups:
                group["lr"] = lr
            picks = list(enumerate(batch_indices(len(usable), spec.batch_seqs, step, spec.seed)))[rank::world]
            feats = store.get([(i, usable[i]["ids"]) for _, i in picks])
            batch = [make_blocks(f.to(dev), usable[i], spec, plan.mask_token_id, anchor_generator(spec.seed, step, j))
                     for f, (j, i) in zip(feats, picks)]
            loss, accept, n_tok = _optimizer_step(model, target, batch, weights, opt, spec)
            # The slowest rank's time, so a time budget ends every rank at the same step.
            dt = _all_reduce(torch.tensor(time.monotonic() - t0, device=dev), dist.ReduceOp.MAX).item()
            step, train_s = step + 1, train_s + dt
            losses.append(loss)
            accepts.append(accept)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", accept=f"{accept:.2f}", tok_s=f"{n_tok / dt:.0f}",
                            done=f"{100 * spec.progress(step, train_s):.0f}%")
            if lead:
                log.write(json.dumps({"step": step, "loss": loss, "accept": accept, "lr": lr, "block_tokens": n_tok,
                                      "step_s": dt, "train_s": train_s, "world_size": world}) + "\n")
                log.flush()
                if time.monotonic() - last_ckpt > checkpoint_every_s:
                    _save_checkpoint(ckpt_path, config, drafter, opt, step, train_s)
                    last_ckpt = time.monotonic()
    if lead:
        _save_checkpoint(ckpt_path, config, drafter, opt, step, train_s)
        save_drafter(out_dir, config, drafter.state_dict())
    return {"steps": step, "train_s": train_s, **_closing_stats(losses, accepts)}


def _closing_stats(losses: list[float], accepts: list[float]) -> dict[str, float]:
    """This run's steps (0 when a resumed run had nothing left to do), the mean loss and acceptance of the
    last TAIL_STEPS of them (`loss`, `accept`), the mean loss over all of them and the last step's."""
    n, tail = len(losses), min(TAIL_STEPS, len(losses))
    if not n:
        return {"run_steps": 0, "tail_steps": 0,
                **dict.fromkeys(("loss", "accept", "loss_mean", "loss_last"), math.nan)}
    return {"run_steps": n, "tail_steps": tail, "loss": sum(losses[-tail:]) / tail,
            "accept": sum(accepts[-tail:]) / tail, "loss_mean": sum(losses) / n, "loss_last": losses[-1]}


def closing_line(result: dict[str, float]) -> str:
    """What train-drafter ends with: each loss named by the steps it averages (a mean over a run that
    started from scratch reads far above its last steps)."""
    n, tail, steps = result["run_steps"], result["tail_steps"], result["steps"]
    if not n:
        return f"{steps} steps, none left to run: no loss measured"
    over = f"all {n} steps" if n == steps else f"the {n} steps since the resume at step {steps - n}"
    recent = f", last {tail} steps {result['loss']:.3f}" if tail < n else ""
    return (f"{steps} steps; loss: mean over {over} {result['loss_mean']:.3f}{recent}, last step "
            f"{result['loss_last']:.3f}; offline accept: mean over the last {tail} steps {result['accept']:.2f}")
