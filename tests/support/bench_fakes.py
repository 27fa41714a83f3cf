"""Fake SGLang, vLLM and llama.cpp servers for the bench tests, built from the released sources
(sglang 0.5.23, vllm 0.33.0, llama.cpp as vendored in llama-cpp-python 0.3.36; `pip download
--no-deps`). Each copied name or format string cites `package/path:line`. Behaviours that matter:
SGLang and vLLM ignore request fields they do not know (no 400), SGLang's acceptance gauge is a
window average unrelated to the request, llama.cpp prints its counters with C++ stream defaults
(`%g`, 6 significant digits), and each engine's log line has its own format and timing.

Acceptance is planted per prompt length, so a reader that mixes requests up cannot pass:
short prompts (< 32 tokens) commit TOKENS in SHORT_STEPS verify steps, longer ones in LONG_STEPS.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

TOKENS = 20
SHORT_STEPS, LONG_STEPS = 8, 5  # avg_commit 2.5 and 4.0 (bonus token included)


def prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt", body.get("input_ids", body.get("text")))
    return len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt)) // 4)


def steps_for(n_prompt: int) -> int:
    return SHORT_STEPS if n_prompt < 32 else LONG_STEPS


def planted(n_prompt: int) -> float:
    """The server's own figure, TOKENS / steps: like SGLang's and vLLM's, it counts a token too many."""
    return TOKENS / steps_for(n_prompt)


def delivered(n_prompt: int) -> float:
    """The tokens after the first (which prefill yields) per verify step."""
    return (TOKENS - 1) / steps_for(n_prompt)


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run `app` on a free 127.0.0.1 port in a thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):  # bounded wait for startup
        if server.started:
            break
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def usage(body: dict[str, Any]) -> dict[str, int]:
    n = prompt_tokens(body)
    return {"prompt_tokens": n, "completion_tokens": body["max_tokens"], "total_tokens": n + body["max_tokens"]}


def completion(body: dict[str, Any], **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": "x" * body["max_tokens"], "finish_reason": "length"}
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body.get("model", "m"),
            "choices": [{**choice, **extra.pop("choice", {})}], "usage": usage(body), **extra}


def openai_error(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}},
                        status_code=400)


def app_with(models: dict[str, Any], metrics: Callable[[], str] | None,
             complete: Callable[[dict[str, Any]], dict[str, Any] | JSONResponse]) -> FastAPI:
    """/v1/models, /v1/completions (a sync handler: it may sleep) and optionally /metrics."""
    app = FastAPI()
    app.get("/v1/models")(lambda: models)
    if metrics is not None:
        app.get("/metrics", response_class=PlainTextResponse)(metrics)

    @app.post("/v1/completions")
    def completions(body: dict[str, Any]) -> JSONResponse:
        got = complete(body)
        return got if isinstance(got, JSONResponse) else JSONResponse(got)
    return app


def models(owner: str, **entry: Any) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0, "owned_by": owner, **entry}]}


def prom(name: str, kind: str, doc: str, samples: list[tuple[str, float | str]]) -> list[str]:
    """One Prometheus family as prometheus_client prints it (`name{labels} value`)."""
    return [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"] + [f"{name}{{{labels}}} {value}" if labels
                                                               else f"{name} {value}" for labels, value in samples]


# ---- SGLang --------------------------------------------------------------------------------------

def sglang_app(sglext: bool = True, generate: bool = True, metrics: bool = True, counters: bool = True,
               log: Callable[[int], None] | None = None) -> FastAPI:
    """SGLang 0.5.23 (checked against the real one, tests/test_real_sglang.py). `sglext`: False for a build whose
    /v1/completions ignores return_spec_tokens_details (0.5.23 answers it: protocol.py:470-482, 536-543);
    `metrics`: --enable-metrics; `counters`: False for a build without sglang:spec_verify_calls_total;
    `generate`: the native route is reachable; `log`: writes log lines while a request decodes."""
    totals = {"gen": 0.0, "verify": 0.0, "served": 0}

    def decode(n_prompt: int, max_tokens: int) -> int:
        totals["served"] += 1
        if log is not None:
            log(n_prompt)
        steps = steps_for(n_prompt)
        totals["gen"] += max_tokens
        totals["verify"] += steps
        return steps

    def details(steps: int, max_tokens: int) -> dict[str, Any]:
        # source: sglang/srt/managers/tokenizer_manager.py:3163-3172 (meta_info spec fields)
        return {"spec_accept_rate": (max_tokens - steps) / (steps * 3), "spec_accept_length": max_tokens / steps,
                "spec_num_correct_drafts": max_tokens - steps, "spec_num_proposed_drafts": steps * 3,
                "spec_verify_ct": steps}

    def complete(body: dict[str, Any]) -> dict[str, Any]:
        # Unknown fields are ignored, never a 400: no extra="forbid" on CompletionRequest
        # (source: sglang/srt/entrypoints/openai/protocol.py:365). return_meta_info is a chat-only
        # field (protocol.py:964), so on /v1/completions it is ignored too.
        steps = decode(prompt_tokens(body), body["max_tokens"])
        if sglext and body.get("return_spec_tokens_details"):  # source: protocol.py:393
            return completion(body, sglext={"spec_tokens_details": details(steps, body["max_tokens"])})
        return completion(body)

    def metrics_text() -> str:
        # source: sglang/srt/observability/metrics_collector.py:1807-1812 (tokenizer labels),
        # :1382-1388 (scheduler labels), :511 (gauge), :1856-1868 (counters)
        tok = 'engine_type="unified",model_name="fake"'
        sched = 'engine_type="unified",model_name="fake",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
        lines = prom("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                     [(tok + ',is_streaming="false"', 100.0 * totals["served"])])
        lines += prom("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
                      [(tok + ',is_streaming="false"', totals["gen"])])
        if counters:
            lines += prom("sglang:spec_verify_calls_total", "counter",
                          "Number of speculative decoding verification calls.", [(tok, totals["verify"])])
        # A stale window gauge: the same value whatever the request (the last 40 decode iterations).
        lines += prom("sglang:spec_accept_length", "gauge", "Mean acceptance length of speculative decoding "
                      "(accepted drafts + bonus token per forward).", [(sched, 7.7)])
        lines += prom("sglang:num_running_reqs", "gauge", "The number of running requests.", [(sched, 0.0)])
        return "\n".join(lines) + "\n"

    app = app_with(models("sglang", root="fake", max_model_len=8192), metrics_text if metrics else None, complete)
    lifetime = {"internal_states": [{"avg_spec_accept_length": 1.9}]}  # lifetime, not this request
    app.state.get_server_info_calls = 0

    @app.get("/server_info")  # source: sglang/srt/entrypoints/http_server.py:863
    def server_info() -> dict[str, Any]:
        return lifetime

    @app.get("/get_server_info")  # deprecated, warns on every call; source: http_server.py:853-857
    def get_server_info() -> dict[str, Any]:
        app.state.get_server_info_calls += 1
        return lifetime

    if generate:
        @app.post("/generate")  # source: sglang/srt/entrypoints/http_server.py:929
        async def native(request: Request) -> dict[str, Any]:
            body = await request.json()
            # source: sglang/srt/managers/io_struct.py:185,188,227; sampling/sampling_params.py:149,173
            params = body.get("sampling_params") or {}
            max_new = int(params.get("max_new_tokens", 128))
            n_prompt = prompt_tokens(body)
            steps = decode(n_prompt, max_new)
            # source: sglang/srt/managers/tokenizer_manager.py:2507-2512,2553-2558 (meta_info)
            meta = {"id": "r1", "finish_reason": {"type": "length", "length": max_new}, "prompt_tokens": n_prompt,
                    "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
                    "completion_tokens": max_new, "cached_tokens": 0, "e2e_latency": 0.05,
                    **details(steps, max_new)}
            return {"text": "x" * max_new, "output_ids": list(range(max_new)), "meta_info": meta}
    return app


# ---- vLLM ----------------------------------------------------------------------------------------

VLLM_DECODE_S = 0.02  # the fake's decode of a request, by its own clock


def vllm_app(per_request: bool = False, timing: bool = False, prefill_s_per_token: float = 0.0,
             log: Callable[[int], None] | None = None) -> FastAPI:
    """vLLM 0.33.0. `per_request`: --per-request-spec-decode-metrics summary; `timing`:
    --enable-per-request-metrics; `prefill_s_per_token`: the fake's prefill time."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0}

    def complete(body: dict[str, Any]) -> dict[str, Any]:
        # Unknown fields are allowed and ignored (source: vllm/entrypoints/serve/engine/protocol.py:39)
        n_prompt, n = prompt_tokens(body), body["max_tokens"]
        prefill_s = prefill_s_per_token * n_prompt
        time.sleep(prefill_s)
        if log is not None:
            log(n_prompt)
        time.sleep(VLLM_DECODE_S)
        steps = steps_for(n_prompt)
        accepted = n - steps
        totals.update(drafts=totals["drafts"] + steps, draft_tokens=totals["draft_tokens"] + 3 * steps,
                      accepted=totals["accepted"] + accepted)
        metrics: dict[str, Any] = {}
        if timing:  # source: vllm/entrypoints/generate/base/serving.py:73-84, base/protocol.py:122-127
            # the fake's own clock, as a server's is: what it says it spent, not what a loaded machine's sleeps took
            metrics.update(time_to_first_token_ms=prefill_s * 1000, generation_time_ms=VLLM_DECODE_S * 1000,
                           queue_time_ms=0.1, mean_itl_ms=VLLM_DECODE_S * 1000 / (n - 1),
                           tokens_per_second=n / (prefill_s + VLLM_DECODE_S))
        if per_request:  # source: vllm/entrypoints/generate/base/protocol.py:100-119
            metrics["speculative_decoding"] = {
                "mean_acceptance_length": 1 + accepted / steps, "draft_acceptance_rate": accepted / (3 * steps),
                "acceptance_histogram": [0, 0, steps, 0], "num_spec_steps": steps,
                "num_accepted_draft_tokens": accepted, "num_draft_tokens": 3 * steps, "num_spec_tokens": 3}
        return completion(body, metrics=metrics) if metrics else completion(body)

    def metrics_text() -> str:
        # source: vllm/v1/spec_decode/metrics.py:229-231 (names), :253-256 (per position);
        # vllm/v1/metrics/loggers.py:499 (labels model_name, engine)
        labels = 'engine="0",model_name="fake"'
        lines = []
        for name, doc, key in (("drafts", "Number of spec decoding drafts.", "drafts"),
                               ("draft_tokens", "Number of draft tokens.", "draft_tokens"),
                               ("accepted_tokens", "Number of accepted tokens.", "accepted")):
            lines += prom(f"vllm:spec_decode_num_{name}_total", "counter", doc, [(labels, float(totals[key]))])
            lines.append(f"vllm:spec_decode_num_{name}_created{{{labels}}} 1.7e+09")
        lines += prom("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                      "Accepted tokens per draft position.",
                      [(labels + f',position="{p}"', float(totals["accepted"]) / 3) for p in range(3)])
        lines += prom("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                      [(labels, 0.0)])
        return "\n".join(lines) + "\n"

    return app_with(models("vllm", root="fake", max_model_len=8192), metrics_text, complete)


# ---- llama.cpp -----------------------------------------------------------------------------------

def cpp_stream(value: float) -> str:
    """A double through `std::stringstream << value` (default precision 6, i.e. `%g`)."""
    return f"{value:g}"


def llamacpp_app(counters: bool = True, timings_draft: bool = True, legacy: bool = False, base: float = 0.0,
                 n_ctx: int = 8192, log: Callable[[int], None] | None = None) -> FastAPI:
    """llama.cpp server (llama-cpp-python 0.3.36's vendored llama.cpp). A request of TOKENS tokens is
    1 token from prompt processing + `steps` drafted verify steps + 1 last undrafted step; the exact
    avg_commit per verify step is 1 + accepted / steps, which timings can only approximate.
    `base`: counter values before the sweep (a long-running server: >= 1e6 prints rounded)."""
    totals = {"predicted": base, "drafts": base, "drafted": base, "accepted": base}

    def plan(n_prompt: int, n: int) -> tuple[int, int]:
        steps = {SHORT_STEPS: 6, LONG_STEPS: 4}[steps_for(n_prompt)]
        return steps, n - 2 - steps  # accepted

    def complete(body: dict[str, Any]) -> dict[str, Any]:
        n_prompt, n = prompt_tokens(body), body["max_tokens"]
        steps, accepted = plan(n_prompt, n)
        if log is not None:
            log(n_prompt)
        for key, inc in (("predicted", n), ("drafts", steps), ("drafted", 8 * steps), ("accepted", accepted)):
            totals[key] += inc
        # source: llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/server-common.cpp:84-102
        timings = {"cache_n": 0, "prompt_n": n_prompt, "prompt_ms": 5.0, "prompt_per_token_ms": 5.0 / n_prompt,
                   "prompt_per_second": n_prompt / 0.005, "predicted_n": n, "predicted_ms": 80.0,
                   "predicted_per_token_ms": 80.0 / n, "predicted_per_second": n / 0.08}
        if timings_draft:
            timings.update(draft_n=8 * steps, draft_n_accepted=accepted)
        return completion(body, timings=timings)

    def metrics_text() -> str:
        # source: llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/server-task.cpp:1538-1564 (names),
        # :1596-1598 (`"llamacpp:" << name << " " << value`: a double through an ostream, %g)
        def counter(name: str, doc: str, value: float) -> list[str]:
            return [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} counter",
                    f"llamacpp:{name} {cpp_stream(value)}"]
        lines = counter("tokens_predicted_total", "Number of generation tokens processed", totals["predicted"])
        if counters:
            lines += counter("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
                             totals["drafted"])
            lines += counter("spec_decode_num_accepted_tokens_total",
                             "Speculative: Total draft tokens accepted by the target model", totals["accepted"])
            lines += counter("spec_decode_num_drafts_total", "Speculative: Total speculative decoding "
                             "verification steps", totals["drafts"])
        if legacy:
            lines += counter("tokens_drafted_total", "Number of speculative decoding tokens drafted",
                             totals["drafted"])
            lines += counter("tokens_drafted_accepted_total", "Number of speculative decoding tokens accepted",
                             totals["accepted"])
        return "\n".join(lines) + "\n"

    # source: llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/server-context.cpp:4527-4545
    meta = {"vocab_type": 2, "n_vocab": 8192, "n_ctx": n_ctx, "n_ctx_train": 40960, "n_embd": 256,
            "n_params": 5_000_000, "size": 20_000_000, "ftype": 0}
    return app_with(models("llamacpp", aliases=[], tags=[], meta=meta), metrics_text, complete)


def plain_app(owner: str = "someone", log: Callable[[int], None] | None = None) -> FastAPI:
    """An OpenAI-compatible server with usage but no acceptance telemetry and no /metrics."""
    def complete(body: dict[str, Any]) -> dict[str, Any]:
        if log is not None:
            log(prompt_tokens(body))
        return completion(body)
    return app_with(models(owner), None, complete)


# ---- log lines -----------------------------------------------------------------------------------

def _ms(now: datetime) -> str:
    return f"{now:%Y-%m-%d %H:%M:%S}.{now.microsecond // 1000:03d}"


def sglang_line(avg: float) -> str:
    # source: sglang/srt/utils/common.py:2629-2636 ("[%(asctime)s{.ms} TP0] %(message)s", SGLANG_LOG_MS=1);
    # sglang/srt/managers/scheduler_components/metrics_reporter.py:963,1005,1039-1043
    return (f"[{_ms(datetime.now())} TP0] Decode batch, #running-req: 1, #token: 180, token usage: 0.01, "
            f"accept len: {avg:.2f}, accept rate: {(avg - 1) / 3:.2f}, cuda graph: True, "
            f"gen throughput (token/s): 412.33, #queue-req: 0")


def sglang_default_line(avg: float) -> str:
    # SGLang's default: no ms (SGLANG_LOG_MS off) and no " TPn" (tp_size 1); sglang/srt/utils/common.py:2629-2636
    return (f"[{datetime.now():%Y-%m-%d %H:%M:%S}] Decode batch, #running-req: 1, #token: 180, token usage: 0.01, "
            f"accept len: {avg:.2f}, accept rate: {(avg - 1) / 3:.2f}, cuda graph: False, "
            f"gen throughput (token/s): 412.33, #queue-req: 0")


def vllm_line(avg: float, drafts: int = 40) -> str:
    # source: vllm/logger.py:28-33 (prefix, datefmt "%m-%d %H:%M:%S"); vllm/v1/spec_decode/metrics.py:120-137
    accepted = round((avg - 1) * drafts)
    return (f"(APIServer pid=4242) INFO {datetime.now():%m-%d %H:%M:%S} [metrics.py:121] SpecDecoding metrics: "
            f"Mean acceptance length: {avg:.2f}, Accepted throughput: 51.20 tokens/s, Drafted throughput: "
            f"96.00 tokens/s, Accepted: {accepted} tokens, Drafted: {3 * drafts} tokens, Per-position "
            f"acceptance rate: 0.900, 0.700, 0.500, Avg Draft acceptance rate: {100 * accepted / (3 * drafts):.1f}%")


def llamacpp_line(avg: float, steps: int = 6) -> str:
    # source: llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/server-context.cpp:646-648,
    # server-common.h:28 (SLT_INF prefix "slot %12.*s: id %2d | task %d | ")
    accepted, generated = round((avg - 1) * steps), 8 * steps
    return (f"slot print_timing: id  0 | task 7 | draft acceptance = {accepted / generated:0.5f} "
            f"({accepted:5d} accepted / {generated:5d} generated), mean len = {avg:5.2f}")


def ddscope_line(avg: float, window_s: float, steps: int = 10) -> str:
    # src/ddscope/server/worker.py DecodeWindow.maybe_log; asctime as `ddscope serve` configures it
    now = datetime.now()
    return (f"{now:%Y-%m-%d %H:%M:%S},{now.microsecond // 1000:03d} INFO ddscope.server.worker: decode "
            f"window_s={window_s:.1f} steps={steps} avg_commit={avg:.3f} gen_tok_s=120.0 running=1 waiting=0")


def kv_line(avg: float) -> str:
    return f"accept_len={avg:.3f}"


class LogWriter:
    """Appends log lines to a file while a fake request decodes, as the real server would: windowed
    formats print on their own schedule, so the first line of a request also averages over the end of
    the previous one (a straddling line, planted with a wrong value); llama.cpp prints one line per
    request at its end."""

    STRADDLER = 9.9

    def __init__(self, path: Path, fmt: str, interval_s: float = 0.08):
        self.path, self.fmt, self.interval_s = path, fmt, interval_s
        self.last = time.monotonic()
        self.lines = 0

    def _write(self, text: str) -> None:
        with self.path.open("a") as f:
            f.write(text + "\n")
        self.lines += 1

    def _line(self, avg: float) -> str:
        now = time.monotonic()
        span, self.last = now - self.last, now
        return {"sglang": sglang_line, "sglang_default": sglang_default_line, "vllm": vllm_line, "kv": kv_line,
                "ddscope": lambda a: ddscope_line(a, span)}[self.fmt](avg)

    def __call__(self, n_prompt: int) -> None:
        avg = planted(n_prompt)
        if self.fmt == "llamacpp":
            time.sleep(2 * self.interval_s)
            self._write(llamacpp_line(avg))
            return
        time.sleep(self.interval_s)
        self._write(self._line(self.STRADDLER))
        for _ in range(2):
            time.sleep(self.interval_s)
            self._write(self._line(avg))
