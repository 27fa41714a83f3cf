"""`ddscope bench sweep --url` against in-process fake SGLang, vLLM and llama.cpp servers.

Each fake is a small FastAPI app on a free 127.0.0.1 port that answers /v1/completions, /v1/models
and /metrics in its engine's documented format (references next to each fake). Every completion is
20 tokens in 8 verify steps, so the right reading is avg_commit 2.5 (bonus token included).
"""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ddscope.bench.backends import parse_metrics
from ddscope.cli import main

TOKENS, STEPS, ACCEPTED = 20, 8, 12  # 8 steps x (accepted + 1 bonus) = 12 + 8 = 20 tokens
AVG = TOKENS / STEPS


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(200):  # bounded wait for startup
        if server.started:
            break
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def usage(body: dict[str, Any]) -> dict[str, int]:
    prompt = body.get("prompt")
    n_prompt = len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt)) // 4)
    return {"prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"],
            "total_tokens": n_prompt + body["max_tokens"]}


def completion(body: dict[str, Any], **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": "x" * body["max_tokens"], "finish_reason": "length"}
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body.get("model", "m"),
            "choices": [{**choice, **extra.pop("choice", {})}], "usage": usage(body), **extra}


def app_with(models: dict[str, Any], metrics: Callable[[], str] | None,
             complete: Callable[[dict[str, Any]], dict[str, Any] | JSONResponse]) -> FastAPI:
    app = FastAPI()
    app.get("/v1/models")(lambda: models)
    if metrics is not None:
        app.get("/metrics", response_class=PlainTextResponse)(metrics)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        got = complete(body)
        return got if isinstance(got, JSONResponse) else JSONResponse(got)
    return app


def openai_error(message: str) -> JSONResponse:
    # OpenAI-shape error, as all three engines answer bad requests.
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}},
                        status_code=400)


def sglang_app(mode: str) -> FastAPI:
    """SGLang.
    - /metrics: https://docs.sglang.io/docs/references/production_metrics (needs --enable-metrics);
      sglang:spec_accept_length / spec_accept_rate are gauges over the last log window.
    - per request on OpenAI routes, `return_spec_tokens_details: true` -> `sglext.spec_tokens_details`
      (python/sglang/srt/entrypoints/openai/utils.py, spec_tokens_details_from_meta_info), or
      `choices[].meta_info` with `return_meta_info`; `spec_verify_ct` counts verify steps.
    - /get_server_info internal_states[].avg_spec_accept_length is lifetime-cumulative
      (https://docs.sglang.io/basic_usage/native_api.html).
    """
    details = {"spec_verify_ct": STEPS, "spec_accept_length": AVG, "spec_accept_rate": ACCEPTED / (STEPS * 3),
               "spec_num_correct_drafts": ACCEPTED, "spec_num_proposed_drafts": STEPS * 3}
    served = {"n": 0}

    def complete(body: dict[str, Any]) -> dict[str, Any] | JSONResponse:
        served["n"] += 1
        if mode == "sglext" and body.get("return_spec_tokens_details"):
            return completion(body, sglext={"spec_tokens_details": details})
        if mode == "meta_info":
            if "return_spec_tokens_details" in body:  # an older build that rejects the field
                return openai_error("return_spec_tokens_details: Extra inputs are not permitted")
            if body.get("return_meta_info"):
                return completion(body, choice={"meta_info": {**details, "completion_tokens": body["max_tokens"]}})
        return completion(body)

    def metrics() -> str:
        lines = ['# HELP sglang:prompt_tokens_total Number of prefill tokens processed.',
                 '# TYPE sglang:prompt_tokens_total counter',
                 f'sglang:prompt_tokens_total{{model_name="fake"}} {100.0 * served["n"]}',
                 '# HELP sglang:num_running_reqs The number of running requests.',
                 '# TYPE sglang:num_running_reqs gauge',
                 'sglang:num_running_reqs{model_name="fake"} 0.0']
        if mode != "lifetime":
            # A windowed gauge: the same value before and after a request; differencing it gives 0.
            lines += ['# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.',
                      '# TYPE sglang:spec_accept_length gauge',
                      'sglang:spec_accept_length{model_name="fake",tp_rank="0"} 3.2',
                      'sglang:spec_accept_length{model_name="fake",tp_rank="1"} 3.0']
        return "\n".join(lines) + "\n"

    app = app_with({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "sglang",
                                                 "max_model_len": 8192}]}, metrics, complete)
    app.get("/get_server_info")(lambda: {"internal_states": [{"avg_spec_accept_length": 2.9}]})
    return app


def vllm_app(mode: str) -> FastAPI:
    """vLLM.
    - per request with --per-request-spec-decode-metrics summary: `metrics.speculative_decoding`
      {mean_acceptance_length = 1 + num_accepted_draft_tokens / num_spec_steps, num_spec_steps, ...}
      https://docs.vllm.ai/en/stable/features/speculative_decoding/acceptance_metrics/
    - /metrics counters vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total, mean
      acceptance length = 1 + accepted / drafts (same page, "Relationship to Prometheus metrics").
    """
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0}

    def complete(body: dict[str, Any]) -> dict[str, Any]:
        totals.update(drafts=totals["drafts"] + STEPS, draft_tokens=totals["draft_tokens"] + 3 * STEPS,
                      accepted=totals["accepted"] + ACCEPTED)
        if mode != "per_request":
            return completion(body)
        spec = {"mean_acceptance_length": 1 + ACCEPTED / STEPS, "draft_acceptance_rate": ACCEPTED / (3 * STEPS),
                "acceptance_histogram": [1, 2, 3, 2], "acceptance_histogram_by_draft_length": {"3": [1, 2, 3, 2]},
                "num_spec_steps": STEPS, "num_accepted_draft_tokens": ACCEPTED, "num_draft_tokens": 3 * STEPS,
                "num_spec_tokens": 3}
        return completion(body, metrics={"speculative_decoding": spec})

    def metrics() -> str:
        lines = []
        for name, key in (("drafts", "drafts"), ("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted")):
            lines += [f"# HELP vllm:spec_decode_num_{name}_total Number of spec decoding {name}.",
                      f"# TYPE vllm:spec_decode_num_{name}_total counter",
                      f'vllm:spec_decode_num_{name}_total{{engine="0",model_name="fake"}} {float(totals[key])}',
                      f'vllm:spec_decode_num_{name}_created{{engine="0",model_name="fake"}} 1.7e9']
        lines += ["# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{model_name="fake"} 0.0']
        return "\n".join(lines) + "\n"

    return app_with({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "vllm",
                                                 "max_model_len": 8192}]}, metrics, complete)


def llamacpp_app(mode: str) -> FastAPI:
    """llama.cpp server (https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md).
    - responses carry `timings` {prompt_n, prompt_ms, predicted_n, predicted_ms, draft_n,
      draft_n_accepted}; there is no verify-step count.
    - /metrics (--metrics): newer builds llamacpp:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total;
      older builds llamacpp:tokens_drafted_total and llamacpp:tokens_drafted_accepted_total.
    """
    totals = {"predicted": 0, "drafts": 0, "drafted": 0, "accepted": 0}

    def complete(body: dict[str, Any]) -> dict[str, Any]:
        for key, inc in (("predicted", TOKENS), ("drafts", STEPS), ("drafted", 3 * STEPS), ("accepted", ACCEPTED)):
            totals[key] += inc
        timings = {"prompt_n": usage(body)["prompt_tokens"], "prompt_ms": 5.0, "predicted_n": TOKENS,
                   "predicted_ms": 80.0, "predicted_per_second": 250.0}
        if mode == "timings":
            timings.update(draft_n=3 * STEPS, draft_n_accepted=ACCEPTED)
        return completion(body, timings=timings)

    def metrics() -> str:
        lines = ["# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.",
                 "# TYPE llamacpp:tokens_predicted_total counter",
                 f"llamacpp:tokens_predicted_total {float(totals['predicted'])}"]
        if mode == "counters":
            lines += ["# TYPE llamacpp:spec_decode_num_drafts_total counter",
                      f"llamacpp:spec_decode_num_drafts_total {float(totals['drafts'])}",
                      "# TYPE llamacpp:spec_decode_num_draft_tokens_total counter",
                      f"llamacpp:spec_decode_num_draft_tokens_total {float(totals['drafted'])}",
                      "# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter",
                      f"llamacpp:spec_decode_num_accepted_tokens_total {float(totals['accepted'])}"]
        if mode == "legacy":
            lines += ["# TYPE llamacpp:tokens_drafted_total counter",
                      f"llamacpp:tokens_drafted_total {float(totals['drafted'])}",
                      "# TYPE llamacpp:tokens_drafted_accepted_total counter",
                      f"llamacpp:tokens_drafted_accepted_total {float(totals['accepted'])}"]
        return "\n".join(lines) + "\n"

    return app_with({"object": "list", "data": [{"id": "model.gguf", "object": "model", "owned_by": "llamacpp",
                                                 "meta": {"n_ctx_train": 8192}}]}, metrics, complete)


def plain_app() -> FastAPI:
    """An OpenAI-compatible server with usage but no acceptance telemetry and no /metrics."""
    return app_with({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "someone"}]},
                    None, completion)


def run(flags: list[str]) -> int:
    return main(["bench", "sweep", *flags])


def sweep(url: str, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    code = run(["--url", url, "--contexts", "16,48", "--max-tokens", str(TOKENS), "--repeats", "2",
                "--warmup", "1", "--out", str(out), *extra])
    return code, json.loads((out / "results.json").read_text())


CASES = [
    # app, backend, source name, kind, approximate, expected avg_commit
    (lambda: sglang_app("sglext"), "sglang", "sglang.sglext", "per_request", False, AVG),
    (lambda: sglang_app("meta_info"), "sglang", "sglang.meta_info", "per_request", False, AVG),
    (lambda: sglang_app("gauge"), "sglang", "sglang.gauge", "windowed_gauge", True, 3.1),
    (lambda: sglang_app("lifetime"), "sglang", "sglang.server_info", "lifetime", True, 2.9),
    (lambda: vllm_app("per_request"), "vllm", "vllm.response", "per_request", False, AVG),
    (lambda: vllm_app("counters"), "vllm", "vllm.counters", "counter_delta", False, AVG),
    (lambda: llamacpp_app("timings"), "llamacpp", "llamacpp.timings", "per_request", True, AVG),
    (lambda: llamacpp_app("counters"), "llamacpp", "llamacpp.counters", "counter_delta", False, AVG),
    (lambda: llamacpp_app("legacy"), "llamacpp", "llamacpp.legacy_counters", "counter_delta", True, AVG),
]


@pytest.mark.parametrize("make_app, backend, name, kind, approximate, avg", CASES,
                         ids=[c[2] for c in CASES])
def test_acceptance_source_per_backend(tmp_path, capsys, make_app, backend, name, kind, approximate, avg):
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
        assert r["avg_commit"] == pytest.approx(avg)
        assert r["step_ms"] == pytest.approx(1000 * r["avg_commit"] / r["tok_per_s"])
    assert name in capsys.readouterr().out
    assert (tmp_path / "report.md").read_text().count(name) == 1


def test_no_acceptance_means_tok_per_s_only(tmp_path, capsys):
    with serve(plain_app()) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 0
    assert doc["backend"]["name"] == "openai" and doc["acceptance_source"]["kind"] == "none"
    assert all(r["tok_per_s"] > 0 and r["avg_commit"] is None and r["step_ms"] is None for r in doc["records"])
    out = capsys.readouterr().out
    assert "tok/s only" in out


def test_exact_token_id_prompts_with_tokenizer(tmp_path, capsys):
    from ddscope.testing import save_tiny_tokenizer

    tok_dir = tmp_path / "tok"
    save_tiny_tokenizer(tok_dir)
    with serve(vllm_app("counters")) as url:
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
    assert len((tmp_path / "results.csv").read_text().splitlines()) == 5  # header + 4 error rows


def test_parse_metrics_sums_label_sets_and_drops_created():
    text = ('# TYPE vllm:spec_decode_num_drafts_total counter\n'
            'vllm:spec_decode_num_drafts_total{engine="0"} 3\n'
            'vllm:spec_decode_num_drafts_total{engine="1"} 4\n'
            'vllm:spec_decode_num_drafts_created{engine="0"} 1.7e9\n')
    assert parse_metrics(text) == {"vllm:spec_decode_num_drafts_total": [3.0, 4.0]}


def test_unreachable_url_is_a_clear_error(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert run(["--url", f"http://127.0.0.1:{port}", "--out", str(tmp_path), "--timeout", "5"]) == 2
    assert "probe request failed" in capsys.readouterr().err


def test_ctrl_c_leaves_valid_files(tmp_path, capsys, monkeypatch):
    import ddscope.bench.sweep as sweep_mod

    real_post, calls = sweep_mod.post, {"n": 0}

    def post(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 5:  # probe, warmup, 2 timed requests at the first context, then Ctrl-C
            raise KeyboardInterrupt
        return real_post(*args, **kwargs)

    monkeypatch.setattr(sweep_mod, "post", post)
    with serve(vllm_app("counters")) as url:
        code, doc = sweep(url, tmp_path)
    assert code == 0 and doc["status"] == "interrupted"
    assert [r["context"] for r in doc["records"]] == [16, 16]
    assert len((tmp_path / "results.csv").read_text().splitlines()) == 3
    assert "status: interrupted" in (tmp_path / "report.md").read_text()
