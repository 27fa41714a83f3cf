"""How sure the drafter is, block slot by block slot, on the main job's padding generation.

For each context, the target writes its greedy continuation of the padding prompt; then, at anchors
in the tail of that continuation (where the demo target has settled into its loop), the drafter
drafts one block from the target's features. Printed per context:
- the greedy chain: how many leading block tokens the drafter's argmax gets right, plus the bonus
  (what `dflash` would commit there);
- p(true token) per slot, averaged over anchors. A best-first tree of a fixed budget goes deep only
  where these are near 1: at 0.65 a slot, a 32-node tree stops near depth 10 even when every argmax
  is right.

`--feature-tail N` computes the target's features over the last N prompt tokens plus the
continuation only, with the same tokens to draft: a drafter that is good there and bad with the full
context is meeting features it was not trained on (the target's states drift deep into a context).

    python benchmarks/drafter/slot_confidence.py [--drafter D] [--contexts 13,3333,5553] [--feature-tail 3000]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from engine_args import load_engine, parser

from ddscope import Engine
from ddscope.bench.running.workloads import fit_ids, load_workload
from ddscope.training.train_drafter import block_mask, target_features


def draft_block_probs(engine: Engine, seq: list[int], anchors: list[int]) -> torch.Tensor:
    """The drafter's distribution per block slot at each anchor, [anchors, B, vocab]."""
    target, drafter = engine.target, engine.drafter
    n, a, B = len(seq), torch.tensor(anchors), drafter.block_size
    features = target_features(target, target.new_cache(n + B), seq, tuple(drafter.cfg.target_layer_ids))
    pos = a[:, None] + torch.arange(B)[None]
    block = torch.full_like(pos, drafter.cfg.mask_token_id)
    block[:, 0] = torch.tensor(seq)[a]
    with torch.no_grad():
        h = drafter.run(target.embed(block.flatten()), pos.flatten(), drafter.context(features), torch.arange(n),
                        block_mask(n, a, B))
        return target.logits(h).softmax(-1).view(len(anchors), B, -1)


def slot_stats(probs: torch.Tensor, truth: torch.Tensor) -> tuple[float, list[float]]:
    """(mean greedy chain incl. the bonus token, mean p(true token) per slot 1..B-1)."""
    hit = (probs.argmax(-1) == truth)[:, 1:].long()
    chain = 1 + hit.cumprod(1).sum(1).float()
    p_true = probs.gather(-1, truth[..., None])[..., 0][:, 1:]
    return chain.mean().item(), p_true.mean(0).tolist()


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--contexts", default="13,3333,5553", help="padding prompt lengths in tokens")
    p.add_argument("--max-tokens", type=int, default=128, help="continuation length (the main job's)")
    p.add_argument("--skip", type=int, default=48, help="continuation tokens before the first anchor")
    p.add_argument("--stride", type=int, default=3, help="tokens between anchors")
    p.add_argument("--feature-tail", type=int, help="features over only the last N prompt tokens")
    args = p.parse_args(argv)
    engine = load_engine(args)
    if engine.drafter is None:
        p.error("the engine has no drafter")
    B = engine.drafter.block_size
    if args.skip + B >= args.max_tokens:
        p.error("--skip plus the block size must be below --max-tokens")
    padding = load_workload("padding")
    print(f"| ctx | greedy chain | p(true) per slot 1..{B - 1} |\n|---|---|---|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        ids = fit_ids(padding, 0, ctx, engine.tokenizer)
        seq = ids + engine.generate(ids, max_new_tokens=args.max_tokens, method="ar", ignore_eos=True).token_ids
        cut = max(0, len(ids) - args.feature_tail) if args.feature_tail is not None else 0
        anchors = list(range(len(ids) + args.skip, len(seq) - B, args.stride))
        probs = draft_block_probs(engine, seq[cut:], [a - cut for a in anchors])
        truth = torch.tensor(seq)[torch.tensor(anchors)[:, None] + torch.arange(B)[None]]
        chain, p_true = slot_stats(probs, truth)
        print(f"| {ctx} | {chain:.2f} | {' '.join(f'{x:.2f}' for x in p_true)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
