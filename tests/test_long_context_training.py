"""Long-context drafter training: the context-length mix, long prompts, anchor visibility, fine-tuning
from an existing drafter, and eval-acceptance per context bucket."""
import json
import random
from collections import Counter

import pytest
import torch
from transformers import AutoTokenizer

from ddscope.bench.synthetic_models import make_drafter
from ddscope.models.target import Target
from ddscope.training.contexts import parse_context_lengths, sample_length, select_mix
from ddscope.training.distill import DistillSpec, build_prompts, distill, read_cache
from ddscope.training.train_drafter import DrafterPlan, TrainSpec, make_blocks, new_drafter
from support.runs import TINY_PROMPTS, run_cli, write_prompts

MIX = "16-64:0.5,64-256:0.3,256-1024:0.2"
PROMPTS = TINY_PROMPTS


def _bucket(n: int) -> int:
    return next(i for i, b in enumerate(parse_context_lengths(MIX)) if b.lo <= n < b.hi)


def test_context_mix_parses_and_rejects_bad_entries():
    buckets = parse_context_lengths("1-512:2,512-2048:1,2048-6144:1")
    assert [(b.lo, b.hi) for b in buckets] == [(1, 512), (512, 2048), (2048, 6144)]
    assert [b.share for b in buckets] == [0.5, 0.25, 0.25]
    for bad in ("", "512", "10-5:1", "0-10:1", "a-b:1", "1-10:x", "1-10:-1", "1-10:0"):
        with pytest.raises(ValueError, match="context-lengths"):
            parse_context_lengths(bad)


def test_sampler_produces_the_requested_mix():
    buckets = parse_context_lengths(MIX)
    rng = random.Random(0)
    draws = [sample_length(buckets, rng) for _ in range(20_000)]
    counts = Counter(_bucket(n) for n in draws)
    for i, b in enumerate(buckets):
        assert abs(counts[i] / len(draws) - b.share) < 0.015, (i, counts[i])
        inside = [n for n in draws if b.lo <= n < b.hi]
        assert min(inside) < b.lo + 0.1 * (b.hi - b.lo) and max(inside) > b.hi - 0.1 * (b.hi - b.lo)  # uniform span


def test_training_mix_keeps_the_scarce_bucket_and_samples_the_rest():
    rng = random.Random(0)
    records = [{"i": i, "prompt_len": rng.choice([rng.randrange(16, 1536), rng.randrange(1536, 6000)])}
               for i in range(1000)]
    n_long = sum(r["prompt_len"] >= 1536 for r in records)
    mix = parse_context_lengths("16-1536:0.28,1536-6144:0.72", "--train-context-lengths")
    kept = select_mix(records, mix, seed=5)
    long = [r for r in kept if r["prompt_len"] >= 1536]
    assert len(long) == n_long  # the scarce bucket (relative to its share) is kept whole
    assert abs(len(long) / len(kept) - 0.72) < 0.005
    assert [r["i"] for r in kept] == sorted(r["i"] for r in kept)
    assert kept == select_mix(records, mix, seed=5)  # a resumed run trains on the same records
    assert kept != select_mix(records, mix, seed=6)
    with pytest.raises(ValueError, match="selects no distilled record"):
        select_mix(records, parse_context_lengths("6000-7000:1"), seed=0)
    with pytest.raises(ValueError, match="--train-context-lengths entry"):
        parse_context_lengths("100-50:1", "--train-context-lengths")


def test_long_prompts_hit_their_drawn_length_and_keep_their_ending(tmp_path, tiny_pair):
    target, _ = tiny_pair
    tok = AutoTokenizer.from_pretrained(str(target))
    texts = [f"{p} {i}" for i in range(10) for p in PROMPTS]
    write_prompts(tmp_path / "p.jsonl", texts)
    spec = DistillSpec(data=f"file:{tmp_path / 'p.jsonl'}", prompts=60, context_lengths=MIX, seed=3)
    items = build_prompts(spec, tok)
    assert build_prompts(spec, tok) == items  # a pure function of the spec: resumed runs see the same list
    lengths = [len(ids) for _, ids in items]
    assert len(set(lengths)) > 30 and all(16 <= n < 1024 for n in lengths)
    assert len({_bucket(n) for n in lengths}) == 3
    endings = {tuple(tok.encode(p, add_special_tokens=False)) for p in texts}
    for _, ids in items:
        assert any(tuple(ids[-len(e):]) == e for e in endings if len(e) <= len(ids))


def test_anchors_of_a_long_record_see_only_earlier_context():
    prompt_len, n, B = 900, 1000, 8
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 300, (n,)).tolist()
    spec = TrainSpec(block_size=B, anchors=16, steps=1)
    blocks = make_blocks(torch.zeros(n, 4), {"ids": ids, "prompt_len": prompt_len}, spec, 3, gen)
    anchors = blocks.block_pos.view(-1, B)[:, 0]
    assert (anchors >= prompt_len - 1).all()  # every block predicts generated tokens, deep in the context
    ctx_seen = blocks.mask[:, :n]
    for j, a in enumerate(anchors.tolist()):
        rows = ctx_seen[j * B:(j + 1) * B]
        assert rows[:, :a].all() and not rows[:, a:].any()
        labels = blocks.labels.view(-1, B)[j]
        assert labels[0] == -1 and all(labels[k] == (ids[a + k] if a + k < n else -1) for k in range(1, B))


def test_init_drafter_starts_from_its_weights_and_refuses_a_mismatch(tmp_path, tiny_pair):
    target_dir, drafter_dir = tiny_pair
    target = Target.load(target_dir, torch.device("cpu"), torch.float32)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    layer_ids, mask = cfg["dflash_config"]["target_layer_ids"], cfg["dflash_config"]["mask_token_id"]
    spec = TrainSpec(block_size=cfg["block_size"], layers=cfg["num_hidden_layers"], steps=1, seed=9)
    fresh, _ = new_drafter(target_dir, target, spec, DrafterPlan(mask, layer_ids))
    tuned, _ = new_drafter(target_dir, target, spec, DrafterPlan(mask, layer_ids, init=drafter_dir))
    from ddscope.models.drafter import drafter_state
    init = drafter_state(drafter_dir)
    assert all(torch.equal(tuned.state_dict()[k], v) for k, v in init.items())
    assert not all(torch.equal(fresh.state_dict()[k], v) for k, v in init.items())
    other = make_drafter(tmp_path / "b4", target_dir, block_size=4)
    with pytest.raises(ValueError, match="init-drafter"):
        new_drafter(target_dir, target, spec, DrafterPlan(mask, layer_ids, init=other))


def test_distill_with_context_mix_resumes_without_redoing_items(tmp_path, tiny_pair):
    target, _ = tiny_pair
    write_prompts(tmp_path / "p.jsonl", PROMPTS)
    spec = DistillSpec(data=f"file:{tmp_path / 'p.jsonl'}", prompts=4, max_new_tokens=6, sampled_frac=0.5,
                       context_lengths="16-48:1,48-200:1", seed=1)
    work = tmp_path / "work"
    full = distill(target, spec, work)
    first = (work / "distill.0.jsonl").read_text().splitlines()
    (work / "distill.0.jsonl").write_text("\n".join(first[:2]) + "\n" + first[2][:10])  # killed mid-write
    again = distill(target, spec, work)
    assert [(r["i"], r["ids"]) for r in again] == [(r["i"], r["ids"]) for r in full]
    assert all(len(r["ids"]) == r["prompt_len"] + 6 and r["prompt_len"] >= 16 for r in again)
    with pytest.raises(ValueError, match="distillation data made with"):
        distill(target, DistillSpec(**{**spec.__dict__, "context_lengths": "16-48:1"}), work)
    assert len(read_cache(work)) == 4


def test_eval_acceptance_reports_tau_per_context(tmp_path, tiny_pair):
    target, drafter = tiny_pair
    write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    report = tmp_path / "r.json"
    assert run_cli(["eval-acceptance", "--target", str(target), "--drafter", str(drafter), "--workloads",
                 f"file:{tmp_path / 'p.jsonl'}", "--methods", "ar,ddtree:4,ddtree:auto", "--temperatures", "0",
                 "--prompts", "2", "--max-tokens", "8", "--contexts", "0,40,200", "--out", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["mismatches"] == []
    assert {(r["context"], r["method"]) for r in data["results"]} == {
        (c, m) for c in (0, 40, 200) for m in ("ar", "ddtree:4", "ddtree:auto")}
    assert all(r["prompts"] == 2 and r["tau"] >= 1 for r in data["results"])
