"""Targets of any causal-LM architecture through transformers: the same features as the native model, and a
DeepSeek-V3-style MoE/MLA target that trains a drafter end to end and decodes losslessly with it."""
import json

import pytest
import torch

from ddscope.bench.synthetic_models import make_target
from ddscope.config import CheckpointError
from ddscope.engine import Engine
from ddscope.models.hf_target import HFTarget, load_target
from ddscope.models.target import Target
from ddscope.training.train_drafter import target_features
from support.runs import TINY_PROMPTS, run_cli, write_prompts

PROMPTS = TINY_PROMPTS[:4]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_transformers_features_equal_native(tmp_path, arch):
    directory = make_target(tmp_path / arch, arch, layers=4)
    native = load_target(directory, torch.device("cpu"), torch.float32)
    hf = load_target(directory, torch.device("cpu"), torch.float32, backend="transformers")
    assert isinstance(native, Target) and isinstance(hf, HFTarget)
    ids = torch.randint(4, native.cfg.vocab_size, (57,), generator=torch.Generator().manual_seed(1)).tolist()
    layers = (0, 1, 3)  # 3 is the last layer: HF's normed last hidden state
    a = target_features(native, native.new_cache(64), ids, layers)
    b = target_features(hf, hf.new_cache(64), ids, layers)
    assert a.shape == b.shape == (57, 3 * native.cfg.geometry.hidden_size)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_sliding_window_target_is_refused(tmp_path):
    directory = make_target(tmp_path / "t", "llama", layers=2)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    with pytest.raises(CheckpointError, match="sliding-window attention is not supported"):
        load_target(directory, torch.device("cpu"), torch.float32, backend="transformers")


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """A tiny random DeepSeek-V3 (MoE + MLA) target and a drafter trained for it with `train-drafter`."""
    d = tmp_path_factory.mktemp("moe")
    target = make_target(d / "target", "deepseek_v3", layers=4)
    write_prompts(d / "prompts.jsonl", PROMPTS)
    assert run_cli(["train-drafter", "--target", str(target), "--out", str(d / "drafter"), "--work-dir", str(d / "work"),
                 "--data", f"file:{d / 'prompts.jsonl'}", "--prompts", "4", "--max-new-tokens", "40",
                 "--sampled-frac", "0", "--block-size", "4", "--batch-seqs", "4", "--anchors", "8", "--lr", "3e-3",
                 "--steps", "80", "--threads", "1"]) == 0
    return target, d / "drafter", d / "work"


def test_moe_target_trains_a_drafter_recorded_for_zlab_loaders(moe_pair):
    target, drafter, work = moe_pair
    log = [json.loads(line) for line in (work / "train_log.jsonl").open()]
    first, last = (sum(r["loss"] for r in rows) / 5 for rows in (log[:5], log[-5:]))
    assert last < 0.5 * first, (first, last)
    config = json.loads((drafter / "config.json").read_text())
    dflash = config["dflash_config"]
    assert dflash["target_architectures"] == ["DeepseekV3ForCausalLM"]
    assert dflash["target_hidden_size"] == config["hidden_size"] == 64
    assert dflash["num_target_layers"] == config["num_target_layers"] == 4
    assert dflash["mask_token"] == "<|mask|>" and isinstance(dflash["mask_token_id"], int)
    assert dflash["target_layer_ids"] == [2] and config["block_size"] == 4


def test_moe_target_decodes_losslessly_with_its_drafter(moe_pair):
    target, drafter, _ = moe_pair
    engine = Engine.load(target, drafter)
    assert isinstance(engine.target, HFTarget)
    hf = engine.target.model
    accepted = 0
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ref = engine.generate(ids, max_new_tokens=32, method="ar", ignore_eos=True).token_ids
        with torch.inference_mode():  # ar through the adapter is transformers' own greedy decoding
            hf_ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
        assert hf_ref[0, len(ids):].tolist() == ref
        for method, budget in (("dflash", None), ("ddtree", 8)):
            out = engine.generate(ids, max_new_tokens=32, method=method, budget=budget, ignore_eos=True)
            assert out.token_ids == ref, f"{method} diverged from ar on {prompt!r}"
            accepted += sum(r.committed > 1 for r in out.stats.rounds)
    assert accepted > 0, "no draft token was ever accepted: the tree and KV compaction went untested"


def test_bf16_target_trains_an_fp32_drafter(tmp_path):
    target = make_target(tmp_path / "target", "qwen3", layers=2)
    write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    out, work = tmp_path / "drafter", tmp_path / "work"
    assert run_cli(["train-drafter", "--target", str(target), "--out", str(out), "--work-dir", str(work),
                 "--data", f"file:{tmp_path / 'prompts.jsonl'}", "--prompts", "4", "--max-new-tokens", "24",
                 "--sampled-frac", "0", "--block-size", "4", "--batch-seqs", "4", "--anchors", "8", "--lr", "3e-3",
                 "--steps", "40", "--threads", "1", "--target-dtype", "bfloat16", "--mask-token-id", "1"]) == 0
    losses = [json.loads(line)["loss"] for line in (work / "train_log.jsonl").open()]
    assert all(torch.isfinite(torch.tensor(losses))) and sum(losses[-5:]) < 0.7 * sum(losses[:5])
    dflash = json.loads((out / "config.json").read_text())["dflash_config"]
    assert (dflash["mask_token_id"], dflash["mask_token"]) == (1, "<|im_start|>")  # the text of the id given
    engine = Engine.load(target, out, dtype="bfloat16")
    assert engine.drafter.fc.weight.dtype == torch.bfloat16
    assert engine.generate("def add(a, b):", max_new_tokens=8, method="ddtree").finish_reason in ("length", "stop")


@pytest.mark.parametrize("budget", [4, 16, "auto"])
def test_moe_tree_verify_and_compaction_at_every_depth(tmp_path, virtual_time, budget):
    """An oracle drafter (the target's own continuation, top-1 right at 70% of depths, the target's choice
    second where wrong) makes trees accept long paths and siblings: the transformers path's 4D mask,
    positions and DynamicCache compaction must reproduce ar exactly. Under virtual time `auto` drafts
    (and so reaches every depth) whatever this machine's speed."""
    from test_lossless import prompts

    from ddscope.bench.synthetic_models import make_drafter, oracle_engine

    target = make_target(tmp_path / "target", "deepseek_v3", layers=4)
    plain = Engine.load(target, make_drafter(tmp_path / "drafter", target, block_size=6), max_model_len=256)
    depths = set()
    for i, prompt in enumerate(prompts(plain.vocab_size, 4, seed=7)):
        ref = plain.generate(prompt, max_new_tokens=60, method="ar", ignore_eos=True).token_ids
        oracle = virtual_time.use(oracle_engine(plain, accuracy=0.7, seed=i))
        out = oracle.generate(prompt, max_new_tokens=60, method="ddtree", budget=budget, ignore_eos=True)
        assert out.token_ids == ref, f"prompt {i}: ddtree over transformers diverged from ar"
        depths |= {r.committed for r in out.stats.rounds}
    deepest = 6 if budget == "auto" else min(budget, 5) + 1
    assert max(depths) == deepest and len(depths) >= 4, sorted(depths)
