"""Drafters in the speculators format (what vllm-project/speculators 0.9.0 writes, and vLLM loads as it is):
the geometry under `transformer_layer_config`, the layer ids in vLLM's convention. The fixture made by the
real speculators from real vLLM features loads and decodes losslessly; a z-lab drafter rewritten in that
format drafts exactly as the original; a last-layer id, which vLLM and ddscope capture differently, is refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ddscope.config import CheckpointError, DrafterConfig
from ddscope.engine import Engine
from ddscope.models.drafter import Drafter

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "speculators-dflash-demo"  # copied from shared/fixtures


def as_speculators(zlab: Path, out: Path, aux_ids: list[int] | None = None) -> Path:
    """The z-lab drafter at `zlab` rewritten in speculators' layout, its weights unchanged."""
    raw = json.loads((zlab / "config.json").read_text())
    dflash = raw.pop("dflash_config")
    out.mkdir(parents=True)
    shutil.copy(zlab / "model.safetensors", out / "model.safetensors")
    config = {"architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash",
              "speculators_version": "0.9.0", "block_size": raw.pop("block_size"),
              "mask_token_id": dflash["mask_token_id"], "sliding_window_non_causal": True,
              "aux_hidden_state_layer_ids": aux_ids or [i + 1 for i in dflash["target_layer_ids"]],
              "transformer_layer_config": raw}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_the_speculators_fixture_loads_and_decodes_losslessly():
    engine = Engine.load(drafter=FIXTURE)
    cfg = engine.drafter.cfg
    assert (cfg.layout, cfg.target_layer_ids, cfg.block_size, cfg.mask_token_id) == ("speculators", (1, 2), 16, 3)
    assert cfg.attention[0].window == 2048 and cfg.attention[0].causal  # sliding_window_non_causal: false
    for prompt in ("def fib(n):", "The quick brown fox"):
        for temperature, seed in ((0.0, None), (0.8, 7)):
            kw = dict(max_new_tokens=48, ignore_eos=True, temperature=temperature, seed=seed)
            ar = engine.generate(prompt, method="ar", **kw)
            for method in ("dflash", "ddtree"):  # a fixed tree: `auto` leaves out a drafter the law rules out
                out = engine.generate(prompt, method=method, **kw, **({"budget": 16} if method == "ddtree" else {}))
                assert out.token_ids == ar.token_ids, (prompt, temperature, method)
                assert out.stats.to_dict()["nodes_verified"] > 0  # the drafter's trees were verified
                if method == "ddtree" and temperature == 0:  # trees accepted (the 5-step fixture barely drafts:
                    assert out.stats.to_dict()["avg_commit"] > 1.2  # the identical-drafts test below proves it)


def test_a_zlab_drafter_in_speculators_layout_drafts_exactly_as_the_original(tiny_engine, tiny_pair, tmp_path):
    zlab = tiny_pair[1]
    spec = as_speculators(zlab, tmp_path / "spec")
    a, b = (Drafter.load(d, tiny_engine.target) for d in (zlab, spec))
    assert b.cfg.target_layer_ids == a.cfg.target_layer_ids and b.cfg.layout == "speculators"
    assert b.cfg.attention == a.cfg.attention and b.cfg.geometry == a.cfg.geometry
    traces, original = [], tiny_engine.drafter
    try:
        for drafter in (a, b):
            tiny_engine.drafter = drafter
            out = tiny_engine.generate("def add(a, b):", max_new_tokens=24, method="dflash", ignore_eos=True)
            traces.append(([r.committed for r in out.stats.rounds], out.token_ids))
    finally:
        tiny_engine.drafter = original
    assert traces[0] == traces[1]
    ids = torch.tensor(tiny_engine.encode("def add(a, b):"))
    cache_a, cache_b = a.new_cache(64), b.new_cache(64)
    features = torch.randn(len(ids), a.fc.in_features)
    cache_a.features[:len(ids)] = cache_b.features[:len(ids)] = features
    assert torch.equal(a.draft(tiny_engine.target, 5, len(ids), cache_a),
                       b.draft(tiny_engine.target, 5, len(ids), cache_b))


def test_a_last_layer_id_is_refused_naming_the_convention(tiny_engine, tiny_pair, tmp_path):
    layers = tiny_engine.target.cfg.geometry.num_layers
    spec = as_speculators(tiny_pair[1], tmp_path / "spec", aux_ids=[layers])  # vLLM's pre-norm last layer
    with pytest.raises(CheckpointError, match="before the final norm"):
        Drafter.load(spec, tiny_engine.target)


def test_other_speculators_types_and_bad_ids_are_refused(tiny_pair, tmp_path):
    raw = json.loads(as_speculators(tiny_pair[1], tmp_path / "spec").joinpath("config.json").read_text())
    with pytest.raises(CheckpointError, match="not a DFlash drafter"):
        DrafterConfig.from_dict({**raw, "speculators_model_type": "eagle3"})
    with pytest.raises(CheckpointError, match="must be >= 1"):
        DrafterConfig.from_dict({**raw, "aux_hidden_state_layer_ids": [0, 2]})
