"""The native target forward equals transformers' on the same checkpoint."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from ddscope.model import Target
from ddscope.testing import make_target


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
    torch.testing.assert_close(torch.cat(pieces), ref, atol=1e-4, rtol=1e-4)


def test_captured_hidden_states_follow_hf_indexing(tmp_path):
    directory = make_target(tmp_path / "t", "qwen3")
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    native = Target.load(directory, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, native.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    feats = native(ids[0], torch.arange(12), native.new_cache(16), capture=(0, 2, 3)).features
    ref = torch.cat([hs[1], hs[3], hs[4]], dim=-1)[0]  # layer id i -> hidden_states[i + 1]; last is normed
    torch.testing.assert_close(feats, ref, atol=1e-4, rtol=1e-4)


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
