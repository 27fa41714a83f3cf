"""Known-answer tests for `ddscope bench analyze`: fit, decomposition and attribution."""
from __future__ import annotations

import json
import math
from statistics import median
from pathlib import Path

import pytest

from ddscope.bench.errors import AnalysisError
from ddscope.bench.judging.analyze import acceptance_windows, analyze
from ddscope.bench.judging.fit import robust_fit
from ddscope.cli import main

A_MS, B_MS = 20.0, 0.004  # the true step curve: 20 ms + 4 ms per 1k tokens
CONTEXTS = (13, 1663, 3333, 5553)


def step(ctx: float) -> float:
    return A_MS + B_MS * ctx


def row(label: str, ctx: float, commit: float, step_ms: float) -> dict:
    """A measured point whose step time is exactly `step_ms`: tok/s = 1000 * commit / step_ms."""
    return {"label": label, "context": ctx, "prompt_tokens": ctx, "tok_per_s": 1000.0 * commit / step_ms,
            "avg_commit": commit, "engine_step_ms": None, "commits": None}


def baseline(commit: float = 6.0) -> list[dict]:
    return [row("padding", c, commit, step(c)) for c in CONTEXTS]


def only(analysis, label: str, ctx: float):
    [att] = [a for a in analysis.attributions if a.label == label and a.prompt_tokens == ctx]
    return att


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_fit_recovers_the_line_and_resists_an_outlier():
    xs = [0, 1000, 2000, 3000, 4000, 5000, 6000]
    ys = [step(x) for x in xs]
    clean = robust_fit(xs, ys)
    assert clean.a_ms == pytest.approx(A_MS) and clean.b_ms_per_token == pytest.approx(B_MS)
    assert clean.r2 == pytest.approx(1.0)
    ys[3] *= 3  # one stray slow point
    robust = robust_fit(xs, ys)
    assert robust.b_ms_per_token == pytest.approx(B_MS, rel=0.05)
    assert robust.a_ms == pytest.approx(A_MS, rel=0.05)
    assert robust.r2 < 0.9  # R^2 is the honest one for the final line
    assert robust.tok_per_s(4000, 3.0) == pytest.approx(3000.0 / robust.step_ms(4000))


def test_pure_context_scaling():
    """Acceptance flat, step grows on the line: the whole drop along the sweep is context scaling."""
    a = analyze(baseline())
    assert a.fit.a_ms == pytest.approx(A_MS) and a.fit.b_ms_per_token == pytest.approx(B_MS)
    att = only(a, "padding", 5553)
    assert att.acceptance_share == pytest.approx(0.0, abs=1e-9)
    assert att.step_share == pytest.approx(1.0)
    assert att.context_share == pytest.approx(1.0)
    assert att.residual_share == pytest.approx(0.0, abs=1e-9)
    assert att.gap_log == pytest.approx(math.log(step(5553) / step(13)))
    assert "mostly context scaling" in att.verdict


def test_pure_acceptance():
    """Same step curve, half the tokens per step: the gap is all acceptance."""
    rows = baseline(6.0) + [row("code", 3333, 3.0, step(3333))]
    att = only(analyze(rows), "code", 3333)
    assert att.acceptance_share == pytest.approx(1.0)
    assert att.step_share == pytest.approx(0.0, abs=1e-9)
    assert att.gap_log == pytest.approx(math.log(2.0))
    assert att.verdict.startswith("slower by 50% (")
    assert "mostly acceptance: 100% of the gap is acceptance (3.00 vs 6.00 tokens/step)" in att.verdict
    assert "step time is 0% above the baseline curve" in att.verdict


def test_mixed_acceptance_and_step_cost():
    rows = baseline(6.0) + [row("code", 1663, 3.0, 1.5 * step(1663))]
    att = only(analyze(rows), "code", 1663)
    gap = math.log(2.0) + math.log(1.5)
    assert att.acceptance_share == pytest.approx(math.log(2.0) / gap)
    assert att.step_share == pytest.approx(math.log(1.5) / gap)
    assert att.acceptance_share + att.step_share == pytest.approx(1.0)
    assert "step time is 50% above the baseline curve" in att.verdict


def test_residual_extra_step_cost():
    """Acceptance as the baseline, step 30% above the curve at the same context: not context, not acceptance."""
    rows = baseline(6.0) + [row("chat", 4000, 6.0, 1.3 * step(4000))]
    att = only(analyze(rows), "chat", 4000)
    assert att.acceptance_share == pytest.approx(0.0, abs=1e-9)
    assert att.context_share == pytest.approx(0.0, abs=1e-9)
    assert att.residual_share == pytest.approx(1.0)
    assert att.step_vs_curve_pct == pytest.approx(30.0)
    assert "mostly other step cost" in att.verdict
    # baseline commit is interpolated between contexts (flat here), the reference tok/s is the curve's
    assert att.ref_tok_per_s == pytest.approx(6000.0 / step(4000))


def test_single_observed_point_and_on_par():
    rows = baseline(6.0)
    a = analyze(rows + [row("same", 2000, 6.0, step(2000))])
    assert only(a, "same", 2000).verdict.startswith("on par")


def test_acceptance_windows_show_decay():
    wins = acceptance_windows([[4, 4, 4, 4, 2, 2, 1, 1], [4, 4, 4, 4, 2, 2, 1, 1]], window=8)
    # steps start at positions 0, 4, 8, 12, 16, 18, 20, 21
    assert [w["avg_commit"] for w in wins] == [4.0, 4.0, 1.5]
    assert sum(w["steps"] for w in wins) == 16
    with pytest.raises(AnalysisError):
        acceptance_windows([[1]], 0)


def write_csv(path: Path, rows: list[dict]) -> None:
    lines = ["prompt_tokens,tok_per_s,avg_commit,label"]
    lines += [f"{r['prompt_tokens']},{r['tok_per_s']},{r['avg_commit']},{r['label']}" for r in rows]
    path.write_text("\n".join(lines) + "\n")


def test_cli_csv_json_fields(tmp_path, capsys):
    csv_path = tmp_path / "numbers.csv"
    write_csv(csv_path, baseline(6.0) + [row("code", 3333, 3.1, 1.09 * step(3333))])
    code, out, _ = run_cli(["bench", "analyze", str(csv_path), "--json", "--point", "4000:45:3.1"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["baseline"] == "padding"
    assert doc["fit"]["a_ms"] == pytest.approx(A_MS, rel=1e-6)
    assert doc["fit"]["b_ms_per_token"] == pytest.approx(B_MS, rel=1e-6)
    assert doc["fit"]["r2"] == pytest.approx(1.0)
    assert all({"acceptance_share", "step_share", "verdict"} <= set(p) for p in doc["points"])
    [code_pt] = [p for p in doc["points"] if p["label"] == "code"]
    gap = math.log(6.0 / 3.1) + math.log(1.09)
    assert code_pt["acceptance_share"] == pytest.approx(math.log(6.0 / 3.1) / gap)
    assert "of the gap is acceptance (3.10 vs 6.00 tokens/step); step time is 9% above" in code_pt["verdict"]
    [obs] = [p for p in doc["points"] if p["label"] == "point1"]
    assert obs["tok_per_s"] == 45 and obs["avg_commit"] == 3.1 and obs["verdict"]


def test_cli_prediction(tmp_path, capsys):
    csv_path = tmp_path / "numbers.csv"
    write_csv(csv_path, baseline(6.0))
    code, out, _ = run_cli(["bench", "analyze", str(csv_path), "--json", "--predict", "8000:4"], capsys)
    assert code == 0
    [pred] = json.loads(out)["predictions"]
    assert pred["step_ms"] == pytest.approx(step(8000))
    assert pred["tok_per_s"] == pytest.approx(4000.0 / step(8000))


def test_cli_writes_report_from_csv(tmp_path, capsys):
    csv_path = tmp_path / "numbers.csv"
    write_csv(csv_path, baseline(5.0))
    code, out, _ = run_cli(["bench", "analyze", str(csv_path), "--out", str(tmp_path / "rep")], capsys)
    assert code == 0 and "step_ms(ctx)" in out
    assert (tmp_path / "rep" / "sweep.png").stat().st_size > 1000
    assert "## Verdict" in (tmp_path / "rep" / "report.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["bench", "analyze", "missing.csv"], "file not found"),
    (["bench", "analyze", "--point", "4000:fast:3"], "not a number"),
    (["bench", "analyze", "--point", "4000:45"], "CTX:TPS:COMMIT"),
    (["bench", "analyze", "--point", "4000:45:3", "--predict", "8000"], "CTX:COMMIT"),
])
def test_cli_bad_input(argv, message, capsys):
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and message in err


def test_cli_bad_baseline_and_columns(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("ctx,tps\n1,2\n")
    code, _, err = run_cli(["bench", "analyze", str(bad)], capsys)
    assert code != 0 and "lacks CSV column" in err
    good = tmp_path / "good.csv"
    write_csv(good, baseline())
    code, _, err = run_cli(["bench", "analyze", str(good), "--baseline", "nope"], capsys)
    assert code != 0 and "not among the labels" in err


@pytest.mark.parametrize("argv, message", [
    (["bench", "sweep", "--contexts", "13,abc"], "comma-separated integers"),
    (["bench", "sweep", "--repeats", "0"], "must be >= 1"),
    (["bench", "sweep", "--max-tokens", "x"], "expected an integer"),
])
def test_sweep_flag_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli(argv, capsys)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("workload, message", [
    ("poetry", "unknown workload"), ("file:/nonexistent/prompts.jsonl", "workload file not found"),
])
def test_sweep_workload_errors(workload, message, capsys):
    code, _, err = run_cli(["bench", "sweep", "--url", "http://127.0.0.1:9", "--workload", workload], capsys)
    assert code == 2 and message in err


def test_analyze_overlays_results_files_labelled_by_folder(tmp_path, capsys):
    """`analyze old/results.json new/results.json`: the same workload from two runs (say two drafters)
    becomes two curves on one figure, each labelled by its folder; the first file is the baseline."""
    old_rows = [row("padding", c, 9.0 if c == 13 else 1.5, step(c)) for c in CONTEXTS]
    new_rows = [row("padding", c, 8.0, step(c)) for c in CONTEXTS]
    paths = []
    for name, rows in (("old", old_rows), ("new", new_rows)):
        (tmp_path / name).mkdir()
        path = tmp_path / name / "results.json"
        path.write_text(json.dumps({"records": [{**r, "error": None} for r in rows]}))
        paths.append(str(path))
    code, out, _ = run_cli(["bench", "analyze", *paths, "--json", "--out", str(tmp_path / "overlay")], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["baseline"] == "padding [old]"
    curves = {}
    for p in doc["points"]:
        curves.setdefault(p["label"], {})[p["prompt_tokens"]] = p["avg_commit"]
    assert curves == {"padding [old]": {c: 9.0 if c == 13 else 1.5 for c in CONTEXTS},
                      "padding [new]": {c: 8.0 for c in CONTEXTS}}
    new_long = next(p for p in doc["points"] if p["label"] == "padding [new]" and p["prompt_tokens"] == 5553)
    assert new_long["tok_per_s"] > next(p["tok_per_s"] for p in doc["points"]
                                        if p["label"] == "padding [old]" and p["prompt_tokens"] == 5553)
    assert (tmp_path / "overlay" / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "padding [new]" in (tmp_path / "overlay" / "report.md").read_text()


def test_overlay_maps_an_untagged_baseline_and_shows_each_runs_source(tmp_path, capsys):
    """`--baseline padding` on overlaid files means the first file's padding curve (not the default,
    its first curve, here code); the setup lists each run's acceptance source and tok/s basis by tag."""
    sources = {"old": "sglang.generate", "new": "sglang.counters"}
    bases = {"old": "server_decode", "new": "client_latency"}
    paths = []
    for name, source in sources.items():
        (tmp_path / name).mkdir()
        rows = [row("code", 1663, 3.0, step(1663))] + baseline(6.0)
        path = tmp_path / name / "results.json"
        path.write_text(json.dumps({
            "records": [{**r, "error": None} for r in rows],
            "acceptance_source": {"name": source, "kind": "per_request", "approximate": False, "definition": "d"},
            "acceptance_refused": {"sglang.sglext": f"refused in {name}"},
            "tok_per_s": {"basis": bases[name], "includes_prefill": name == "new", "definition": f"def {name}"}}))
        paths.append(str(path))
    code, out, _ = run_cli(["bench", "analyze", *paths, "--baseline", "padding", "--json"], capsys)
    assert code == 0 and json.loads(out)["baseline"] == "padding [old]"
    code, out, _ = run_cli(["bench", "analyze", *paths, "--baseline", "padding"], capsys)
    assert code == 0
    for name, source in sources.items():
        assert f"acceptance [{name}]: {source} [per_request]" in out
        assert f"refused sglang.sglext: refused in {name}" in out
        assert f"tok/s [{name}]: {bases[name]}" in out
    assert "time tok/s differently" in out


def test_poor_fit_withholds_shares_and_says_so():
    """A step curve that does not follow context (R^2 well under 0.5): no shares, a warning, raw ratios."""
    rows = [row("padding", ctx, commit, ms) for ctx, commit, ms in
            ((13, 6.0, 20.0), (1663, 2.0, 30.0), (3333, 6.0, 20.5), (5553, 5.5, 21.0))]
    a = analyze(rows)
    assert a.fit.r2 < 0.5 and any("fit is poor" in n for n in a.notes)
    att = only(a, "padding", 1663)
    assert att.acceptance_share is None and att.context_share is None and att.warning
    assert "shares withheld" in att.verdict and "avg_commit x0.33" in att.verdict
    assert "of the gap" not in att.verdict


def test_shares_outside_range_carry_the_warning():
    """Acceptance up, step time further up: terms pull apart and shares would read 317% and -217%."""
    rows = baseline(2.5) + [row("code", 3333, 4.0, 2.0 * step(3333))]
    att = only(analyze(rows), "code", 3333)
    assert att.warning and "opposite directions" in att.warning and att.acceptance_share is None
    assert "shares withheld" in att.verdict and "avg_commit x1.60" in att.verdict


def test_no_printed_share_is_outside_its_range_without_a_warning():
    """Across many random sweeps, every share printed lies in [-100%, 200%]; beyond it, a warning."""
    import random
    rng = random.Random(7)
    for _ in range(200):
        rows = [row("padding", ctx, rng.uniform(1.5, 9), rng.uniform(10, 40)) for ctx in (13, 1663, 3333, 5553)]
        rows += [row("code", 3333, rng.uniform(1.5, 9), rng.uniform(10, 40))]
        for att in analyze(rows).attributions:
            shares = [s for s in (att.acceptance_share, att.step_share, att.context_share, att.residual_share)
                      if s is not None]
            assert all(-1.0 <= s <= 2.0 for s in shares) or att.warning
            assert att.warning or shares or abs(att.gap_log) < 1e-12


def test_a_share_that_rounds_to_zero_is_never_minus_zero():
    from ddscope.bench.judging.attribution import _pct

    assert (_pct(-0.004), _pct(0.004), _pct(-0.2), _pct(None)) == ("0%", "0%", "-20%", "n/a")


def test_mixed_tree_sizes_are_flagged_not_fitted_in_silence():
    """`auto` sized the trees by context (the issue's 9.9, 2.3, 5.9, 5.7 tokens a step): the note names every point's
    size; a fixed tree (33 at every context) raises no such note."""
    rows = baseline()
    for r, nodes in zip(rows, (9.9, 2.3, 5.9, 5.7)):
        r["nodes_per_step"] = nodes
    flagged = [n for n in analyze(rows).notes if "tree size varied" in n]
    assert len(flagged) == 1 and "2.3 at 1663" in flagged[0] and "9.9 at 13" in flagged[0]
    for r in rows:
        r["nodes_per_step"] = 33.0
    assert not any("tree size varied" in n for n in analyze(rows).notes)


def test_a_run_of_different_prompts_pools_as_the_server_counts_it():
    """Four prompts whose requests commit 13.6, 11.9, 10.6 and 3.3 tokens a step (the issue's vLLM run at 43
    tokens): the point is their tokens over their steps and their decode time over their steps, not the median
    of the four; repeats of one prompt keep their median. Each point says which it is."""
    steps, commits, step_ms = [10, 10, 10, 60], [13.6, 11.9, 10.6, 3.3], [30.0, 40.0, 35.0, 45.0]
    rows = []
    for i, (n, c, ms) in enumerate(zip(steps, commits, step_ms)):
        tokens = round(c * n)
        rows.append({**row("code", 43, tokens / n, ms), "completion_tokens": tokens + 1, "verify_steps": n,
                     "prompt_sha1": f"p{i}"})
    (point,) = analyze(rows).points
    tokens = sum(r["completion_tokens"] - 1 for r in rows)
    assert point.summary == "pooled" and point.avg_commit == pytest.approx(tokens / sum(steps))
    assert point.avg_commit < 8 < median(commits)  # the median would read the 3.3 request as a quarter
    decode_ms = sum(n * ms for n, ms in zip(steps, step_ms))
    assert point.step_ms == pytest.approx(decode_ms / sum(steps))
    for r in rows:
        r["prompt_sha1"] = "same"
    (same,) = analyze(rows).points
    assert same.summary == "median" and same.avg_commit == pytest.approx(median([r["avg_commit"] for r in rows]))
