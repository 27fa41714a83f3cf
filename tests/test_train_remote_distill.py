"""`--distill-url`: distillation from a live `ddscope serve` (started here on 127.0.0.1) gives the token ids of
in-process distillation; a server that errors or truncates bodies loses no data, and the run reports counts."""
import json
import shutil
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from ddscope.bench.synthetic_models import make_target, save_tiny_tokenizer
from ddscope.server.launch import serve_in_background
from ddscope.training.distill import DistillSpec, distill, read_cache
from ddscope.training.remote_distill import ATTEMPTS, remote_distill
from support.runs import TINY_PROMPTS, run_cli, write_prompts

PROMPTS = TINY_PROMPTS[:4]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A target whose greedy text re-tokenises to the very ids it generated, as `ddscope serve` returns text
    only: a byte tokenizer without merges, and a head that never picks a special or non-ASCII token."""
    d = make_target(tmp_path_factory.mktemp("remote") / "target", "llama")
    tok = save_tiny_tokenizer(d, vocab_size=260)  # 256 bytes + 4 specials: no merges
    model = LlamaForCausalLM.from_pretrained(str(d))
    printable = [i for i in range(len(tok)) if len(s := tok.decode([i])) == 1 and s.isascii()
                 and (s.isprintable() or s == "\n")]  # specials decode to their names
    keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    keep[printable] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0  # logit 0 < the best of ~95 random logits
    model.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    write_prompts(prompts, PROMPTS)
    return DistillSpec(data=f"file:{prompts}", prompts=4, max_new_tokens=24, sampled_frac=0.0)


@pytest.fixture(scope="module")
def server(target):
    with serve_in_background(target, None, method="ar") as url:
        yield url


@pytest.fixture(scope="module")
def in_process_records(target, spec, tmp_path_factory):
    return distill(target, spec, tmp_path_factory.mktemp("local"))


@pytest.fixture(scope="module")
def in_process(in_process_records):
    return read_cache_ids(in_process_records)


def read_cache_ids(records: list[dict]) -> dict[int, list[int]]:
    return {r["i"]: r["ids"] for r in records}


def test_greedy_ids_equal_in_process_distillation(server, target, spec, in_process, tmp_path):
    records, counts = remote_distill(server, target, spec, tmp_path, concurrency=3)
    assert read_cache_ids(records) == in_process
    assert (counts.written, counts.cached, counts.dropped, counts.problems) == (4, 0, 0, {})
    assert all(len(ids) - r["prompt_len"] == 24 for r, ids in zip(records, in_process.values()))
    # Resumable: a rerun sends nothing.
    records, counts = remote_distill(server, target, spec, tmp_path)
    assert (counts.written, counts.cached) == (0, 4) and read_cache_ids(records) == in_process


@pytest.fixture(scope="module")
def eos_target(target, in_process_records, tmp_path_factory):
    """The target with its EOS head row set to 1.01x the row of the 4th token of the first greedy item: that item
    now stops on EOS within 4 tokens (the hidden states are the target's, so the tokens before it are too)."""
    d = tmp_path_factory.mktemp("eos") / "target"
    shutil.copytree(target, d)
    model = LlamaForCausalLM.from_pretrained(str(d))
    first = in_process_records[0]
    eos = AutoTokenizer.from_pretrained(str(d)).eos_token_id
    with torch.no_grad():
        model.lm_head.weight[eos] = 1.01 * model.lm_head.weight[first["ids"][first["prompt_len"] + 3]]
    model.save_pretrained(str(d))
    return d


def test_eos_stops_give_the_in_process_ids(eos_target, spec, tmp_path):
    """`ddscope serve` returns text without the EOS it stopped on, and names it in SGLang's `matched_stop`: the
    record ends with it, as in-process records do, with one possible EOS or two (generation_config adds one)."""
    local = distill(eos_target, spec, tmp_path / "local")
    eos = AutoTokenizer.from_pretrained(str(eos_target)).eos_token_id
    stopped = [r for r in local if len(r["ids"]) - r["prompt_len"] < spec.max_new_tokens]
    assert 0 < len(stopped) < len(local) and all(r["ids"][-1] == eos for r in stopped)
    assert stopped[0]["i"] == local[0]["i"] and len(stopped[0]["ids"]) - stopped[0]["prompt_len"] <= 4
    with serve_in_background(eos_target, None, method="ar") as url:
        records, counts = remote_distill(url, eos_target, spec, tmp_path / "remote", concurrency=2)
    assert read_cache_ids(records) == read_cache_ids(local)
    assert (counts.written, counts.dropped, counts.problems) == (4, 0, {})

    two_eos = tmp_path / "two-eos"
    shutil.copytree(eos_target, two_eos)
    (two_eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 2]}))
    with serve_in_background(two_eos, None, method="ar") as url:
        records, counts = remote_distill(url, two_eos, spec, tmp_path / "remote-two", concurrency=2)
    assert read_cache_ids(records) == read_cache_ids(local)
    assert (counts.written, counts.dropped, counts.problems) == (4, 0, {})


@contextmanager
def faulty_proxy(upstream: str, poisoned_prompt: list[int]):
    """Forwards to `upstream`, but answers the first POSTs with a 500, a truncated JSON body, a wrong token
    count and a connection cut mid-body, and always a 500 for `poisoned_prompt`."""
    faults = ["http_error", "bad_body", "token_mismatch", "transport_error"]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, body: bytes, length: int | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # detection: /metrics, /v1/models
            resp = httpx.get(upstream + self.path, timeout=30)
            self._send(resp.status_code, resp.content)

        def do_POST(self):
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            if json.loads(raw).get("prompt") == poisoned_prompt:
                return self._send(500, b'{"error": {"message": "boom"}}')
            with lock:
                fault = faults.pop(0) if faults else None
            resp = httpx.post(upstream + self.path, content=raw, headers={"content-type": "application/json"},
                              timeout=60)
            body = resp.content
            if fault == "http_error":
                self._send(500, b'{"error": {"message": "overloaded"}}')
            elif fault == "bad_body":
                self._send(200, body[:len(body) // 2])
            elif fault == "token_mismatch":
                answer = json.loads(body)
                answer["usage"]["completion_tokens"] += 3
                self._send(200, json.dumps(answer).encode())
            elif fault == "transport_error":
                self._send(200, body[:len(body) // 2], length=len(body))
                self.close_connection = True
            else:
                self._send(resp.status_code, body)

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{proxy.server_address[1]}"
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_errors_and_truncated_bodies_lose_no_data(server, target, spec, in_process, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    first = next(r for r in in_process.values())
    poisoned = first[:len(tokenizer.encode(PROMPTS[0], add_special_tokens=False))]
    poisoned_i = next(i for i, ids in in_process.items() if ids[:len(poisoned)] == poisoned)
    with faulty_proxy(server, poisoned) as url:
        records, counts = remote_distill(url, target, spec, tmp_path, concurrency=2)
    assert counts.problems == {"http_error": 1 + ATTEMPTS, "bad_body": 1, "token_mismatch": 1, "transport_error": 1}
    assert (counts.written, counts.dropped) == (3, 1)
    assert read_cache_ids(records) == {i: ids for i, ids in in_process.items() if i != poisoned_i}

    # The next run (the server healthy again) sends only the dropped item, through the CLI.
    assert run_cli(["train-drafter", "--target", str(target), "--out", str(tmp_path / "drafter"),
                             "--work-dir", str(tmp_path), "--data", spec.data, "--prompts", "4",
                             "--max-new-tokens", "24", "--sampled-frac", "0", "--distill-url", server,
                             "--distill-only"]) == 0
    assert "1 written, 3 already cached, 0 dropped (failed attempts: none)" in capsys.readouterr().err
    assert read_cache_ids(read_cache(tmp_path)) == in_process


def test_server_dialects_give_ids_or_a_counted_reason(tmp_path):
    """Answers shaped as SGLang /generate, vLLM completions with token-id logprobs and llama.cpp /completion
    document them (these servers are not run here)."""
    from ddscope.training.remote_distill import BadResponse, Protocol

    tok = save_tiny_tokenizer(tmp_path)
    eos = tok.eos_token_id
    sglang, vllm, llamacpp = (Protocol(b, tok, (eos,)) for b in ("sglang", "vllm", "llamacpp"))
    meta = {"finish_reason": {"type": "stop", "matched": eos}, "completion_tokens": 3}
    assert sglang.generated({"text": "x", "output_ids": [5, 6, eos], "meta_info": meta}) == [5, 6, eos]
    assert sglang.generated({"text": "hi", "meta_info": {"finish_reason": {"type": "length"}}}) \
        == tok.encode("hi", add_special_tokens=False)
    assert vllm.generated({"choices": [{"text": "?", "finish_reason": "length",
                                        "logprobs": {"tokens": ["token_id:5", "token_id:6"]}}],
                           "usage": {"completion_tokens": 2}}) == [5, 6]
    assert llamacpp.generated({"content": "?", "tokens": [5, 6], "stop_type": "eos",
                               "timings": {"predicted_n": 2}}) == [5, 6, eos]
    # Two possible EOS ids (<|endoftext|> and <|im_end|>): the one in the ids or the one SGLang names, else dropped.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    sglang2, openai2 = Protocol("sglang", tok, (eos, im_end)), Protocol("openai", tok, (eos, im_end))
    stop = {"finish_reason": {"type": "stop", "matched": im_end}, "completion_tokens": 3}
    assert sglang2.generated({"output_ids": [5, 6, im_end], "meta_info": stop}) == [5, 6, im_end]
    assert sglang2.generated({"output_ids": [5, 6], "meta_info": stop}) == [5, 6, im_end]
    named = {"choices": [{"text": "hi", "finish_reason": "stop", "matched_stop": im_end}]}  # SGLang /v1, ddscope
    assert openai2.generated(named) == tok.encode("hi", add_special_tokens=False) + [im_end]
    # ... and each server is asked to keep the stop token in its ids and text.
    body = vllm.request([5], DistillSpec(), 0.0, 0)[1]
    assert body["skip_special_tokens"] is False and body["include_stop_str_in_output"] is True
    assert sglang.request([5], DistillSpec(), 0.0, 0)[1]["sampling_params"]["no_stop_trim"] is True
    for proto, body, kind in [
        (openai2, {"choices": [{"text": "hi", "finish_reason": "stop"}]}, "unknown_eos"),
        (sglang2, {"output_ids": [5], "meta_info": {"finish_reason": {"type": "stop", "matched": "</s>"}}},
         "unknown_eos"),
        (vllm, {"choices": [{"finish_reason": "length", "logprobs": {"tokens": ["oops"]}}]}, "bad_body"),
        (sglang, {"output_ids": [5], "meta_info": {"finish_reason": {"type": "abort"}}}, "bad_body"),
        (llamacpp, {"tokens": [5, 6], "stop_type": "limit", "timings": {"predicted_n": 7}}, "token_mismatch"),
        (vllm, {"choices": "nope"}, "bad_body"),
    ]:
        with pytest.raises(BadResponse) as err:
            proto.generated(body)
        assert err.value.kind == kind
