"""Self-distillation from a live server (SGLang, vLLM, llama.cpp or `ddscope serve`): `--distill-url`.

The prompts, the greedy/sampled mix, the seeds and the cache records are distill.py's, so a cache may be
filled by either and a rerun sends only the items still missing. Requests run concurrently up to a bound.
Token ids come from the server where it gives them (SGLang `/generate` `output_ids`, vLLM logprobs as
`token_id:N`, llama.cpp `/completion` `tokens`); otherwise the text is re-tokenised with the target's
tokenizer and kept only if it decodes back to the same text and counts as many tokens as the server
generated. A failed, truncated or inconsistent response is counted and dropped, never trained on.

A record ends with the EOS the target stopped on, as in-process ones do. Servers are asked to keep it in
the ids and the text (SGLang `no_stop_trim`, vLLM `include_stop_str_in_output`); where it is left out, it
is the one the server names (SGLang /generate `finish_reason.matched`; `matched_stop` from SGLang /v1
and `ddscope serve`), or the target's only EOS id. With several possible (e.g. `<|endoftext|>` and
`<|im_end|>`) and no way to tell (vLLM names none for EOS), the item is dropped as `unknown_eos`.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from ddscope.bench.collecting.backends import Server
from ddscope.config import eos_ids, read_json, token_ids
from ddscope.training.distill import DistillSpec, Item, append_whole_lines, pending, read_cache, temperature_of

ATTEMPTS = 3  # per item and run; what still fails is left for the next run


class BadResponse(ValueError):
    """A response that cannot be trusted as the target's continuation; `kind` names the counter."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Counts:
    cached: int = 0     # already in the cache before this run
    written: int = 0
    dropped: int = 0    # items given up on in this run (retried by the next)
    problems: dict[str, int] = field(default_factory=dict)  # per failed attempt: http_error, bad_body, ...

    def summary(self) -> str:
        issues = ", ".join(f"{k} {v}" for k, v in sorted(self.problems.items())) or "none"
        return (f"{self.written} written, {self.cached} already cached, {self.dropped} dropped "
                f"(failed attempts: {issues})")


class Protocol:
    """One server dialect: the request for (prompt ids, sampling), and the generated ids in its answer."""

    def __init__(self, backend: str, tokenizer: Any, eos: tuple[int, ...]):
        self.backend, self.tokenizer, self.eos = backend, tokenizer, eos

    def request(self, ids: list[int], spec: DistillSpec, temperature: float, seed: int) -> tuple[str, dict[str, Any]]:
        n = spec.max_new_tokens
        if self.backend == "sglang":
            return "/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": n, "temperature": temperature, "sampling_seed": seed, "no_stop_trim": True,
                "skip_special_tokens": False}}
        if self.backend == "llamacpp":
            return "/completion", {"prompt": ids, "n_predict": n, "temperature": temperature, "seed": seed,
                                   "return_tokens": True}
        body = {"prompt": ids, "max_tokens": n, "temperature": temperature, "seed": seed}
        if self.backend == "vllm":
            body |= {"logprobs": 1, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
                     "include_stop_str_in_output": True}
        return "/v1/completions", body

    def _read(self, body: dict[str, Any]) -> tuple[str | None, int | None, Any, Any]:
        """(finish reason as stop|length, the server's generated-token count, the ids, the stop token it names)
        of one answer."""
        if self.backend == "sglang":
            meta = body.get("meta_info") or {}
            reason = meta.get("finish_reason") or {}
            ids = body.get("output_ids")
            return (reason.get("type"), meta.get("completion_tokens"),
                    ids if ids is not None else self._retokenise(body.get("text")), reason.get("matched"))
        if self.backend == "llamacpp":
            ids = body.get("tokens")
            return ({"eos": "stop", "limit": "length"}.get(body.get("stop_type")),
                    (body.get("timings") or {}).get("predicted_n"),
                    ids if ids is not None else self._retokenise(body.get("content")), None)
        choice = (body.get("choices") or [{}])[0]
        tokens = (choice.get("logprobs") or {}).get("tokens")  # vLLM: "token_id:N"
        ids = [int(t.removeprefix("token_id:")) for t in tokens] if tokens else self._retokenise(choice.get("text"))
        # matched_stop: SGLang's /v1 and ddscope serve name the EOS they stopped on; vLLM does not.
        return (choice.get("finish_reason"), (body.get("usage") or {}).get("completion_tokens"), ids,
                choice.get("matched_stop"))

    def generated(self, body: dict[str, Any]) -> list[int]:
        """The generated ids, ending with EOS when the target stopped there (as in-process records do)."""
        try:
            stop, count, ids, matched = self._read(body)
        except (AttributeError, TypeError, ValueError) as e:  # a body of the wrong shape
            if isinstance(e, BadResponse):
                raise
            raise BadResponse("bad_body", f"unreadable response ({e})") from None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise BadResponse("bad_body", "no generated tokens in the response")
        if stop not in ("stop", "length"):
            raise BadResponse("bad_body", f"unexpected finish reason {stop!r}")
        counted = {len(ids)}
        if stop == "stop" and (not ids or ids[-1] not in self.eos):
            ids = ids + [self._stop_token(matched)]  # left out of the ids or the text; servers may count it
            counted.add(len(ids))
        if count is not None and count not in counted:  # e.g. a re-tokenisation that merged generated tokens
            raise BadResponse("token_mismatch", f"{len(ids)} ids for {count} generated tokens")
        return ids

    def _stop_token(self, matched: Any) -> int:
        """The EOS a server stopped on but left out: the one it names, else the target's only one."""
        options = {matched} & set(self.eos) if isinstance(matched, int) else set(self.eos)
        if len(options) != 1:
            raise BadResponse("unknown_eos", f"stopped without saying on which of the EOS ids {list(self.eos)}")
        return options.pop()

    def _retokenise(self, text: Any) -> list[int]:
        if not isinstance(text, str):
            raise BadResponse("bad_body", "no completion text in the response")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.tokenizer.decode(ids) != text:
            raise BadResponse("retokenise_mismatch", "the text does not survive a tokenizer round trip")
        return ids


async def _generate(client: httpx.AsyncClient, url: str, proto: Protocol, ids: list[int], spec: DistillSpec,
                    temperature: float, seed: int) -> list[int]:
    path, body = proto.request(ids, spec, temperature, seed)
    try:
        resp = await client.post(url + path, json=body)
    except httpx.HTTPError as e:
        raise BadResponse("transport_error", str(e)) from None
    if resp.status_code != 200:
        raise BadResponse("http_error", f"HTTP {resp.status_code}")
    try:
        answer = resp.json()
    except ValueError:
        raise BadResponse("bad_body", "the body is not JSON (truncated?)") from None
    if not isinstance(answer, dict):
        raise BadResponse("bad_body", "the body is not a JSON object")
    return proto.generated(answer)


async def _run(url: str, proto: Protocol, todo: list[Item], spec: DistillSpec,
               out_dir: Path, concurrency: int, deadline: float, timeout_s: float, counts: Counts) -> None:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(client: httpx.AsyncClient, i: int, source: str, ids: list[int]) -> dict[str, Any] | None:
        temperature = temperature_of(spec, i)
        async with gate:
            for _ in range(ATTEMPTS):
                if time.time() > deadline:
                    return None
                try:
                    new = await _generate(client, url, proto, ids, spec, temperature, spec.seed + i)
                except BadResponse as e:
                    counts.problems[e.kind] = counts.problems.get(e.kind, 0) + 1
                    continue
                return {"i": i, "source": source, "temperature": temperature, "prompt_len": len(ids), "ids": ids + new}
        counts.dropped += 1
        return None

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        jobs = [asyncio.ensure_future(one(client, *item)) for item in todo]
        with append_whole_lines(out_dir / "distill.remote.jsonl") as f, \
                tqdm(total=len(jobs), desc="distill (remote)", unit="seq", dynamic_ncols=True) as bar:
            for job in asyncio.as_completed(jobs):
                record = await job
                if record is not None:
                    f.write(json.dumps(record) + "\n")
                    f.flush()  # a killed run keeps every finished record
                    counts.written += 1
                bar.update(1)
                bar.set_postfix(dropped=counts.dropped)


def remote_distill(url: str, target: str | Path, spec: DistillSpec, out_dir: Path, concurrency: int = 8,
                   time_budget_s: float | None = None, timeout_s: float = 600.0) -> tuple[list[dict[str, Any]], Counts]:
    """Fill `out_dir` from the server at `url` (serving `target`); return all records and this run's counts."""
    from transformers import AutoTokenizer

    if concurrency < 1 or timeout_s <= 0:
        raise ValueError("--distill-concurrency must be >= 1 and --distill-timeout > 0")
    target = Path(target)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    todo, deadline = pending(spec, tokenizer, out_dir, time_budget_s)
    counts = Counts(cached=len(read_cache(out_dir)))
    url = url.rstrip("/").removesuffix("/v1")
    with httpx.Client() as client:
        backend = Server(url, client).detect()
    # The engine's stop ids, so a record ends where an in-process one would.
    eos = eos_ids(target, tokenizer, token_ids(read_json(target / "config.json").get("eos_token_id")))
    asyncio.run(_run(url, Protocol(backend, tokenizer, eos), todo, spec, out_dir, concurrency, deadline, timeout_s,
                     counts))
    return read_cache(out_dir), counts
