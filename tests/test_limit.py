"""The physical floor (ddscope.bench.limit): byte and FLOP counts against hand-computed configs, the
expected-experts formula, hardware, the CLI's JSON and errors, and the mission's deployment read against it."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddscope.bench.limit import (CARDS, ConfigError, FloorError, HardwareError, break_even, experts_touched, floor_line,
                                 hardware_named, model_shape, step_floor)
from ddscope.bench.limit.hardware import Hardware, parse_custom

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENT_CONFIG = ROOT / "docs/examples/deepseek-v3-int4.config.json"
DEPLOYMENT_SWEEP = ROOT / "docs/examples/deployment-sweep.csv"
FLAT = Hardware("flat", 1.0, {"bf16": 1e-2, "fp32": 1e-2, "fp8": 2e-2}, 1.0)  # 1 GB/s, 10 GFLOP/s, 1 GB/s link

DENSE = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100,
         "torch_dtype": "bfloat16", "tie_word_embeddings": False}
MOE = {**DENSE, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "decoder_sparse_step": 1, "mlp_only_layers": []}
MLA = {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
       "intermediate_size": 128, "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
       "n_shared_experts": 1, "first_k_dense_replace": 1, "vocab_size": 100, "torch_dtype": "bfloat16"}


# ---- counts against hand-computed configs ---------------------------------------------------------------

def test_dense_gqa_bytes_and_flops_by_hand():
    shape = model_shape(DENSE)
    attention = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64)  # q, k, v (2 KV heads of 16), o; two layers
    mlp = 2 * 3 * 64 * 128
    head = 100 * 64
    assert shape.params == attention + mlp + 2 * head  # embedding and head untied
    f = step_floor(shape, FLAT, context=100)
    assert f.parts["weight_bytes"] == (attention + mlp + head) * 2 + 64 * 2  # the token's embedding row
    kv_read, kv_write = 2 * 100 * (2 * 2 * 16) * 2, 2 * (2 * 2 * 16) * 2
    assert f.parts["kv_bytes"] == kv_read + kv_write
    assert f.parts["linear_flops"] == 2 * (attention + mlp + head)
    assert f.parts["attention_flops"] == 4 * 4 * 16 * 100 * 2  # QK and PV, 4 heads of 16, 100 tokens, 2 layers
    assert f.parts["allreduce_bytes"] == 0
    assert f.bound == "memory"
    assert f.floor_ms == pytest.approx(1e3 * (f.parts["weight_bytes"] + f.parts["kv_bytes"]) / 1e9)


def test_a_prefill_counts_its_causal_attention_among_its_own_tokens():
    shape = model_shape(DENSE)
    plain = step_floor(shape, FLAT, context=0, nodes=64)
    chain = step_floor(shape, FLAT, context=0, nodes=64, causal=True)
    assert plain.parts["attention_flops"] == 0
    assert chain.parts["attention_flops"] == 4 * 4 * 16 * sum(range(1, 65)) * 2  # token i sees i keys, 2 layers
    assert chain.parts["linear_flops"] == plain.parts["linear_flops"] and chain.floor_ms > plain.floor_ms


def test_moe_reads_the_experts_its_tokens_touch():
    shape = model_shape(MOE)
    experts = 2 * 8 * 3 * 64 * 32  # two MoE layers of 8 experts
    dense = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64) + 2 * 64 * 8 + 100 * 64  # attention, routers, head
    one = step_floor(shape, FLAT, context=0, nodes=1)
    four = step_floor(shape, FLAT, context=0, nodes=4)
    assert one.parts["experts_touched"] == pytest.approx(2)  # one token: its top-k
    assert four.parts["experts_touched"] == pytest.approx(8 * (1 - (6 / 8) ** 4))
    assert one.parts["weight_bytes"] == pytest.approx((dense + experts * 2 / 8) * 2 + 64 * 2)
    assert four.parts["weight_bytes"] == pytest.approx((dense + experts * four.parts["experts_touched"] / 8) * 2
                                                       + 4 * 64 * 2)
    # each token computes with its k experts only
    assert four.parts["linear_flops"] == pytest.approx(4 * 2 * (dense + experts * 2 / 8))
    lower = step_floor(shape, FLAT, context=0, nodes=4, routing="lower")
    assert lower.parts["experts_touched"] == 2 and lower.floor_ms < four.floor_ms


def test_mla_latent_cache_and_attention_forms_by_hand():
    shape = model_shape(MLA)
    att = shape.attention
    assert (att.kind, att.kv_width) == ("mla", 16 + 8)  # the latent and its rope part, per token per layer
    f = step_floor(shape, FLAT, context=1000, nodes=2)
    assert f.parts["kv_bytes"] == 2 * 1000 * 24 * 2 + 2 * 2 * 24 * 2
    # absorbed: scores over latent + rope, values over the latent, per head, per token, per layer
    assert f.parts["attention_flops"] == 2 * 2 * 4 * (2 * 16 + 8) * 1000 * 2
    naive = step_floor(shape, FLAT, context=1000, nodes=2, mla="naive")
    expand = 2 * 1000 * 16 * 4 * (8 + 16) * 2  # the latent expanded to K and V, once per sequence per layer
    assert naive.parts["attention_flops"] == expand + 2 * 2 * 4 * (16 + 16) * 1000 * 2
    # under tensor parallelism every rank reads the whole latent, and the heads' work splits
    two = step_floor(shape, Hardware("flat2", 1.0, {"bf16": 1e-3}, 1.0), context=1000, nodes=2, gpus=2)
    assert two.parts["kv_bytes"] == f.parts["kv_bytes"]
    assert two.parts["attention_flops"] == f.parts["attention_flops"] / 2


def test_gqa_heads_split_over_ranks_and_replicate_below_one():
    shape = model_shape(DENSE)  # 2 KV heads
    one = step_floor(shape, FLAT, context=1000, gpus=1)
    assert step_floor(shape, FLAT, context=1000, gpus=2).parts["kv_bytes"] == one.parts["kv_bytes"] / 2
    four = step_floor(shape, FLAT, context=1000, gpus=4)  # one KV head per rank, replicated
    assert four.parts["kv_bytes"] > one.parts["kv_bytes"] / 4


def test_int4_groups_and_ignore_list_per_module():
    cfg = {**MLA, "quantization_config": {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32,
                                                                    "symmetric": True, "type": "int"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}}
    shape = model_shape(cfg)
    sizes = {w.part: w.bytes_per_param for w in shape.weights}
    assert sizes["experts"] == 0.5 + 2 / 32  # 4 bits and a bf16 scale per 32
    assert sizes["attention"] == sizes["shared_experts"] == sizes["mlp"] == sizes["lm_head"] == 2.0
    gptq = model_shape({**DENSE, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                         "sym": False}})
    sizes = {w.part: w.bytes_per_param for w in gptq.weights}
    assert sizes["attention"] == 0.5 + (2 + 0.5) / 128 and sizes["lm_head"] == 2.0
    fp8 = model_shape({**DENSE, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                        "activation_scheme": "dynamic"}})
    w = next(w for w in fp8.weights if w.part == "mlp")
    assert (w.bytes_per_param, w.flops_dtype) == (1 + 4 / 128 ** 2, "fp8")


@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek_v3"])
def test_parameter_counts_equal_a_real_models(tmp_path, arch):
    """Every matrix of an instantiated HF model is counted (1-D norms and biases are left out of the floor)."""
    import torch

    from ddscope.bench.synthetic_models import make_target

    directory = make_target(tmp_path / arch, arch)
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(str(directory))
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    shape = model_shape(json.loads((directory / "config.json").read_text()), dtype="float32")
    assert shape.params == matrices
    assert shape.attention.kind == ("mla" if arch == "deepseek_v3" else "gqa")
    del torch


# ---- the expected-experts formula ----------------------------------------------------------------------

def test_experts_touched_matches_a_simulation():
    rng = random.Random(0)
    for experts, k, tokens in ((384, 8, 32), (64, 6, 8), (8, 2, 3)):
        trials = [len({e for _ in range(tokens) for e in rng.sample(range(experts), k)}) for _ in range(4000)]
        assert experts_touched(experts, k, tokens) == pytest.approx(sum(trials) / len(trials), rel=0.01)
    assert experts_touched(384, 8, 1) == pytest.approx(8)
    assert experts_touched(384, 8, 10_000) == pytest.approx(384)
    assert experts_touched(384, 8, 32) == pytest.approx(384 * (1 - (1 - 8 / 384) ** 32))  # about half


# ---- hardware ----------------------------------------------------------------------------------------------

def test_the_named_cards_are_all_there_and_custom_parses():
    assert {"h100", "h100-pcie", "h200", "b200", "b300", "rtx-pro-6000", "l40s", "a100", "mi300x", "mi325x",
            "rtx-5090"} <= set(CARDS)
    hw = parse_custom("custom:bw=1000,flops=200,link=50")
    assert (hw.bandwidth_gbps, hw.tflops["bf16"], hw.link_gbps) == (1000, 200, 50)
    with pytest.raises(HardwareError, match="known: h100"):
        hardware_named("h300")
    with pytest.raises(HardwareError, match="expected custom:"):
        hardware_named("custom:bw=1000")


def test_floors_order_by_bandwidth_where_weights_dominate():
    shape = model_shape(json.loads(DEPLOYMENT_CONFIG.read_text()))
    floors = {name: step_floor(shape, hw, context=13, nodes=1).floor_ms for name, hw in CARDS.items()}
    by_bandwidth = sorted(CARDS, key=lambda n: -CARDS[n].bandwidth_gbps)
    assert sorted(floors, key=floors.get) == sorted(by_bandwidth, key=lambda n: floors[n])
    for fast, slow in zip(by_bandwidth, by_bandwidth[1:]):
        assert floors[fast] <= floors[slow]
        assert step_floor(shape, CARDS[fast], context=13).bound == "memory"


def test_host_is_measured_once_and_cached(tmp_path, monkeypatch):
    from ddscope.bench.limit import hardware as hw_module

    monkeypatch.setenv("DDSCOPE_CACHE", str(tmp_path))
    calls = []
    real = hw_module.measure_host
    monkeypatch.setattr(hw_module, "measure_host", lambda threads: calls.append(threads) or real(threads))
    first = hw_module.host(1)
    assert first.bandwidth_gbps > 1 and first.tflops["fp32"] > 0.001 and "bf16" in first.tflops
    assert hw_module.host(1) == first and calls == [1]
    assert list(tmp_path.glob("host-floor-*.json"))
    from ddscope.models import native

    assert set(first.measured["tflops_by"]) == {"fp32", "bf16"}  # kernels.c's loops where it is loaded
    by = first.measured["tflops_by"]  # widened bf16 takes torch's matmul where it is the faster
    assert ("loop" in by["fp32"]) == (native.library() is not None)
    assert ("loop" in by["bf16"]) == (native.library() is not None) or native.bf16_products() == "widened"
    assert first.bandwidth_gbps == max(first.measured["read_gbps"].values())  # a product's read or a read alone


def test_the_host_keeps_its_best_rates_and_a_beaten_floor_is_measured_again(tmp_path, monkeypatch):
    """A measurement taken while the machine was busy (here: a low one, then a fast one) never lowers the floor
    below the best rates seen; a step that beats the host's floor has the host measured again, and what is
    still beaten is called a floor to re-measure, never a wrong model."""
    from dataclasses import replace

    from ddscope.bench.judging.analyze import analyze
    from ddscope.bench.judging.floor_verdict import BEATEN_HOST, against_floor
    from ddscope.bench.limit import hardware as hw_module
    from ddscope.bench.limit.floor import FloorSpec
    from ddscope.bench.limit.shape import load_shape
    from ddscope.bench.synthetic_models import make_target

    monkeypatch.setenv("DDSCOPE_CACHE", str(tmp_path))
    slow = hw_module.Hardware("host", 5.0, {"fp32": 0.05, "bf16": 0.05}, measured={"threads": 1})
    fast = replace(slow, bandwidth_gbps=40.0, tflops={"fp32": 1.0, "bf16": 0.02})
    readings = iter([fast, slow])
    monkeypatch.setattr(hw_module, "measure_host", lambda threads: next(readings))
    assert hw_module.host(1) == fast
    kept = hw_module.host(1, remeasure=True)  # the busy reading
    assert kept.bandwidth_gbps == 40.0 and kept.tflops == {"fp32": 1.0, "bf16": 0.05} == hw_module.host(1).tflops

    shape = load_shape(make_target(tmp_path / "t", hidden=256, layers=4))
    rows = [{"label": "padding", "context": c, "prompt_tokens": c, "tok_per_s": 1e6, "avg_commit": 2.0,
             "nodes_per_step": 8.0} for c in (16, 512)]  # a 0.002 ms step: below any floor
    remeasured = []
    monkeypatch.setattr(hw_module, "measure_host", lambda threads: remeasured.append(threads) or fast)
    notes = against_floor(analyze(rows), FloorSpec(shape, kept))["notes"]
    assert remeasured == [1] and notes and all(BEATEN_HOST in n for n in notes if "beats" in n)
    assert not any("that is a wrong model" in n for n in notes)


@pytest.mark.parametrize("kind, most", [("fp32", 2 * 16 * 2 * 6e9), ("bf16", 1024 * 6e9)])
def test_the_units_peak_loops_count_their_flops(kind, most):
    """kernels.c's register-only loops run and are not optimised away: on one thread they stay under what
    the units could retire at 6 GHz (two 16-lane FMA ports; AMX's 1024 FLOPs a cycle)."""
    from ddscope.bench.limit import hardware as hw_module
    from ddscope.models import peaks

    if peaks.units(kind) is None:
        pytest.skip("kernels.c is not loaded here (DDSCOPE_NATIVE=0, or no C compiler)")
    assert 1e9 < hw_module._loop_tflops(kind, 1) * 1e12 <= most


def test_the_read_loop_reads_what_it_is_given():
    """kernels.c's read alone sums each thread's share (so the loads are not optimised away) and is timed at
    no more than one 64-byte line a cycle at 6 GHz a thread, far past any memory's rate."""
    from ddscope.models import peaks

    read = peaks.read()
    if read is None:
        pytest.skip("kernels.c is not loaded here (DDSCOPE_NATIVE=0, or no C compiler)")
    data = torch.ones(2 * 128 * 4096)
    data[-1] = 3.0
    start = time.perf_counter()
    assert read(data, 2) == [data.numel() / 2, data.numel() / 2 + 2]
    assert data.numel() * 4 / (time.perf_counter() - start) < 2 * 64 * 6e9


# ---- refusals ----------------------------------------------------------------------------------------------

def test_a_missing_field_or_unknown_architecture_is_refused_by_name():
    with pytest.raises(ConfigError, match="'hidden_size'"):
        model_shape({k: v for k, v in DENSE.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="'qk_rope_head_dim'"):
        model_shape({k: v for k, v in MLA.items() if k != "qk_rope_head_dim"})
    with pytest.raises(ConfigError, match="model_type 'mamba'"):
        model_shape({**DENSE, "model_type": "mamba"})
    with pytest.raises(ConfigError, match="linear_attention"):
        model_shape({**DENSE, "layer_types": ["full_attention", "linear_attention"]})
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes'"):
        model_shape({**DENSE, "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ConfigError, match="'torch_dtype'"):
        model_shape({k: v for k, v in DENSE.items() if k != "torch_dtype"})


def test_gpus_that_do_not_divide_heads_or_experts_are_refused():
    with pytest.raises(FloorError, match="4 attention heads"):
        step_floor(model_shape(DENSE), CARDS["h100"], context=10, gpus=3)
    moe = model_shape({**MOE, "num_attention_heads": 12, "num_key_value_heads": 12, "num_experts": 6})
    with pytest.raises(FloorError, match="6 routed experts"):
        step_floor(moe, CARDS["h100"], context=10, gpus=4)
    with pytest.raises(FloorError, match="no interconnect"):
        step_floor(model_shape(DENSE), Hardware("x", 1.0, {"bf16": 1.0}), context=10, gpus=2)


# ---- the mission's deployment ------------------------------------------------------------------------------

def test_the_deployments_floor_and_break_even():
    shape = model_shape(json.loads(DEPLOYMENT_CONFIG.read_text()))
    assert 1.0e12 < shape.params < 1.05e12  # a 1T model
    hw = CARDS["rtx-pro-6000"]
    f = step_floor(shape, hw, context=13, nodes=32, gpus=8)
    assert 30e9 < f.parts["weight_bytes"] < 45e9  # about half the INT4 experts, a card's share
    assert f.parts["experts_touched"] == pytest.approx(188.2, abs=0.1)
    assert 15 < f.floor_ms < 34 and f.bound == "memory"
    a, b = floor_line(shape, hw, [13, 5553], nodes=32, gpus=8)
    assert a == pytest.approx(f.floor_ms, rel=0.01) and 0 < b * 1000 < 0.5  # well under 1 ms per 1k tokens
    assert break_even(shape, hw, context=13, nodes=32, gpus=8) > 3  # the tree reads many more experts


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddscope.cli", "bench", *argv], capture_output=True, text=True,
                          timeout=120)


def test_analyze_on_the_deployments_table():
    run = _cli("analyze", str(DEPLOYMENT_SWEEP), "--model", str(DEPLOYMENT_CONFIG), "--hardware", "rtx-pro-6000",
               "--gpus", "8", "--nodes", "32", "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    first = next(p for p in doc["points"] if p["prompt_tokens"] == 13)
    assert first["floor_step_ms"] < first["step_ms"] < 2 * first["floor_step_ms"]  # under, not absurdly far
    assert doc["fit"]["b_ms_per_token"] > 10 * doc["limit"]["b_ms_per_token"]
    lever = {(lv["lever"], lv["label"], lv["prompt_tokens"]): lv for lv in doc["levers"]}
    ctx = lever[("step_context", "padding", 5553)]
    assert ctx["tok_per_s_if"] / ctx["tok_per_s"] >= 2
    acc = lever[("acceptance", "reasoning", 5000)]
    assert acc["tok_per_s_if"] / acc["tok_per_s"] == pytest.approx(2.7, abs=0.1)
    assert any("context part" in v and "far from its floor" in v for v in doc["limit_verdict"])
    assert any("fixed part" in v and "close to its floor" in v for v in doc["limit_verdict"])
    assert set(lever.values().__iter__().__next__()) >= {"lever", "label", "prompt_tokens", "tok_per_s",
                                                         "tok_per_s_if"}


def test_limit_json_shape_and_text():
    run = _cli("limit", "--model", str(DEPLOYMENT_CONFIG), "--hardware", "rtx-pro-6000", "--gpus", "8",
               "--nodes", "32", "--contexts", "13,5553", "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert set(doc) >= {"points", "line", "hardware", "model"}
    assert set(doc["line"]) == {"a_ms", "b_ms_per_token"}
    for p in doc["points"]:
        assert set(p) >= {"prompt_tokens", "nodes", "batch", "floor_ms", "parts", "bound", "break_even_commit"}
    assert [p["prompt_tokens"] for p in doc["points"]] == [13, 5553]
    text = _cli("limit", "--model", str(DEPLOYMENT_CONFIG), "--hardware", "h200", "--gpus", "8")
    assert text.returncode == 0 and "break-even" in text.stdout and "floor line" in text.stdout


@pytest.mark.parametrize("argv, message", [
    (("--hardware", "h300"), "known: h100"),
    (("--hardware", "h100", "--gpus", "3"), "does not divide the 64 attention heads"),
    (("--hardware", "h100", "--gpus", "256"), "does not divide"),
])
def test_limit_refuses_bad_input_in_one_line(argv, message):
    run = _cli("limit", "--model", str(DEPLOYMENT_CONFIG), *argv)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr


# ---- no measurement beats its floor, on real runs ------------------------------------------------------------

def test_no_measured_step_beats_its_host_floor(tmp_path):
    """A random Qwen3 of 300 MB in fp32 (past the caches: a 256 MiB matrix-vector product already streams at
    the DRAM rate here) decodes with `ar` and verifies oracle-drafted trees; every step, and every tree's
    verify forward alone, takes at least its floor on this machine as `host` measures it (the faster of the
    session's cached measurement and one taken after the steps: the VM's speed swings within minutes)."""
    from ddscope.bench.limit.hardware import faster, host, measure_host
    from ddscope.bench.limit.shape import load_shape
    from ddscope.bench.synthetic_models import make_drafter, make_target, oracle_engine
    from ddscope.engine import Engine

    target = make_target(tmp_path / "target", "qwen3", hidden=1024, layers=8)
    drafter = make_drafter(tmp_path / "drafter", target, block_size=8)
    engine = Engine.load(target, drafter, max_model_len=1024, kv_cache_mb=64)
    shape = load_shape(target)
    assert shape.params * 4 > 280e6
    prompt = list(range(5, 305))
    outs = {method: eng.generate(prompt, max_new_tokens=24, method=method, budget=16, ignore_eos=True)
            for method, eng in (("ar", engine), ("ddtree", oracle_engine(engine)))}
    hw = faster(host(), measure_host(len(os.sched_getaffinity(0))))  # host()'s threads
    for method, out in outs.items():
        assert out.stats.rounds
        for r in out.stats.rounds:
            floor = step_floor(shape, hw, context=r.ctx_len, nodes=r.nodes + 1).floor_ms
            assert r.verify_ms >= floor, (method, r, floor)
    # the trees were real: drafted, verified and accepted
    assert sum(r.nodes for r in outs["ddtree"].stats.rounds) > 0 and outs["ddtree"].stats.to_dict()["avg_commit"] > 2


def test_sweep_keeps_the_floor_and_analyze_reads_it_back(tiny_pair, tmp_path, capsys):
    """The embedded sweep's steps beside the host floor: none beats it, the tiny pair's step is overhead-bound, and
    the options stay in results.json so `analyze` of that file gives the same floors without being told."""
    from ddscope.cli import main

    target, drafter = tiny_pair
    out = tmp_path / "out"
    assert main(["bench", "sweep", "--target", str(target), "--drafter", str(drafter), "--contexts", "8,128,512",
                 "--max-tokens", "16", "--repeats", "2", "--warmup", "0", "--budget", "32", "--hardware", "host",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "floor ms" in printed and "overhead-bound" in printed
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["floor"]["hardware"] == "host" and doc["backend"]["model_root"] == str(target.resolve())
    assert all(r["nodes_per_step"] > 1 for r in doc["records"])  # the server says how big its trees were
    report = (out / "report.md").read_text()
    assert "## Against the physical floor" in report and "| padding | 8 |" in report
    assert main(["bench", "analyze", str(out / "results.json"), "--json"]) == 0
    analysis = json.loads(capsys.readouterr().out)
    assert analysis["limit"] and analysis["limit_assumed"]["hardware"]["name"] == "host"
    for p in analysis["points"]:
        assert 0 < p["floor_step_ms"] <= p["step_ms"] and p["floor"]["break_even_commit"] >= 1
    assert not any("beats its floor" in n for n in analysis["notes"])
    assert {lv["lever"] for lv in analysis["levers"]} == {"step_fixed", "step_context", "acceptance"}


def test_a_step_below_its_floor_is_called_a_wrong_input(capsys):
    from ddscope.cli import main

    demo = ROOT / "src/ddscope/assets/demo/target"
    assert main(["bench", "analyze", "--point", "13:100000:5", "--point", "2000:50000:5", "--model", str(demo),
                 "--hardware", "custom:bw=10,flops=1", "--nodes", "33", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("beats its floor" in n and "wrong model or a wrong input" in n for n in notes)
    # a point whose tree size nobody knows gets no floor, and says what would give it one
    assert main(["bench", "analyze", "--point", "13:100:5", "--model", str(demo), "--hardware", "h100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["points"][0]["floor_step_ms"] is None and any("pass --nodes" in n for n in doc["notes"])


def test_without_a_loop_the_host_times_a_product_sized_to_about_a_second(monkeypatch):
    """Where kernels.c has no loop, a product is sized from a 256-cube's time: an emulated bf16 matmul (minutes
    at 2048 on a CPU without bf16 instructions) is never run at full size, and each step is announced."""
    from ddscope.bench.limit import hardware as hw_module
    from ddscope.models import peaks

    sizes, said = [], []
    monkeypatch.setattr(peaks, "units", lambda kind: None)
    monkeypatch.setattr(torch, "mm", lambda a, b: sizes.append(len(a)))
    monkeypatch.setattr(hw_module, "_best_s", lambda fn, repeats: (fn(), 0.25 if sizes[-1:] == [256] else 1.0)[1])
    hw = hw_module.measure_host(1, say=said.append)
    assert sizes and max(sizes) == 256 and hw.measured["tflops_by"] == {"fp32": "torch matmul", "bf16": "torch matmul"}
    assert any("memory bandwidth" in s for s in said) and sum("torch's matmul" in s for s in said) == 2
