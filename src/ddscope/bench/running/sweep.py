"""The context sweep: fixed output length, prompts of exact lengths, timed non-streaming requests.

Every measured request becomes one record in results.json / results.csv, rewritten after each
request through a temp file and `os.replace`, so a crash or Ctrl-C leaves valid files behind.
"""
from __future__ import annotations

import csv
import io
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from ddscope.bench.collecting.acceptance import AcceptanceReader, Observation
from ddscope.bench.collecting.acceptance_sources import Acceptance
from ddscope.bench.collecting.backends import (Reading, Server, cached_of, constraint_fields, decoding_method,
                                               delivered, engine_step_ms, grammar_ms, nodes_per_step, server_decode,
                                               server_prefill_s, step_commits, text_digest, usage_of)
from ddscope.bench.collecting.server_log import ServerLog, WindowReading
from ddscope.bench.limit.hardware import cpu_model
from ddscope.bench.running.loops import loop_fields
from ddscope.bench.running.workloads import Tokenizer, TokenizerError, fit_ids, fit_text, load_workload
from ddscope.util.atomic import atomic_write_text

SCHEMA = "ddscope.bench.results/1"
CSV_FIELDS = ("label", "context", "concurrency", "repeat", "prompt_tokens", "cached_tokens", "completion_tokens", "latency_s", "prefill_s",
              "tok_per_s", "tok_per_s_basis", "e2e_tok_per_s", "avg_commit", "server_avg_commit",
              "avg_commit_basis", "verify_steps", "step_ms",
              "engine_step_ms", "grammar_ms", "ttft_s", "aggregate_tok_per_s", "log_lines", "log_straddling", "error")
PROBE_TOKENS = 8

# Request fields that switch per-request telemetry on. Servers that ignore unknown fields (SGLang,
# vLLM) are read from the response; the next set is tried only when a server rejects the fields.
REQUEST_EXTRAS: dict[str, list[dict[str, Any]]] = {
    "ddscope": [{"return_rounds": True, "return_token_ids": True}, {}],
    # source: sglang/srt/entrypoints/openai/protocol.py:393,961,964 (return_meta_info: chat only)
    "sglang": [{"return_spec_tokens_details": True, "return_meta_info": True}, {}],
}
TOK_PER_S_BASIS = {
    "server_decode": "(completion_tokens - 1) / the server's own decode time, first to last output token "
                     "(vLLM metrics.generation_time_ms, SGLang /generate e2e_latency - first_token_latency)",
    "client_minus_prefill": "(completion_tokens - 1) / (client latency - prefill), prefill (which yields the "
                            "first token) as the server reports it "
                            "(ddscope prefill_ms, llama.cpp timings.prompt_ms) or the streamed time to first token",
    "client_latency": "completion_tokens / client latency: includes prefill (the server gives no timing)",
}


class RequestFailed(RuntimeError):
    """A request that produced no usable response; the message is recorded and the sweep goes on,
    unless nothing listens at the server's address any more (`unreachable`)."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


class ServerLost(Exception):
    """Raised inside `Sweep.run` to stop at the first request the server refused to connect."""


@dataclass
class SweepConfig:
    contexts: list[int]
    max_tokens: int
    repeats: int = 3
    warmup: int = 1
    first_prompt: int = 0  # the workload's prompt index of the first timed request
    workload: str = "padding"
    api: str = "completions"
    temperature: float = 0.0
    stream: bool = False
    model: str | None = None
    backend: str = "auto"
    timeout_s: float = 600.0
    clamp_contexts: bool = False  # default contexts: shrink those that do not fit max_model_len
    log_gap_s: float = 2.0        # idle time after each request when a server log is followed
    concurrency: tuple[int, ...] = (1,)  # requests in flight at a time; 1: one after another
    floor: dict[str, Any] | None = None  # the physical floor's options (ddscope.bench.limit.cli.FloorRequest)
    budget: int | str | None = None  # the tree size asked of a ddscope server, held fixed across contexts

    @property
    def levels(self) -> list[int]:
        return [c for c in self.concurrency if c > 1]

    def group_size(self, c: int) -> int:
        """Timed requests at concurrency `c`: at least `c`, so that `c` are in flight together."""
        return max(self.repeats, c)

    def timed_prompt(self, ci: int, r: int) -> int:
        """The workload's prompt index of repeat `r` at context `ci`: the set's start, from `first_prompt`."""
        return self.first_prompt + ci * self.repeats + r

    def concurrent_prompt(self, ci: int, level: int, r: int) -> int:
        """The prompt index of request `r` at concurrency level `level` (an index into `levels`) of context
        `ci`: after every sequential repeat, none shared, so no prefix cache serves one from another."""
        per_context = sum(self.group_size(c) for c in self.levels)
        ahead = sum(self.group_size(c) for c in self.levels[:level])
        return self.first_prompt + len(self.contexts) * self.repeats + ci * per_context + ahead + r

    def warmup_prompt(self, ci: int, w: int) -> int:
        """A warm-up's prompt index, counted back from the set's end (negative). It moves back `warmup` per
        `repeats` that `first_prompt` moves on, so sweeps one after another meet only once the set is used
        up: moving back one per `first_prompt` met the timed prompts halfway (a timed prompt then found a
        warm-up's in the prefix cache)."""
        return -1 - ci * self.warmup - w - self.first_prompt * self.warmup // self.repeats


def environment() -> dict[str, Any]:
    from ddscope.models.native import kernels  # torch: loaded only where the bench records its environment

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "packages": {p: version(p) for p in ("ddscope", "torch", "transformers", "httpx")},
        "kernels": kernels(),  # this machine's (the embedded server's), not a --url server's
    }


class ResultsWriter:
    """Keeps results.json and results.csv valid after every record."""

    def __init__(self, out_dir: Path, header: dict[str, Any]):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self.doc: dict[str, Any] = {"schema": SCHEMA, "status": "running", **header, "records": [], "errors": {}}
        self.flush()

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.doc["records"]

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if record.get("error"):
            errors = self.doc["errors"]
            errors[record["error"]] = errors.get(record["error"], 0) + 1
        self.flush()

    def update(self, **fields: Any) -> None:
        self.doc.update(fields)
        self.flush()

    def flush(self) -> None:
        atomic_write_text(self.out_dir / "results.json", json.dumps(self.doc, indent=1))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(self.records)
        atomic_write_text(self.out_dir / "results.csv", buf.getvalue())


def _error_message(resp: httpx.Response) -> str:
    """OpenAI-shape `{"error": {"message"}}`, the flat variant, or the raw text."""
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
    if not isinstance(body, dict):
        return f"HTTP {resp.status_code}: {str(body)[:200]}"
    err = body.get("error")
    message = err.get("message") if isinstance(err, dict) else err or body.get("message")
    return f"HTTP {resp.status_code}: {message or str(body)[:200]}"


def _merge_chunk(body: dict[str, Any], chunk: dict[str, Any]) -> None:
    # Telemetry rides the last chunks (usage, extensions); keep the latest non-null value per key.
    for key, value in chunk.items():
        if value is not None:
            body[key] = value


def post(client: httpx.Client, url: str, payload: dict[str, Any], stream: bool,
         timeout_s: float) -> tuple[dict[str, Any], float, float | None]:
    """Send one request: (response body, latency s, time to first token s or None)."""
    t0 = time.perf_counter()
    try:
        if not stream:
            resp = client.post(url, json=payload, timeout=timeout_s)
            latency = time.perf_counter() - t0
            if resp.status_code != 200:
                raise RequestFailed(_error_message(resp))
            return resp.json(), latency, None
        body: dict[str, Any] = {}
        ttft = None
        with client.stream("POST", url, json=payload, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                resp.read()
                raise RequestFailed(_error_message(resp))
            for line in resp.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - t0
                _merge_chunk(body, chunk)
        return body, time.perf_counter() - t0, ttft
    except httpx.TimeoutException as e:
        raise RequestFailed(f"timed out after {timeout_s:g} s") from e
    except httpx.ConnectError as e:  # refused: the server is gone (a dying one drops the request in flight)
        raise RequestFailed(f"{type(e).__name__}: {e}", unreachable=True) from e
    except httpx.HTTPError as e:
        raise RequestFailed(f"{type(e).__name__}: {e}") from e
    except ValueError as e:  # JSON decoding
        raise RequestFailed(f"unreadable response: {e}") from e


def acceptance_fields(acc: Reading, completion: int, tps: float) -> dict[str, Any]:
    """The record's acceptance: delivered avg_commit where the source counts verify steps, else the
    server's own figure (`avg_commit_basis` says which); the server's figure is kept beside it."""
    if isinstance(acc, str):
        return {"avg_commit": None, "server_avg_commit": None, "avg_commit_basis": None, "verify_steps": None,
                "step_ms": None, "acceptance_note": acc}
    truth = delivered(acc, completion)
    avg = truth if truth is not None else acc.avg_commit
    return {"avg_commit": avg, "server_avg_commit": acc.avg_commit,
            "avg_commit_basis": "delivered" if truth is not None else "server", "verify_steps": acc.verify_steps,
            "step_ms": 1000.0 * avg / tps, "acceptance_note": None}


def decode_rate(backend: str, body: dict[str, Any], completion: int, latency: float,
                ttft: float | None) -> tuple[float, str, float | None]:
    """(tok/s, basis, prefill s): the server's own decode timing, else client latency less prefill
    (which yields the first token), else the whole latency (which then includes prefill)."""
    decode = server_decode(backend, body, completion)
    if decode is not None:
        return decode[0] / decode[1], "server_decode", None
    prefill = server_prefill_s(backend, body)
    prefill = prefill if prefill is not None else ttft
    if prefill is not None and prefill < latency and completion > 1:
        return (completion - 1) / (latency - prefill), "client_minus_prefill", prefill
    return completion / latency, "client_latency", prefill


class Sweep:
    """One sweep against one server: probe, then warmup and timed repeats per context."""

    def __init__(self, cfg: SweepConfig, base_url: str, client: httpx.Client, tokenizer: Tokenizer | None = None,
                 log: ServerLog | None = None, tokenizer_origin: str = "--tokenizer"):
        self.cfg = cfg
        self.tokenizer_origin = tokenizer_origin if tokenizer is not None else "none (sized from a probe)"
        self.client = client
        self.server = Server(base_url, client)
        self.tokenizer = tokenizer
        self.log = log
        self.workload = load_workload(cfg.workload)
        self.backend = cfg.backend if cfg.backend != "auto" else self.server.detect()
        info = self.server.models()
        self.model = cfg.model or info.get("id")
        self.model_root, self.dtype = info.get("root"), info.get("dtype")  # vLLM's card and ddscope's name both
        self.max_model_len = Server.context_limit(info)
        if cfg.clamp_contexts and self.max_model_len:
            room = max(1, self.max_model_len - cfg.max_tokens)
            cfg.contexts = sorted({min(c, room) for c in cfg.contexts})
        self.reader = AcceptanceReader(self.backend, self.server)
        self.extras: dict[str, Any] = {}
        self.token_ids = tokenizer is not None and cfg.api == "completions"  # exact lengths
        self.chars_per_token = 4.0  # replaced by the probe when prompts are text
        self.template_tokens = 0  # chat template tokens around the content, measured by the probe
        self.basis = "client_latency"
        self.decoding: dict[str, Any] = {"method": None, "budget": None}  # as the probe's response says
        self.lost: str | None = None  # why the sweep stopped early: the server stopped accepting connections

    def url(self, route: str) -> str:
        path = {"generate": "/generate", "chat": "/v1/chat/completions"}.get(route, "/v1/completions")
        return self.server.base_url + path

    @property
    def openai_route(self) -> str:
        return "chat" if self.cfg.api == "chat" else "completions"

    def prompt(self, context: int, index: int) -> list[int] | str:
        """Token ids where possible (exact length); text for chat or without a tokenizer."""
        if self.tokenizer is None:
            return fit_text(self.workload, index, context, self.chars_per_token)
        ids = fit_ids(self.workload, index, max(1, context - self.template_tokens), self.tokenizer)
        return ids if self.token_ids else self.tokenizer.decode(ids)

    def payload(self, route: str, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
        schema = self.workload.schema
        if route == "generate":  # SGLang native; source: sglang/srt/managers/io_struct.py:185,188,227
            params = {"max_new_tokens": max_tokens, "temperature": self.cfg.temperature, "ignore_eos": True}
            return {"input_ids" if isinstance(prompt, list) else "text": prompt, "stream": False,
                    "sampling_params": {**params, **(constraint_fields(self.backend, route, schema) if schema else {})}}
        extras = {k: v for k, v in self.extras.items() if not (self.cfg.stream and k == "return_meta_info")}
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": self.cfg.temperature,
                                "ignore_eos": True, "stream": self.cfg.stream, **extras,
                                **(constraint_fields(self.backend, route, schema) if schema else {})}
        if self.model:
            body["model"] = self.model
        if self.cfg.stream:
            body["stream_options"] = {"include_usage": True}
        if route == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    def _send(self, route: str, prompt: list[int] | str, max_tokens: int) -> tuple[dict[str, Any], float, float | None]:
        stream = self.cfg.stream and route != "generate"
        return post(self.client, self.url(route), self.payload(route, prompt, max_tokens), stream, self.cfg.timeout_s)

    def _observe(self, route: str, prompt: list[int] | str) -> tuple[Observation, float | None, float]:
        """One probe request on `route` with scrapes around it (and a log window when following one)."""
        before, t0 = self.server.metrics(), time.time()
        try:
            body, latency, ttft = self._send(route, prompt, PROBE_TOKENS)
        finally:
            logged = self._close_window(t0, untimed=True)
        completion = usage_of(body)[1] or 0
        return Observation(body, completion, before, self.server.metrics(), logged), ttft, latency

    def _close_window(self, started: float, untimed: bool = False) -> WindowReading | None:
        """Close the request's log window, wait the idle gap so windows never touch, then read the
        window: its last lines have arrived by then. An untimed request (probe, warm-up) gets a
        context-layer window of its own too, so no context's reading takes in its traffic."""
        if self.log is None:
            return None
        ended = time.time()
        window = self.log.window(started, ended)
        if untimed:
            self.log.window(started, ended, "context")
        time.sleep(self.cfg.log_gap_s)
        return self.log.read(window)

    def _read_context(self, opened: float, records: list[dict[str, Any]]) -> None:
        """The log over one context's timed repeats: recorded on each of them, and their acceptance
        where the log is the source and their own windows held no line."""
        timed = [r for r in records if not r["error"]]
        if self.log is None or not timed:
            return
        reading = self.log.read(self.log.window(opened, timed[-1]["ended_at"], "context"))
        for r in timed:
            r.update(log_context_avg_commit=reading.avg_commit, log_context_lines=reading.lines)
            if self.reader.source.kind == "log" and r["avg_commit"] is None and reading.avg_commit is not None:
                got = Acceptance(reading.avg_commit, None, self.reader.source)
                r.update(acceptance_fields(got, r["completion_tokens"], r["tok_per_s"]), avg_commit_basis="server_context")

    def controlled(self) -> dict[str, Any]:
        """What the sweep holds fixed on a ddscope server besides the prompt's length: the tree size (`auto`
        would size each context's tree differently, a second variable moving with the one under test)."""
        return {"budget": self.cfg.budget} if self.backend == "ddscope" and self.cfg.budget is not None else {}

    def probe(self) -> None:
        """Short requests that pick the request extras the server accepts, token-id or text prompts,
        the route and acceptance source, and (for text prompts) the characters per token."""
        last_error = "no request sent"
        for token_ids in dict.fromkeys((self.token_ids, False)):
            self.token_ids = token_ids
            size = min(64, *self.cfg.contexts)  # short, yet long enough to calibrate chars per token
            prompt = self.prompt(size, 0) if self.tokenizer else fit_text(self.workload, 0, size, 4.0)
            for extras in REQUEST_EXTRAS.get(self.backend, [{}]):
                self.extras = {**extras, **self.controlled()}
                try:
                    obs, ttft, latency = self._observe(self.openai_route, prompt)
                except RequestFailed as e:
                    last_error = str(e)
                    continue
                seen: dict[str, Observation | str] = {"openai": obs}
                if self.backend == "sglang":
                    seen["generate"] = self._probe_generate(prompt)
                self.reader.choose(seen)
                chosen = seen[self.reader.route]
                assert isinstance(chosen, Observation)  # choose() only picks a route it observed
                self.basis = decode_rate(self.backend, chosen.body, max(chosen.completion_tokens, 1),
                                         latency, ttft)[1]
                self._calibrate(prompt, size, obs.body)
                self.decoding = decoding_method(self.backend, chosen.body)
                return
        raise RequestFailed(f"the probe request failed: {last_error}")

    def _probe_generate(self, prompt: list[int] | str) -> Observation | str:
        """SGLang's native /generate, whose meta_info carries spec_verify_ct whenever it speculates;
        or why it was not used. It takes raw prompts, so it stands in for /v1/completions only."""
        if self.cfg.stream or self.cfg.api == "chat":
            return "/generate stands in for non-streamed /v1/completions only"
        try:
            return self._observe("generate", prompt)[0]
        except RequestFailed as e:
            return f"/generate failed: {e}"

    def _calibrate(self, prompt: list[int] | str, size: int, body: dict[str, Any]) -> None:
        prompt_tokens = usage_of(body)[0]
        if isinstance(prompt, str) and prompt_tokens:
            self.chars_per_token = len(prompt) / float(prompt_tokens)
            if self.tokenizer is not None and self.cfg.api == "chat":
                self.template_tokens = max(0, prompt_tokens - size)

    def measure(self, context: int, repeat: int, index: int, concurrency: int = 1) -> dict[str, Any]:
        """One timed request -> one record (with `error` set when it failed). Under `concurrency` > 1 other
        requests are in flight: counters differenced around it and log windows hold theirs too, so only a
        per-request acceptance source is read."""
        record: dict[str, Any] = {"label": self.workload.label, "context": context, "repeat": repeat,
                                  "concurrency": concurrency, "error": None}
        alone = concurrency == 1
        if self.max_model_len and context + self.cfg.max_tokens > self.max_model_len:
            record["error"] = f"context + max_tokens exceeds the server's context limit {self.max_model_len}"
            return record
        route = self.openai_route if self.reader.route == "openai" else self.reader.route
        try:
            prompt = self.prompt(context, index)
        except TokenizerError as e:  # the server's /tokenize: the server is gone
            record["error"] = str(e)
            self.lost = self.lost or f"the server stopped answering: {e}"
            return record
        record["prompt_sha1"] = hashlib.sha1(json.dumps(prompt).encode()).hexdigest()[:12]  # which prompt: pooling
        before, started = self.reader.snapshot() if alone else None, time.time()
        record["started_at"] = started  # wall clock, to match server log lines against
        try:
            body, latency, ttft = self._send(route, prompt, self.cfg.max_tokens)
        except RequestFailed as e:
            record["error"] = str(e)
            self.lost = self.lost or (f"the server stopped answering: {e}" if e.unreachable else None)
            return record
        finally:
            record["ended_at"] = time.time()
            logged = self._close_window(started, untimed=repeat < 0) if alone else None
        prompt_tokens, completion = usage_of(body)
        if not completion:
            record["error"] = "the response has no usage.completion_tokens"
            return record
        tps, basis, prefill = decode_rate(self.backend, body, completion, latency, ttft)
        if alone or self.reader.source.kind == "per_request":
            acc = self.reader.read(body, completion, before, logged)
        else:
            acc = (f"{self.reader.source.name} cannot separate concurrent requests (its counters or log windows "
                   "take in the others'); only a per-request source can")
        record.update(ttft_s=None if ttft is None else round(ttft, 6))
        record.update(
            prompt_tokens=prompt_tokens or context, cached_tokens=cached_of(body), completion_tokens=completion,
            response_id=body.get("id"), text_sha1=text_digest(body),
            latency_s=round(latency, 6), prefill_s=None if prefill is None else round(prefill, 6), tok_per_s=tps,
            tok_per_s_basis=basis, e2e_tok_per_s=completion / latency, engine_step_ms=engine_step_ms(self.backend, body),
            grammar_ms=grammar_ms(self.backend, body),
            commits=step_commits(self.backend, body, completion), nodes_per_step=nodes_per_step(self.backend, body),
            **acceptance_fields(acc, completion, tps))
        record.update(loop_fields(body, record["commits"]))
        if logged is not None:
            record.update(log_avg_commit=logged.avg_commit, log_lines=logged.lines,
                          log_straddling=logged.straddling, log_formats=logged.formats)
        return record

    def measure_together(self, context: int, concurrency: int, indices: list[int]) -> list[dict[str, Any]]:
        """Requests for `indices`, `concurrency` in flight at a time; each record also carries the group's
        aggregate tok/s (its completion tokens over the group's wall time)."""
        t0 = time.time()
        with ThreadPoolExecutor(concurrency) as pool:
            records = list(pool.map(lambda ri: self.measure(context, ri[0], ri[1], concurrency), enumerate(indices)))
        wall = time.time() - t0
        tokens = sum(r.get("completion_tokens") or 0 for r in records if not r["error"])
        for r in records:
            r.update(group_wall_s=round(wall, 6), aggregate_tok_per_s=tokens / wall)
        return records

    def header(self) -> dict[str, Any]:
        return {
            "config": asdict(self.cfg),
            "environment": environment(),
            "backend": {"name": self.backend, "url": self.server.base_url, "model": self.model,
                        "model_root": self.model_root, "dtype": self.dtype,
                        "max_model_len": self.max_model_len, **self.decoding, "request_extras": self.extras,
                        "route": self.url(self.openai_route if self.reader.route == "openai" else self.reader.route),
                        "prompt_format": "token_ids" if self.token_ids else "text",
                        "prompt_tokenizer": self.tokenizer_origin,
                        "constraint": constraint_fields(self.backend, self.openai_route, self.workload.schema)
                        if self.workload.schema else None},
            "acceptance_source": self.reader.source.to_dict(),
            "acceptance_refused": self.reader.refused,
            "tok_per_s": self._bases([]),
        }

    def _bases(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """The header's tok/s basis, from what the timed requests had (none yet: the probe's)."""
        bases = sorted({r["tok_per_s_basis"] for r in records if r.get("tok_per_s_basis")}) or [self.basis]
        if len(bases) == 1:
            return {"basis": bases[0], "includes_prefill": bases[0] == "client_latency",
                    "definition": TOK_PER_S_BASIS[bases[0]]}
        return {"basis": "mixed", "includes_prefill": "client_latency" in bases,
                "definition": "; ".join(f"{b}: {TOK_PER_S_BASIS[b]}" for b in bases)}

    def run(self, out_dir: Path, on_request: Callable[[str], None] = lambda note: None) -> str:
        """Probe, then per context `warmup` unrecorded and `repeats` recorded requests; returns the status.
        Ctrl-C ends the sweep with the files marked interrupted; a server that no longer accepts
        connections ends it marked aborted, with the reason in `abort_reason`."""
        if self.log is not None:
            time.sleep(self.cfg.log_gap_s)  # lines already in the pipe (a journal's backlog) arrive first
        self.probe()
        writer = ResultsWriter(out_dir, self.header())
        status = "complete"
        try:
            for ci, context in enumerate(self.cfg.contexts):
                for w in range(self.cfg.warmup):  # prompts of their own, counted from the set's end: a timed
                    # real prompt must not find itself in a prefix cache (padding prompts are all the same)
                    self.measure(context, -1, self.cfg.warmup_prompt(ci, w))
                    on_request(f"ctx {context}: warmup")
                    if self.lost:
                        raise ServerLost
                opened, timed = time.time(), []
                for r in range(self.cfg.repeats if 1 in self.cfg.concurrency else 0):
                    record = self.measure(context, r, self.cfg.timed_prompt(ci, r))
                    writer.add(record)
                    timed.append(record)
                    on_request(_note(record))
                    if self.lost:
                        raise ServerLost
                self._read_context(opened, timed)
                for li, c in enumerate(self.cfg.levels):
                    for record in self.measure_together(context, c, [self.cfg.concurrent_prompt(ci, li, r) for r
                                                                     in range(self.cfg.group_size(c))]):
                        writer.add(record)
                        on_request(_note(record))
                    if self.lost:
                        raise ServerLost
                writer.flush()
        except KeyboardInterrupt:
            status = "interrupted"
        except ServerLost:
            status = "aborted"
        extra = {"server_log": self.log.summary(self.cfg.log_gap_s)} if self.log is not None else {}
        if self.lost:
            extra["abort_reason"] = self.lost
        writer.update(status=status, finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
                      tok_per_s=self._bases(writer.records), **extra)
        return status


def _note(record: dict[str, Any]) -> str:
    if record["error"]:
        return f"ctx {record['context']}: error"
    return f"ctx {record['prompt_tokens']}: {record['tok_per_s']:.1f} tok/s"
