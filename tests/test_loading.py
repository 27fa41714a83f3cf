"""z-lab drafter layout variants load identically; bad checkpoints and bad inputs fail clearly."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddscope import Engine
from ddscope.bench.synthetic_models import make_drafter, make_target
from ddscope.config import CheckpointError, DrafterConfig, default_target_layer_ids


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("t") / "target", "qwen3")


def drafted(engine: Engine) -> list[int]:
    return engine.generate([5, 6, 7], max_new_tokens=12, method="dflash", ignore_eos=True).token_ids


@pytest.mark.parametrize("nested,prefix", [(True, ""), (False, "model."), (True, "model.")])
def test_layout_variants_load_the_same_weights(tmp_path, target_dir, nested, prefix):
    plain = make_drafter(tmp_path / "plain", target_dir, seed=7)
    variant = make_drafter(tmp_path / "variant", target_dir, seed=7, nested_block_size=nested, prefix=prefix)
    cfg = json.loads((variant / "config.json").read_text())
    assert ("block_size" in cfg["dflash_config"]) == nested
    assert all(k.startswith(prefix) for k in load_file(str(variant / "model.safetensors")))
    a, b = Engine.load(target_dir, plain), Engine.load(target_dir, variant)
    assert a.drafter.block_size == b.drafter.block_size == 8
    for (ka, va), (kb, vb) in zip(a.drafter.state_dict().items(), b.drafter.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert drafted(a) == drafted(b)


def test_target_layer_ids_fall_back_to_spread(tmp_path, target_dir):
    d = make_drafter(tmp_path / "d", target_dir, layers=1)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    parsed = DrafterConfig.from_dict(cfg)
    assert parsed.target_layer_ids == (2,) and parsed.geometry.rope_theta == 1e4
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


def edit_config(directory, **changes):
    cfg = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("dflash_"):
            cfg["dflash_config"][key.removeprefix("dflash_")] = value
        else:
            cfg[key] = value
    (directory / "config.json").write_text(json.dumps(cfg))


def drop_tensor(directory, name):
    path = directory / "model.safetensors"
    state = load_file(str(path))
    del state[name]
    save_file(state, str(path))


@pytest.mark.parametrize("break_it,message", [
    (lambda d: drop_tensor(d, "layers.0.mlp.up_proj.weight"), "missing: ['layers.0.mlp.up_proj.weight']"),
    (lambda d: edit_config(d, dflash_target_layer_ids=[9]), "target_layer_ids [9] out of range"),
    (lambda d: edit_config(d, hidden_size=32, head_dim=8), "drafter hidden_size 32 != target hidden_size 64"),
    (lambda d: edit_config(d, architectures=["Qwen3ForCausalLM"]), "expected architectures ['DFlashDraftModel']"),
    (lambda d: edit_config(d, block_size=None), "block_size missing"),
    (lambda d: edit_config(d, dflash_mask_token_id=10**6), "mask_token_id 1000000 outside the target vocab"),
    (lambda d: (d / "config.json").unlink(), "missing config.json"),
    (lambda d: (d / "model.safetensors").unlink(), "no *.safetensors weights"),
    (lambda d: edit_config(d, intermediate_size=64), "has shape"),
])
def test_drafter_errors_are_clear(tmp_path, target_dir, break_it, message):
    d = make_drafter(tmp_path / "d", target_dir)
    break_it(d)
    with pytest.raises(CheckpointError) as e:
        Engine.load(target_dir, d)
    assert message in str(e.value)


def test_target_errors_are_clear(tmp_path, target_dir):
    with pytest.raises(CheckpointError, match="not found"):
        Engine.load(tmp_path / "nope")
    bad = make_target(tmp_path / "bad", "qwen3")
    edit = json.loads((bad / "config.json").read_text())
    edit["architectures"], edit["model_type"] = ["NoSuchForCausalLM"], "no_such_model"  # neither native nor HF
    (bad / "config.json").write_text(json.dumps(edit))
    with pytest.raises(CheckpointError, match="not supported natively and transformers cannot load it"):
        Engine.load(bad)


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[1, -2]), "token ids must be integers"),
    (dict(prompt=[1, 10**9]), "token ids must be integers"),
    (dict(prompt="hi", method="beam"), "unknown or unavailable method"),
    (dict(prompt="hi", budget=0), "budget must be"),
    (dict(prompt="hi", max_new_tokens=0), "max_new_tokens must be"),
    (dict(prompt="hi", max_new_tokens=10**6), "exceeds max_model_len"),
    (dict(prompt="hi", temperature=-1), "temperature must be"),
    (dict(prompt="hi", top_p=0), "top_p must be"),
    (dict(prompt="hi", top_k=-3), "top_k must be"),
    (dict(prompt="hi", min_tokens=999, max_new_tokens=5), "min_tokens must be"),
])
def test_bad_generation_inputs(tiny_engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine.stream(**kwargs)


def test_ar_only_without_drafter(target_dir):
    engine = Engine.load(target_dir)
    assert engine.methods == ("ar",)
    with pytest.raises(ValueError, match="available: ar"):
        engine.stream("hi", method="ddtree")


def test_generation_config_adds_stop_ids(tmp_path):
    target = make_target(tmp_path / "t", "qwen3")
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert Engine.load(target).eos_ids == (0, 2)
