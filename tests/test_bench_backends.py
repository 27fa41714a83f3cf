"""`ddscope bench sweep --url` against in-process fake SGLang, vLLM and llama.cpp servers.

The fakes (tests/support/bench_fakes.py) are built from the released servers' sources; acceptance is
planted per prompt length (2.5 at context 16, 4.0 at 48), so every record is checked against the
value planted for its own request.
"""
from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from fastapi.responses import JSONResponse

from ddscope.bench.collecting.backends import parse_metrics
from ddscope.cli import main
from support.bench_fakes import (TOKENS, VLLM_DECODE_S, app_with, completion, delivered, llamacpp_app, openai_error,
                                 plain_app, planted, serve, sglang_app, usage, vllm_app)


def run(flags: list[str]) -> int:
    return main(["bench", "sweep", *flags])


def partial(out: Path) -> Path:
    """Where a run that fails or stops early leaves its files: `out` keeps the last complete run."""
    return out.with_name(f"{out.name}.partial")


def sweep(url: str, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    code = run(["--url", url, "--contexts", "16,48", "--max-tokens", str(TOKENS), "--repeats", "2",
                "--warmup", "1", "--out", str(out), *extra])
    return code, json.loads(((out if code == 0 else partial(out)) / "results.json").read_text())


def llama_exact(n_prompt: int) -> float:
    return 3.0 if n_prompt < 32 else 4.5  # 1 + accepted / drafted steps: 1 + 12/6, 1 + 14/4


def llama_timings(n_prompt: int) -> float:
    return TOKENS / (TOKENS - (12 if n_prompt < 32 else 14))  # predicted_n / (predicted_n - accepted)


def llama_delivered(n_prompt: int) -> float:
    # 19 tokens after the prefill one, in the drafted steps plus one undrafted last step: 19/7, 19/5
    return (TOKENS - 1) / (7 if n_prompt < 32 else 5)


CASES = [
    # app, backend, source name, kind, approximate, delivered avg_commit, the server's own figure
    (lambda: sglang_app(), "sglang", "sglang.sglext", "per_request", False, delivered, planted),
    (lambda: sglang_app(sglext=False), "sglang", "sglang.generate", "per_request", False, delivered, planted),
    (lambda: sglang_app(sglext=False, generate=False), "sglang", "sglang.counters", "counter_delta", False, delivered,
     planted),
    (lambda: sglang_app(sglext=False, generate=False, counters=False), "sglang", "sglang.gauge", "windowed_gauge", True,
     None, lambda n: 7.7),
    (lambda: sglang_app(sglext=False, generate=False, metrics=False), "sglang", "sglang.server_info", "lifetime", True,
     None, lambda n: 1.9),
    (lambda: vllm_app(per_request=True), "vllm", "vllm.response", "per_request", False, delivered, planted),
    (lambda: vllm_app(), "vllm", "vllm.counters", "counter_delta", False, delivered, planted),
    (lambda: llamacpp_app(), "llamacpp", "llamacpp.counters", "counter_delta", False, llama_delivered,
     llama_exact),
    (lambda: llamacpp_app(counters=False), "llamacpp", "llamacpp.timings", "per_request", True, llama_delivered,
     llama_timings),
    (lambda: llamacpp_app(counters=False, timings_draft=False, legacy=True), "llamacpp",
     "llamacpp.legacy_counters", "counter_delta", True, llama_delivered, llama_timings),
]


@pytest.mark.parametrize("make_app, backend, name, kind, approximate, truth, server", CASES,
                         ids=[c[2] for c in CASES])
def test_acceptance_source_per_backend(tmp_path, capsys, make_app, backend, name, kind, approximate, truth, server):
    """Delivered avg_commit wherever the source counts verify steps; the server's figure beside it."""
    with serve(make_app()) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 0
    assert doc["status"] == "complete" and doc["backend"]["name"] == backend
    source = doc["acceptance_source"]
    assert (source["name"], source["kind"], source["approximate"], source["includes_bonus"]) == \
        (name, kind, approximate, True)
    assert source["definition"]
    records = doc["records"]
    assert len(records) == 4 and not any(r["error"] for r in records)
    for r in records:
        assert r["completion_tokens"] == TOKENS
        assert r["server_avg_commit"] == pytest.approx(server(r["prompt_tokens"]), rel=0.01)
        expected = truth or server  # sources without a step count give the server's figure
        assert r["avg_commit"] == pytest.approx(expected(r["prompt_tokens"]), rel=0.01)
        assert r["avg_commit_basis"] == ("delivered" if truth else "server")
        assert r["step_ms"] == pytest.approx(1000 * r["avg_commit"] / r["tok_per_s"])
        assert r["ended_at"] > r["started_at"] > 0  # wall clock, for matching server logs
    assert name in capsys.readouterr().out
    assert (tmp_path / "report.md").read_text().count(name) == 1


def test_sglang_ignoring_unknown_fields_gives_exact_acceptance_not_gauge_or_lifetime(tmp_path, capsys):
    """A build of SGLang answers 200 to return_spec_tokens_details it does not support (no sglext), exposes a
    stale gauge (7.7) and a lifetime average (1.9): the bench must find the exact per-request count
    on /generate and say why the OpenAI-route sources were refused."""
    app = sglang_app(sglext=False)
    with serve(app) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 0
    assert doc["acceptance_source"]["name"] == "sglang.generate" and not doc["acceptance_source"]["approximate"]
    assert doc["backend"]["route"].endswith("/generate")
    by_ctx = {r["context"]: r["avg_commit"] for r in doc["records"]}
    assert by_ctx[16] == pytest.approx(19 / 8, rel=0.01) and by_ctx[48] == pytest.approx(19 / 5, rel=0.01)
    refused = doc["acceptance_refused"]
    assert set(refused) == {"sglang.sglext", "sglang.meta_info"}
    assert "sglext.spec_tokens_details" in refused["sglang.sglext"]
    printed = capsys.readouterr().out
    assert "refused sglang.sglext" in printed and "sglang.generate" in printed
    assert app.state.get_server_info_calls == 0  # the deprecated route is not needed


def test_sglang_counters_when_generate_is_unreachable(tmp_path, capsys):
    with serve(sglang_app(sglext=False, generate=False)) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 0 and doc["acceptance_source"]["name"] == "sglang.counters"
    assert not doc["acceptance_source"]["approximate"]
    assert "/generate failed: HTTP 404" in doc["acceptance_refused"]["sglang.generate"]
    for r in doc["records"]:
        assert r["avg_commit"] == pytest.approx(delivered(r["prompt_tokens"]), rel=0.01)


def test_sglang_lifetime_average_comes_from_server_info_not_the_deprecated_route(tmp_path, capsys):
    app = sglang_app(sglext=False, generate=False, metrics=False)
    with serve(app) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 0 and doc["acceptance_source"]["name"] == "sglang.server_info"
    assert doc["acceptance_source"]["approximate"]
    assert app.state.get_server_info_calls == 0  # /get_server_info warns on every call


def test_llamacpp_rounded_counters_are_detected_and_reported(tmp_path, capsys):
    """A long-running llama-server prints its counters as 5.00002e+06: the delta would be noise, so
    the counters are refused with the reason, and the next source is used."""
    with serve(llamacpp_app(base=5e6)) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 0
    assert doc["acceptance_source"]["name"] == "llamacpp.timings"
    reason = doc["acceptance_refused"]["llamacpp.counters"]
    assert "%g-rounded" in reason and "6 significant digits" in reason
    assert "%g-rounded" in capsys.readouterr().out


def test_llamacpp_clamps_default_contexts_to_n_ctx(tmp_path):
    """/v1/models has no max_model_len on llama.cpp: the per-slot context is meta.n_ctx."""
    with serve(llamacpp_app(n_ctx=60)) as url:
        code = run(["--url", url, "--max-tokens", str(TOKENS), "--repeats", "1", "--warmup", "0",
                    "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert code == 0 and doc["backend"]["max_model_len"] == 60
    assert doc["config"]["contexts"] == [13, 40]
    assert not any(r["error"] for r in doc["records"])


def test_vllm_says_whether_tok_per_s_includes_prefill(tmp_path):
    """Without per-request timing the rate includes prefill, and the results say so; with
    --enable-per-request-metrics the decode-only rate (first to last token) is used."""
    slow_prefill = 0.004  # s per prompt token: 0.19 s at 48 tokens against 0.02 s of decode
    with serve(vllm_app(prefill_s_per_token=slow_prefill)) as url:
        _, plain = sweep(url, tmp_path / "plain")
    with serve(vllm_app(timing=True, prefill_s_per_token=slow_prefill)) as url:
        _, timed = sweep(url, tmp_path / "timed")
    assert plain["tok_per_s"]["includes_prefill"] is True and plain["tok_per_s"]["basis"] == "client_latency"
    assert timed["tok_per_s"]["includes_prefill"] is False and timed["tok_per_s"]["basis"] == "server_decode"
    for r in timed["records"]:  # the decode rate is the server's own clock's, first to last token
        assert r["tok_per_s_basis"] == "server_decode"
        assert r["tok_per_s"] == pytest.approx((r["completion_tokens"] - 1) / VLLM_DECODE_S)
    assert all(r["tok_per_s"] == pytest.approx(r["e2e_tok_per_s"]) for r in plain["records"])


def test_no_acceptance_means_tok_per_s_only(tmp_path, capsys):
    with serve(plain_app()) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 0
    assert doc["backend"]["name"] == "openai" and doc["acceptance_source"]["kind"] == "none"
    assert all(r["tok_per_s"] > 0 and r["avg_commit"] is None and r["step_ms"] is None for r in doc["records"])
    out = capsys.readouterr().out
    assert "tok/s only" in out


def test_exact_token_id_prompts_with_tokenizer(tmp_path, capsys):
    from ddscope.bench.synthetic_models import save_tiny_tokenizer

    tok_dir = tmp_path / "tok"
    save_tiny_tokenizer(tok_dir)
    with serve(vllm_app()) as url:
        code, doc = sweep(url, tmp_path / "out", "--tokenizer", str(tok_dir), "--workload", "code")
    assert code == 0 and doc["backend"]["prompt_format"] == "token_ids"
    assert [r["prompt_tokens"] for r in doc["records"]] == [16, 16, 48, 48]
    assert {r["label"] for r in doc["records"]} == {"code"}


def test_server_errors_are_recorded_and_the_sweep_goes_on(tmp_path, capsys):
    calls = {"n": 0}

    def flaky(body: dict[str, Any]) -> dict[str, Any] | JSONResponse:
        calls["n"] += 1
        return openai_error("prompt too long") if usage(body)["prompt_tokens"] > 30 else completion(body)

    app = app_with({"data": [{"id": "fake", "owned_by": "someone"}]}, None, flaky)
    with serve(app) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 0  # some points were measured
    assert doc["errors"] == {"HTTP 400: prompt too long": 2}
    assert [bool(r["error"]) for r in doc["records"]] == [False, False, True, True]
    assert "prompt too long" in capsys.readouterr().out


def test_nothing_measured_exits_non_zero(tmp_path, capsys):
    app = app_with({"data": [{"id": "fake"}]}, None,
                   lambda body: completion(body) if body["max_tokens"] < TOKENS else openai_error("boom"))
    with serve(app) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 1 and doc["errors"] == {"HTTP 400: boom": 4}
    assert "no point could be measured" in capsys.readouterr().err
    assert len((partial(tmp_path) / "results.csv").read_text().splitlines()) == 5  # header + 4 error rows
    assert not any(tmp_path.iterdir())


def test_parse_metrics_sums_label_sets_and_drops_created():
    text = ('# TYPE vllm:spec_decode_num_drafts_total counter\n'
            'vllm:spec_decode_num_drafts_total{engine="0"} 3\n'
            'vllm:spec_decode_num_drafts_total{engine="1"} 4\n'
            'vllm:spec_decode_num_drafts_created{engine="0"} 1.7e9\n')
    assert parse_metrics(text).values == {"vllm:spec_decode_num_drafts_total": [3.0, 4.0]}


def test_server_lost_mid_sweep_aborts_with_reason(tmp_path, capsys, monkeypatch):
    import ddscope.bench.running.sweep as sweep_mod

    with socket.socket() as s:  # a port nobody listens on: what a killed server's address answers
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    real_post, calls = sweep_mod.post, {"n": 0}

    def post(client: Any, url: str, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] >= 4:  # probe, warmup, 1 timed request, then the server is gone
            url = dead + url[url.index("/", len("http://")):]
        return real_post(client, url, *args, **kwargs)

    monkeypatch.setattr(sweep_mod, "post", post)
    with serve(vllm_app()) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 1 and calls["n"] == 4  # stopped at the first refused connection, no retries
    assert doc["status"] == "aborted" and "ConnectError" in doc["abort_reason"]
    assert [r["error"] is None for r in doc["records"]] == [True, False]
    assert "status: aborted (the server stopped answering" in (partial(tmp_path) / "report.md").read_text()
    assert "aborted" in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_ctrl_c_leaves_valid_files(tmp_path, capsys, monkeypatch):
    import ddscope.bench.running.sweep as sweep_mod

    real_post, calls = sweep_mod.post, {"n": 0}

    def post(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 5:  # probe, warmup, 2 timed requests at the first context, then Ctrl-C
            raise KeyboardInterrupt
        return real_post(*args, **kwargs)

    monkeypatch.setattr(sweep_mod, "post", post)
    with serve(vllm_app()) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 1 and doc["status"] == "interrupted"
    assert [r["context"] for r in doc["records"]] == [16, 16]
    assert len((partial(tmp_path) / "results.csv").read_text().splitlines()) == 3
    assert "status: interrupted" in (partial(tmp_path) / "report.md").read_text()
    assert "aborted: interrupted" in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_rounding_is_read_from_the_printed_digits():
    """`%g` keeps 6 significant digits (llama.cpp); prometheus_client prints them all."""
    text = ("# TYPE llamacpp:spec_decode_num_drafts_total counter\n"
            "llamacpp:spec_decode_num_drafts_total 1.23457e+06\n"
            "# TYPE vllm:spec_decode_num_drafts_total counter\n"
            'vllm:spec_decode_num_drafts_total{engine="0"} 1.234567e+06\n'
            "# TYPE llamacpp:tokens_predicted_total counter\n"
            "llamacpp:tokens_predicted_total 999999\n")
    scrape = parse_metrics(text)
    assert "llamacpp:spec_decode_num_drafts_total" in scrape.rounded
    assert "llamacpp:tokens_predicted_total" not in scrape.rounded
    assert "vllm:spec_decode_num_drafts_total" not in scrape.rounded
    assert scrape.values["vllm:spec_decode_num_drafts_total"] == [1234567.0]


def test_prompts_differ_across_warmups_repeats_and_first_prompt(tmp_path):
    """Timed real prompts never repeat a warm-up's (a prefix cache would serve them), and sweeps with other
    --first-prompt values send other prompts; every record carries a digest of its text."""
    from ddscope.bench.synthetic_models import save_tiny_tokenizer

    tok_dir = tmp_path / "tok"
    save_tiny_tokenizer(tok_dir)
    sent: list[str] = []

    def complete(body: dict[str, Any]) -> dict[str, Any]:
        sent.append(json.dumps(body["prompt"]))
        return completion(body)

    timed: dict[int, set[str]] = {}
    with serve(app_with({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "x"}]}, None,
                        complete)) as url:
        for first in (0, 4):
            sent.clear()
            code, doc = sweep(url, tmp_path / f"out{first}", "--tokenizer", str(tok_dir), "--workload", "code",
                              "--first-prompt", str(first))
            assert code == 0
            assert all(len(r["text_sha1"]) == 16 for r in doc["records"])
            warm = {sent[i] for i in (1, 4)}  # after the probe: warm-up, 2 timed, per context
            timed[first] = {sent[i] for i in (2, 3, 5, 6)}
            assert len(timed[first]) == 4 and not warm & timed[first]
    assert not timed[0] & timed[4]
