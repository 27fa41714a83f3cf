"""Engine behaviour around the loop: streaming text, stats consistency, the CLI (stops: test_stops.py)."""
import json
import subprocess
import sys

import pytest

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.cli import main
from ddscope.models.pages import keep_freed
from ddscope.speculative.lookup import LOOKUP_MAX


def test_stats_are_consistent(tiny_engine):
    out = tiny_engine.generate("def add(a, b):", max_new_tokens=40, method="ddtree", budget=8, ignore_eos=True)
    s = out.stats.to_dict()
    assert s["completion_tokens"] == len(out.token_ids) == 40
    assert s["committed_tokens"] == 39  # the first token is the prefill's, not a verify round's
    assert s["avg_commit"] == pytest.approx(s["committed_tokens"] / s["verify_steps"])
    assert sum(int(k) * v for k, v in s["commit_histogram"].items()) == 39
    assert len(s["rounds"]) == s["verify_steps"]
    # the budget counts the drafter's nodes; a prompt-lookup branch adds at most LOOKUP_MAX a round
    assert s["nodes_verified"] == sum(r["nodes"] for r in s["rounds"])
    assert 8 * s["verify_steps"] <= s["nodes_verified"] <= (8 + LOOKUP_MAX) * s["verify_steps"]
    assert s["mean_step_ms"] > 0 and s["decode_tok_per_s"] > 0
    assert [r["ctx_len"] for r in s["rounds"]][0] == s["prompt_tokens"]  # the whole prompt is cached
    json.dumps(s)


def test_ar_commits_one_token_per_step(tiny_engine):
    s = tiny_engine.generate([7, 8, 9], max_new_tokens=25, method="ar", ignore_eos=True).stats.to_dict()
    assert s["verify_steps"] == 24 and s["avg_commit"] == 1.0 and s["nodes_verified"] == 0


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_one_token_comes_from_prefill_alone(tiny_engine, method):
    steps = list(tiny_engine.stream([7, 8, 9], max_new_tokens=1, method=method, ignore_eos=True))
    assert len(steps) == 1 and steps[0].round is None and steps[0].finish_reason == "length"
    s = steps[0].stats.to_dict()
    assert (s["completion_tokens"], s["committed_tokens"], s["verify_steps"]) == (1, 0, 0)
    assert s["avg_commit"] == s["mean_step_ms"] == s["decode_tok_per_s"] == 0.0 and s["commit_histogram"] == {}


def test_first_step_is_the_prefill_token(tiny_engine):
    ref = tiny_engine.generate([7, 8, 9], max_new_tokens=6, method="ar", ignore_eos=True).token_ids
    steps = tiny_engine.stream([7, 8, 9], max_new_tokens=6, method="ddtree", ignore_eos=True)
    first = next(steps)
    assert first.token_ids == ref[:1] and first.round is None and first.stats.verify_steps == 0
    steps.close()


def test_streamed_text_equals_full_decode(tiny_engine):
    steps = list(oracle_engine(tiny_engine).stream("The quick", max_new_tokens=60, method="ddtree", ignore_eos=True))
    ids = [t for s in steps for t in s.token_ids]
    assert max(len(s.token_ids) for s in steps) > 4  # multi-token rounds
    assert "".join(s.text for s in steps) == tiny_engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert [s.finish_reason for s in steps][-1] == "length" and all(s.finish_reason is None for s in steps[:-1])


def test_cli_generate_json(tiny_pair, capsys):
    target, drafter = tiny_pair
    assert main(["generate", "hello", "--target", str(target), "--drafter", str(drafter), "--max-tokens", "12",
                 "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["completion_tokens"] == 12 and len(out["token_ids"]) == 12


def test_cli_reports_bad_checkpoint(tmp_path, capsys):
    assert main(["generate", "x", "--target", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


def test_prefill_token_respects_eos_and_min_tokens(tiny_engine):
    first = tiny_engine.generate([7, 8, 9], max_new_tokens=1, method="ar", ignore_eos=True).token_ids[0]
    saved, tiny_engine.eos_ids = tiny_engine.eos_ids, (first,)
    try:
        out = tiny_engine.generate([7, 8, 9], max_new_tokens=8, method="ddtree")
        assert (out.token_ids, out.finish_reason, out.stats.verify_steps) == ([first], "stop", 0)
        later = tiny_engine.generate([7, 8, 9], max_new_tokens=8, method="ddtree", min_tokens=1)
        assert later.token_ids[0] != first  # EOS masked for the prefill's token too
    finally:
        tiny_engine.eos_ids = saved


@pytest.mark.parametrize("stop", [[""], "ab", [None]])
def test_bad_stop_is_a_value_error(tiny_engine, stop):
    with pytest.raises(ValueError, match="stop must be"):
        tiny_engine.stream("x", stop=stop)


FAULT_PROBE = """
import resource, sys, tempfile
from pathlib import Path
import torch
from ddscope.bench.synthetic_models import make_target
import ddscope.engine.engine as engine_module
if sys.argv[1] == "glibc":  # the engine without pages.keep_freed: glibc's own defaults
    engine_module.keep_freed = lambda: False
target = make_target(Path(tempfile.mkdtemp()) / "t", "qwen3", hidden=256, layers=2, max_len=4096)
engine = engine_module.Engine.load(target, max_model_len=4096, max_prefill_tokens=4096)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def prefills():  # prompts of several lengths, as a server's
    for n in (512, 2048, 1024, 2048):
        engine.generate([3 + i % 300 for i in range(n)], max_new_tokens=2, ignore_eos=True, method="ar")
for _ in range(4):  # freed blocks coalesce over the first rounds (here 1-3 of them), then are reused
    prefills()
before = faults()
prefills()
after = faults()
tensor = []
for _ in range(12):  # 100 MB: past 32 MiB, glibc's defaults map every such tensor afresh
    start = faults()
    big = torch.ones(25 << 20)
    tensor.append(faults() - start)
    del big
print(after - before, *tensor)
"""


@pytest.mark.skipif(sys.platform != "linux" or not keep_freed(), reason="glibc's malloc on Linux")
def test_prefills_reuse_freed_memory_rather_than_fault_it_in_again():
    """A step's activations come back from the engine's heap: prefills like those that ran before fault no page
    in again, and a 100 MB tensor allocated again and again soon faults none. Under glibc's defaults (the
    control) every such tensor's 25,600 pages fault in afresh, each one zeroed; the prefills' faults there vary
    with the allocations before them (1-7,000 here)."""
    def faults(mode: str) -> tuple[int, list[int]]:
        run = subprocess.run([sys.executable, "-c", FAULT_PROBE, mode], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        prefills, *tensor = map(int, run.stdout.split())
        return prefills, tensor

    (kept_prefills, kept_tensor), (_, glibc_tensor) = faults("kept"), faults("glibc")
    assert kept_prefills <= 64, kept_prefills
    assert sum(kept_tensor[3:]) <= 64, kept_tensor  # freed blocks coalesce within a few rounds, then are reused
    assert min(glibc_tensor) >= 25_000, glibc_tensor  # the check can fail: without keep_freed they fault in
