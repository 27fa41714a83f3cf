"""The native target forward equals transformers' on the same checkpoint."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from ddscope.bench.synthetic_models import make_target
from ddscope.models.target import Target
from support.tolerance import assert_same_sums, sums_depth


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_native_logits_match_transformers(tmp_path, arch):
    directory = make_target(tmp_path / arch, arch)
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    native = Target.load(directory, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, native.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    # Prefill in two chunks, then single tokens: exercises the cache and the causal mask with a past.
    cache = native.new_cache(64)
    pieces = [native(ids[0, a:b], torch.arange(a, b), cache).logits for a, b in [(0, 25), (25, 38), (38, 39), (39, 40)]]
    assert_same_sums(torch.cat(pieces), ref, sums_depth(native.cfg.geometry, 40))


def test_captured_hidden_states_follow_hf_indexing(tmp_path):
    directory = make_target(tmp_path / "t", "qwen3")
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    native = Target.load(directory, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, native.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    feats = native(ids[0], torch.arange(12), native.new_cache(16), capture=(0, 2, 3)).features
    ref = torch.cat([hs[1], hs[3], hs[4]], dim=-1)[0]  # layer id i -> hidden_states[i + 1]; last is normed
    assert_same_sums(feats, ref, sums_depth(native.cfg.geometry, 12))


@pytest.mark.parametrize("start", [0, 50])
def test_a_tail_forward_gives_the_last_rows_of_a_full_one(tmp_path, start):
    """`tail` rows through the last layer (a prefill after a prefix hit too, start > 0): the K/V of every row,
    and the logits and features of the tail's, as a forward that finishes every row."""
    native = Target.load(make_target(tmp_path / "t", "qwen3"), torch.device("cpu"), torch.float32)
    ids = torch.randint(0, native.cfg.vocab_size, (start + 200,), generator=torch.Generator().manual_seed(2))
    outs, caches = [], []
    for tail in (None, 37):
        cache = native.new_cache(256)
        if start:
            native(ids[:start], torch.arange(start), cache)
        outs.append(native(ids[start:], torch.arange(start, start + 200), cache, capture=(1, 3), tail=tail))
        caches.append(cache)
    full, part = outs
    assert part.logits.shape[0] == part.features.shape[0] == 37
    torch.testing.assert_close(part.logits, full.logits[-37:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(part.features, full.features[-37:], atol=1e-5, rtol=1e-4)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    with pytest.raises(ValueError, match="causal"):
        native(ids[:40], torch.arange(40), native.new_cache(64), mask=torch.ones(40, 40, dtype=torch.bool).tril(),
               tail=3)


def test_sharded_checkpoint_loads(tmp_path):
    directory = make_target(tmp_path / "one", "qwen3")
    hf = AutoModelForCausalLM.from_pretrained(str(directory))
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    for f in directory.glob("tokenizer*"):
        (tmp_path / "sharded" / f.name).write_bytes(f.read_bytes())
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    a = Target.load(directory, torch.device("cpu"), torch.float32)
    b = Target.load(tmp_path / "sharded", torch.device("cpu"), torch.float32)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
