"""`ddscope bench trace`: streamed chunks read as steps, checked against the server's own truth."""
from __future__ import annotations

import json
import time
from statistics import median
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, StreamingResponse

from ddscope.bench.synthetic_models import make_drafter, make_target
from ddscope.cli import main
from support.bench_fakes import serve


def trace(*argv: str) -> int:
    return main(["bench", "trace", *argv])


def test_a_trace_of_ddscope_equals_its_rounds_and_its_engine_steps(tmp_path, capsys):
    """A target of tens of ms a step (as real models have; the tiny pair's few ms are mostly HTTP), 256 tokens."""
    target = make_target(tmp_path / "target", hidden=512, layers=8)
    drafter = make_drafter(tmp_path / "drafter", target)
    out = tmp_path / "trace"
    assert trace("--target", str(target), "--drafter", str(drafter), "--max-tokens", "256", "--repeats", "2",
                 "--budget", "32",
                 "--out", str(out)) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["status"] == "complete" and doc["backend"]["name"] == "ddscope"
    for r in doc["requests"]:
        assert not r["approximate"], r["reasons"]
        assert r["tokens_sum"] == r["completion_tokens"] == 256 and r["tokens_counted_by"] == "logprobs"
        assert r["checks"]["rounds_equal"]  # each chunk is one engine round, commit for commit
        assert sum(s["commit"] for s in r["steps"]) == 255  # the first token is the prefill's chunk
        # a gap is one engine step and the chunk's trip, whose share grows with the machine's load: never two steps
        assert 0.9 <= r["checks"]["gap_over_engine"] < 1.5
        positions = [s["position"] for s in r["steps"]]
        assert positions == sorted(positions) and positions[0] == 1
    assert (out / "trace.png").read_bytes()[:4] == b"\x89PNG"
    assert "step boundaries: 2/2" in (out / "report.md").read_text()


def test_workloads_by_position_and_the_prompt_sweeps_line(tiny_pair, tmp_path, capsys):
    target, drafter = tiny_pair
    assert main(["bench", "sweep", "--target", str(target), "--drafter", str(drafter), "--contexts", "16,64,128",
                 "--max-tokens", "16", "--repeats", "1", "--warmup", "0", "--budget", "32",
                 "--out", str(tmp_path / "sweep")]) == 0
    capsys.readouterr()
    out = tmp_path / "trace"
    assert trace("--target", str(target), "--drafter", str(drafter), "--workload", "padding,code,reasoning",
                 "--max-tokens", "64", "--repeats", "2", "--budget", "32",
                 "--against", str(tmp_path / "sweep/results.json"),
                 "--json", "--out", str(out)) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["workloads"]) == {"padding", "code", "reasoning"}
    for w in summary["workloads"].values():
        assert "against_sweep" in w and "while generating" in w["against_sweep"]["verdict"] or \
            "follows the prompt sweep" in w["against_sweep"]["verdict"]
    cells = {(c["category"], c["column"]) for c in summary["matrix"]}
    assert {("padding", 0), ("code", 0), ("reasoning", 0)} <= cells
    for c in summary["matrix"]:
        assert c["ci95"][0] <= c["avg_commit"] <= c["ci95"][1] and c["steps"] > 0
    # analyze reads the trace back, against the sweep, beside this machine's floor
    assert main(["bench", "analyze", str(out / "results.json"), str(tmp_path / "sweep/results.json"),
                 "--hardware", "host", "--json", "--out", str(tmp_path / "again")]) == 0
    again = json.loads(capsys.readouterr().out)
    for w in again["workloads"].values():
        assert not w["floor"]["median_below"] and w["floor"]["nodes"] > 1 and "against_sweep" in w
    assert (tmp_path / "again/trace.png").is_file()


# ---- servers whose chunks are not steps ---------------------------------------------------------------------

def _sse(chunks: list[dict[str, Any]], done: bool = True, gap_s: float = 0.002):
    for c in chunks:
        time.sleep(gap_s)
        yield f"data: {json.dumps(c)}\n\n"
    if done:
        yield "data: [DONE]\n\n"


def llamacpp_streaming_app(drop_after: int | None = None) -> FastAPI:
    """llama.cpp's server as llama-cpp-python 0.3.36 vendors it: one chunk per token, even when it speculates.
    source: vendor/llama.cpp/tools/server/server-context.cpp:1857-1858 (send_partial_response for each token
    process_token adds); server-task.cpp:1073-1109 (a partial's `logprobs: {"content": [one token]}`, text),
    :374-411 (the final chunk: finish_reason, `usage`, `timings`)."""
    app = FastAPI()
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "llamacpp",
                                                                "meta": {"n_ctx": 8192}}]})
    counter = ("# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification "
               "steps\n# TYPE llamacpp:spec_decode_num_drafts_total counter\nllamacpp:spec_decode_num_drafts_total 9\n")
    app.get("/metrics", response_class=PlainTextResponse)(lambda: counter)

    @app.post("/v1/completions")
    def completions(body: dict[str, Any]) -> StreamingResponse:
        n = body["max_tokens"]
        token = {"id": 120, "token": "x", "bytes": [120], "logprob": -0.1, "top_logprobs": []}
        parts = [{"choices": [{"text": "x", "index": 0, "logprobs": {"content": [token]}, "finish_reason": None}],
                  "object": "text_completion", "id": "c", "model": "m"} for _ in range(n)]
        final = {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 20, "completion_tokens": n, "total_tokens": 20 + n},
                 "timings": {"predicted_n": n, "draft_n": 8 * (n // 4), "draft_n_accepted": n // 2},
                 "object": "text_completion", "id": "c", "model": "m"}
        chunks = parts[:drop_after] if drop_after else parts + [final]
        return StreamingResponse(_sse(chunks, done=drop_after is None), media_type="text/event-stream")
    return app


def test_a_server_that_streams_token_by_token_is_named_and_its_trace_marked(tmp_path, capsys):
    with serve(llamacpp_streaming_app()) as url:
        assert trace("--url", url, "--max-tokens", "40", "--repeats", "1", "--json", "--out", str(tmp_path / "t")) == 0
    summary = json.loads(capsys.readouterr().out)
    w = summary["workloads"]["padding"]
    assert w["approximate"] and any("token by token" in why for why in w["reasons"])
    doc = json.loads((tmp_path / "t/results.json").read_text())
    assert doc["backend"]["name"] == "llamacpp" and doc["requests"][0]["tokens_sum"] == 40


def test_a_dropped_stream_keeps_its_partial_trace_marked(tmp_path, capsys):
    out = tmp_path / "t"
    with serve(llamacpp_streaming_app(drop_after=12)) as url:
        assert trace("--url", url, "--max-tokens", "40", "--repeats", "2", "--out", str(out)) == 1
    err = capsys.readouterr().err
    assert "the stream was dropped" in err and "before [DONE]" in err
    doc = json.loads((tmp_path / "t.partial/results.json").read_text())
    assert doc["status"] == "aborted" and len(doc["requests"]) == 1
    r = doc["requests"][0]
    assert r["status"] == "dropped" and r["approximate"] and len(r["steps"]) == 11
    assert not out.exists()


def test_a_server_that_does_not_stream_is_one_line(tmp_path, capsys):
    app = FastAPI()
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "x"}]})

    @app.post("/v1/completions")
    def completions(body: dict[str, Any]) -> dict[str, Any]:  # JSON whatever "stream" says
        return {"choices": [{"text": "x", "index": 0, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    with serve(app) as url:
        assert trace("--url", url, "--max-tokens", "8", "--repeats", "1", "--out", str(tmp_path / "t")) == 1
    assert "does not stream" in capsys.readouterr().err


def test_the_checks_flag_chunks_that_arrive_in_bursts():
    from ddscope.bench.collecting.stream_steps import Stream, check, steps_of

    chunks, t = [], 0.0
    for i in range(40):  # pairs of chunks 20 ms apart, the second of each 0.1 ms after the first: a buffer
        t += 0.0001 if i % 2 else 0.02
        chunks.append((t, 3))
    stream = Stream(chunks, {"usage": {"completion_tokens": 120}})
    c = check(stream, steps_of(stream, 10), "sglang", True)
    assert c.approximate and any("coalesces" in why for why in c.reasons)
    even = Stream([(0.02 * i, 3) for i in range(40)], {"usage": {"completion_tokens": 120}})
    assert not check(even, steps_of(even, 10), "sglang", True).approximate
    assert median(s["gap_ms"] for s in steps_of(even, 10)) == pytest.approx(20)


def test_a_loop_is_found_where_the_text_keeps_a_period_and_only_there():
    from ddscope.bench.running.loops import find_loop, split_commits

    varied = list(range(100, 140))
    assert find_loop(varied) is None and find_loop(varied + [7, 8, 9] * 3) is None  # 9 tokens: too short to call
    loop = find_loop(varied + [7, 8, 9, 10] * 6)
    assert (loop.start, loop.period) == (40, 4)
    assert find_loop(varied + ["_"] * 20).period == 1
    split = split_commits([3, 4, 2, 16, 16], start=10)  # steps start at positions 1, 4, 8, 10, 26
    assert split["avg_commit_before_loop"] == 3 and split["avg_commit_in_loop"] == 16 and split["loop_steps"] == 2


def test_a_demo_trace_marks_its_looping_stretch_apart(tmp_path, capsys):
    """The demo target settles into repeating one token within a few hundred: the trace says where, and gives
    the loop's acceptance apart from the rest (issue 63: a loop read as acceptance)."""
    out = tmp_path / "trace"
    assert main(["bench", "trace", "--max-tokens", "384", "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    [req] = doc["requests"]
    assert req["loop"] and req["loop"]["from"] < 384 - 16
    steps = req["steps"]
    assert all(s["in_loop"] == (s["position"] >= req["loop"]["from"]) for s in steps)
    inside = [s["commit"] for s in steps if s["in_loop"]]
    assert inside and sum(inside) / len(inside) > 8  # every draft right in a loop
    assert "end in a loop" in capsys.readouterr().out


def test_a_trace_under_load_is_each_streams_steps_and_the_servers_together(tiny_pair, tmp_path, capsys):
    """`--concurrency 1,3`: the repeats alone, then three streams at once; each stream is still its own rounds,
    their steps together are the server's verify-step counter's delta, and the step under load is set beside
    the step alone."""
    target, drafter = tiny_pair
    out = tmp_path / "trace"
    assert trace("--target", str(target), "--drafter", str(drafter), "--max-tokens", "48", "--repeats", "1",
                 "--concurrency", "1,3", "--out", str(out)) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [r["concurrency"] for r in doc["requests"]] == [1, 3, 3, 3]
    [group] = doc["groups"]
    assert not group["approximate"], group["reasons"]
    assert group["server_steps"] == group["trace_steps"] == sum(len(r["steps"]) for r in doc["requests"][1:])
    assert group["trace_tokens"] == group["usage_tokens"] == group["server_tokens"] == 3 * 48
    assert all(r["checks"]["rounds_equal"] for r in doc["requests"])
    printed = capsys.readouterr().out
    assert "under load (c=3, 3 streams)" in printed and "the server counted" in printed
