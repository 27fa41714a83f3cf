"""z-lab's sliding-window drafter layers: config fields, what a block sees, cache slicing, losslessness."""
import json

import pytest
import torch

from ddscope import Engine
from ddscope.bench.synthetic_models import make_drafter, make_target, oracle_engine
from ddscope.config import CheckpointError, DrafterConfig, LayerAttention
from ddscope.engine.sequence import Sequence
from ddscope.models.drafter import Draft, Drafter
from ddscope.models.kv_pool import BLOCK
from ddscope.training.contexts import parse_context_lengths, select_mix
from support.tolerance import assert_same_sums, sums_depth
from ddscope.training.distill import read_cache
from ddscope.training.train_drafter import TrainSpec, block_mask
from support.runs import TINY_PROMPTS, run_cli, write_prompts

B = 8


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("t") / "target", "qwen3")


def config(target_dir, tmp_path, **fields) -> dict:
    d = make_drafter(tmp_path / "d", target_dir, layers=2, block_size=B)
    raw = json.loads((d / "config.json").read_text())
    return {**raw, **fields, "dflash_config": {**raw["dflash_config"], **fields.get("dflash_config", {})}}


@pytest.mark.parametrize("fields,expected", [
    ({}, [LayerAttention(), LayerAttention()]),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 64, "is_causal": False},
     [LayerAttention(), LayerAttention(64)]),
    # z-lab: a sliding layer is causal unless is_causal says otherwise; is_causal applies to every layer.
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 64}, [LayerAttention(64, True)] * 2),
    ({"is_causal": True}, [LayerAttention(None, True)] * 2),
    # transformers' older fields: layers from max_window_layers on slide.
    ({"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1, "is_causal": False},
     [LayerAttention(), LayerAttention(32)]),
    ({"use_sliding_window": False, "sliding_window": 32, "max_window_layers": 0}, [LayerAttention()] * 2),
    # vLLM's dflash_config spellings (MiMo-style checkpoints): use_swa, swa_window_size, causal.
    ({"dflash_config": {"use_swa": True, "swa_window_size": 48}}, [LayerAttention(48)] * 2),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 64, "dflash_config": {"causal": False}},
     [LayerAttention(64)] * 2),
])
def test_layer_attention_from_config_fields(target_dir, tmp_path, fields, expected):
    assert list(DrafterConfig.from_dict(config(target_dir, tmp_path, **fields)).attention) == expected


@pytest.mark.parametrize("fields,message", [
    ({"layer_types": ["sliding_attention"] * 2}, "need sliding_window >= 1"),
    ({"layer_types": ["full_attention"]}, "for each of 2 layers"),
    ({"layer_types": ["chunked_attention"] * 2, "sliding_window": 8}, "full_attention or sliding_attention"),
])
def test_bad_window_fields_fail_clearly(target_dir, tmp_path, fields, message):
    with pytest.raises(CheckpointError, match=message):
        DrafterConfig.from_dict(config(target_dir, tmp_path, **fields))


def drafter(target_dir, tmp_path, window: int | None, causal: bool = False) -> Drafter:
    fields = {} if window is None else {"layer_types": ["sliding_attention"] * 2, "sliding_window": window}
    torch.manual_seed(3)
    d = Drafter(DrafterConfig.from_dict(config(target_dir, tmp_path, is_causal=causal, **fields)))
    for p in d.parameters():  # visible attention: random, not the near-uniform init
        torch.nn.init.normal_(p, std=0.3)
    return d.eval()


def run_cached(d: Drafter, block, ctx, chunks: list[int]) -> torch.Tensor:
    """The inference path: context fed to the cache over several rounds, then one block."""
    cache, start = d.new_cache(64), 0
    with torch.no_grad():
        for n in chunks[:-1]:  # earlier rounds' blocks: only their context writes matter here
            d.forward_blocks(block, [Draft(0, start + n, cache)], ctx[start:start + n])
            start += n
        return d.forward_blocks(block, [Draft(0, start + chunks[-1], cache)], ctx[start:start + chunks[-1]])[0]


def run_masked(d: Drafter, block, ctx) -> torch.Tensor:
    """The training path: all context at once, the block's anchor after it, a boolean mask."""
    n = ctx.shape[0]
    with torch.no_grad():
        return d.run(block, torch.arange(n, n + B), ctx, torch.arange(n), block_mask(n, torch.tensor([n]), B))


@pytest.mark.parametrize("window,causal", [(None, False), (12, False), (9, True), (None, True)])
def test_cache_slicing_equals_the_training_mask(target_dir, tmp_path, window, causal):
    d = drafter(target_dir, tmp_path, window, causal)
    torch.manual_seed(0)
    ctx, block = torch.randn(30, 64), torch.randn(B, 64)
    assert_same_sums(run_cached(d, block, ctx, [11, 7, 12]), run_masked(d, block, ctx),
                     sums_depth(d.cfg.geometry, 30))


def test_window_hides_exactly_the_positions_out_of_reach(target_dir, tmp_path):
    d = drafter(target_dir, tmp_path, window=12)
    torch.manual_seed(0)
    ctx, block = torch.randn(30, 64), torch.randn(B, 64)
    base = run_cached(d, block, ctx, [30])
    far, near = ctx.clone(), ctx.clone()
    far[:19] += 5.0    # position 18 is 12 away from the block's first query (at 30): out of every window
    near[19] += 5.0    # position 19 is 11 away from the first query
    assert torch.equal(run_cached(d, block, far, [30]), base)
    moved = (run_cached(d, block, near, [30]) - base).abs().amax(-1)
    assert moved[0] > 1e-3  # query 0 sees it
    # A window wider than the context is full attention.
    wide, full = drafter(target_dir, tmp_path, window=64), drafter(target_dir, tmp_path, window=None)
    assert_same_sums(run_cached(wide, block, ctx, [30]), run_cached(full, block, ctx, [30]),
                     sums_depth(full.cfg.geometry, 30))


def test_a_draft_projects_only_the_positions_in_reach(target_dir, tmp_path):
    """Every layer slides: a draft over 30 positions of features takes in only those within the window of
    its block, and drafts what taking them all in would."""
    from ddscope.models.target import Target

    target = Target.load(target_dir, torch.device("cpu"), torch.float32)
    d, full = drafter(target_dir, tmp_path, window=12), drafter(target_dir, tmp_path, window=None)
    assert (d.horizon, full.horizon) == (11, None)
    cache = d.new_cache(64)
    cache.features[:30] = torch.randn(30, cache.features.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = d.draft(target, 7, 30, cache)
        block = torch.full((B,), d.cfg.mask_token_id)
        block[0] = 7
        everything = d.forward_blocks(target.embed(block), [Draft(7, 30, d.new_cache(64))],
                                      d.context(cache.features[:30]))[0]
    assert cache.length == 30 and not cache.k[:, :, :19].any()  # 0..18 are out of reach: never projected
    assert cache.k[:, :, 19:30].abs().amax() > 0
    depth = sums_depth(d.cfg.geometry, 30 + B) + target.cfg.geometry.hidden_size  # then the target's head
    assert_same_sums(got, target.logits(everything[1:]), depth)


def test_causal_layers_do_not_look_ahead_in_the_block(target_dir, tmp_path):
    d = drafter(target_dir, tmp_path, window=None, causal=True)
    torch.manual_seed(0)
    ctx, block = torch.randn(10, 64), torch.randn(B, 64)
    later = block.clone()
    later[5:] += 5.0
    a, b = run_cached(d, block, ctx, [10]), run_cached(d, later, ctx, [10])
    assert torch.equal(a[:5], b[:5]) and not torch.allclose(a[5:], b[5:])


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 8)])
def test_windowed_drafter_is_lossless(target_dir, tmp_path, method, budget):
    """The windowed drafter as it is (random: nearly never accepted), and drafting under an oracle that the
    target accepts, so long accepted paths feed its sliced context cache."""
    d = make_drafter(tmp_path / "w", target_dir, layers=2, block_size=B, sliding_window=B + 2)
    assert DrafterConfig.load(d).attention == (LayerAttention(B + 2),) * 2
    engine = Engine.load(target_dir, d)
    prompt = [int(t) for t in torch.randint(5, 300, (60,), generator=torch.Generator().manual_seed(4))]
    ar = engine.generate(prompt, max_new_tokens=40, method="ar", ignore_eos=True).token_ids
    kwargs = {"budget": budget} if budget else {}
    assert engine.generate(prompt, max_new_tokens=40, method=method, ignore_eos=True, **kwargs).token_ids == ar
    out = oracle_engine(engine, accuracy=0.7).generate(prompt, max_new_tokens=40, method=method, ignore_eos=True,
                                                       **kwargs)
    assert out.token_ids == ar and out.stats.to_dict()["avg_commit"] > 1.5


def test_train_drafter_sliding_window_fine_tunes_a_full_drafter(tmp_path, target_dir, capsys):
    write_prompts(tmp_path / "prompts.jsonl", TINY_PROMPTS)
    full = make_drafter(tmp_path / "full", target_dir, layers=1, block_size=B)
    out, work = tmp_path / "windowed", tmp_path / "work"
    argv = ["train-drafter", "--target", str(target_dir), "--out", str(out), "--work-dir", str(work),
            "--data", f"file:{tmp_path / 'prompts.jsonl'}", "--prompts", "4", "--max-new-tokens", "24",
            "--sampled-frac", "0", "--block-size", str(B), "--batch-seqs", "2", "--anchors", "4", "--steps", "3",
            "--threads", "1", "--init-drafter", str(full), "--sliding-window", "12",
            "--train-context-lengths", "1-10:0.75,10-4096:0.25"]
    assert run_cli(argv) == 0
    mix = parse_context_lengths("1-10:0.75,10-4096:0.25")
    kept = select_mix(read_cache(work), mix, seed=0)
    assert len(kept) == 3  # the mix drops some of the 4 sequences (two prompts are under 10 tokens, two not: 2 + 1 kept)
    assert f"training on {len(kept)} of the distilled sequences" in capsys.readouterr().err
    saved = json.loads((out / "config.json").read_text())
    assert saved["layer_types"] == ["sliding_attention"] and saved["sliding_window"] == 12
    assert saved["is_causal"] is False  # written out: z-lab's loader would otherwise make the layer causal
    assert DrafterConfig.load(out).attention == (LayerAttention(12),)
    Engine.load(target_dir, out)
    with pytest.raises(ValueError, match="must be >= the block size"):
        TrainSpec(block_size=B, sliding_window=B - 1, steps=1)


def _first_draft(engine: Engine, prompt: list[int]) -> tuple[Sequence, torch.Tensor, torch.Tensor]:
    """(the sequence after its prefill, the first draft's logits, the prompt's target K) through the engine's
    prefill path and its prefix cache; the sequence then leaves, its blocks offered to the cache."""
    seq = engine.sequence(prompt, method="ddtree", budget=8, max_new_tokens=2)
    engine.add(seq)
    engine.step()
    d = seq.decoder
    draft = engine.drafter.draft(engine.target, d.tokens[-1], len(prompt), d.draft_cache)
    k = engine.pool.k[:, :, d.cache.pages.slots(0, len(prompt))].clone()
    engine.abort(seq)
    return seq, draft, k


def _full_prefill_draft(engine: Engine, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """(the first token, the first draft's logits) after a prefill that finishes every row."""
    n = len(prompt)
    cache, draft_cache = engine.target.new_cache(n + 1), engine.drafter.new_cache(n + 1)
    full = engine.target(torch.tensor(prompt), torch.arange(n), cache, capture=engine.drafter.cfg.target_layer_ids)
    draft_cache.features[:n] = full.features
    first = int(full.logits[-1].argmax())
    return first, engine.drafter.draft(engine.target, first, n, draft_cache)


def _draft_depth(engine: Engine, context: int) -> int:
    """A first draft's logits: the target's prefill, then the drafter's layers and the target's head."""
    return sums_depth(engine.target.cfg.geometry, context) + sums_depth(engine.drafter.cfg.geometry, context)


def _windowed_engine(target_dir, tmp_path) -> Engine:
    return Engine.load(target_dir, make_drafter(tmp_path / "w", target_dir, layers=2, block_size=B,
                                                sliding_window=B + 2))


def test_a_prefill_finishes_only_the_rows_the_first_draft_reads(target_dir, tmp_path):
    """With every drafter layer sliding, the prefill keeps features only from the block holding the first
    draft's reach (its last layer runs past its K/V for them only where the drafter reads that layer, else for
    the last row alone): the K/V, first token and first draft are those of a full prefill."""
    engine = _windowed_engine(target_dir, tmp_path)
    n = 3 * BLOCK + 8
    prompt = [int(t) for t in torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(5))]
    seq, got, k = _first_draft(engine, prompt)
    decoder = seq.decoder
    assert decoder.features_from == (n - engine.drafter.horizon) // BLOCK * BLOCK == 2 * BLOCK
    cache = engine.target.new_cache(n)
    engine.target(torch.tensor(prompt), torch.arange(n), cache)
    torch.testing.assert_close(k, cache.k[:, :, :n])
    want_first, want = _full_prefill_draft(engine, prompt)
    assert decoder.tokens[-1] == want_first
    assert_same_sums(got, want, _draft_depth(engine, n))


def test_prefix_hits_over_blocks_saved_without_features(target_dir, tmp_path):
    """A block a trimmed prefill left without features serves a later prompt whose first draft does not
    reach it, and ends a hit whose draft would; the draft is that of a full prefill either way."""
    engine = _windowed_engine(target_dir, tmp_path)
    first = [int(t) for t in torch.randint(5, 300, (4 * BLOCK + 44,), generator=torch.Generator().manual_seed(6))]
    far = first[:3 * BLOCK] + [7] * 40  # its draft reads from 3 * BLOCK + 31: blocks 0-2 serve without features
    near = first[:4 * BLOCK] + [9] * 4  # its draft reads from 4 * BLOCK - 5, in block 3, which has none
    hits = []
    for prompt in (first, far, near):
        seq, got, _ = _first_draft(engine, prompt)
        want_token, want = _full_prefill_draft(engine, prompt)
        assert seq.decoder.tokens[-1] == want_token
        assert_same_sums(got, want, _draft_depth(engine, len(prompt)))
        hits.append(seq.stats.cached_tokens)
    assert hits == [0, 3 * BLOCK, 3 * BLOCK]
