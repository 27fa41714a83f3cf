"""One long generation, traced step by step from the server's own stream.

vLLM emits each engine step's new tokens as one streamed delta (and SGLang does at its default stream interval of
1), so a stream is a per-step record: a chunk's tokens are a step's commit, the gap before it the step's time.
The first chunk is the prefill's token. Tokens per chunk are counted from the chunk's logprobs (`logprobs: 0`
asks every OpenAI-compatible server for them), never guessed from text.

Boundaries are checked, never assumed: the chunks' tokens must sum to `usage.completion_tokens`; against ddscope,
each step's commit must equal its `return_rounds` entry; against vLLM, the accepted drafts must equal its
spec-decode counters' delta. A server that streams token by token while it speculates, or whose steps the
counters say were coalesced or split, gives a trace marked approximate, with the reason.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ddscope.bench.collecting.backends import Scrape

SCHEMA = "ddscope.bench.trace/1"
SKIP_STEPS = 2  # the first steps after the prefill carry warm-up (allocation, the drafter's first pass)


class StreamFailed(Exception):
    """The stream could not be read: `partial` holds what arrived."""

    def __init__(self, message: str, partial: "Stream"):
        super().__init__(message)
        self.partial = partial


@dataclass
class Stream:
    """What one streamed request delivered: (seconds since sent, tokens) per chunk that carried tokens, and the
    final body merged from the last chunks (usage, extensions)."""
    chunks: list[tuple[float, int]] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)
    counted: str = "logprobs"  # how tokens per chunk were counted: logprobs, token_ids, or "text" (1 a chunk)
    tokens: list[Any] = field(default_factory=list)  # the generated tokens as the chunks give them (loops are found on them)


def _chunk_tokens(choice: dict[str, Any]) -> tuple[list[Any], str]:
    """The chunk's tokens (their strings or ids; a whole text as one where nothing counts them) and how counted."""
    logprobs = choice.get("logprobs") or {}
    if isinstance(logprobs.get("tokens"), list):  # completions
        return logprobs["tokens"], "logprobs"
    if isinstance(logprobs.get("content"), list):  # chat
        return [e.get("token") for e in logprobs["content"]], "logprobs"
    if isinstance(choice.get("token_ids"), list):  # vLLM's return_token_ids
        return choice["token_ids"], "token_ids"
    text = choice.get("text") or (choice.get("delta") or {}).get("content")
    return ([text] if text else []), "text"


def read_stream(client: httpx.Client, url: str, payload: dict[str, Any], timeout_s: float) -> Stream:
    """Send one streamed request and record every chunk; StreamFailed (with the partial stream) when the server
    refuses to stream or drops the stream before `[DONE]`."""
    out, done, t0 = Stream(), False, time.perf_counter()
    try:
        with client.stream("POST", url, json=payload, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                resp.read()
                raise StreamFailed(f"HTTP {resp.status_code}: {resp.text[:200]}", out)
            if "text/event-stream" not in resp.headers.get("content-type", ""):
                raise StreamFailed(f"the server does not stream (content-type {resp.headers.get('content-type')!r})",
                                   out)
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                if line[5:].strip() == "[DONE]":
                    done = True
                    break
                chunk = json.loads(line[5:])
                now = time.perf_counter() - t0
                for choice in chunk.get("choices") or []:
                    tokens, how = _chunk_tokens(choice)
                    if tokens:
                        out.chunks.append((now, len(tokens)))
                        out.tokens += tokens
                        out.counted = how if out.counted != "text" else "text"
                out.body.update({k: v for k, v in chunk.items() if v is not None})
    except httpx.HTTPError as e:
        raise StreamFailed(f"{type(e).__name__}: {e}", out) from e
    except ValueError as e:
        raise StreamFailed(f"unreadable chunk: {e}", out) from e
    if not done:
        raise StreamFailed("the stream ended before [DONE]", out)
    return out


def steps_of(stream: Stream, prompt_tokens: int) -> list[dict[str, Any]]:
    """Per step after the prefill's chunk: generated position of its first token, the context it ran on, the
    tokens it committed, and the gap since the chunk before (ms)."""
    steps, position = [], 0
    for i, (t, n) in enumerate(stream.chunks):
        if i:
            steps.append({"position": position, "context": prompt_tokens + position, "commit": n,
                          "gap_ms": 1e3 * (t - stream.chunks[i - 1][0])})
        position += n
    return steps


# ---- checks against the server's own truth ---------------------------------------------------------------

@dataclass
class Checks:
    tokens_sum: int
    completion_tokens: int | None
    approximate: bool = False
    reasons: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        self.approximate = True
        self.reasons.append(reason)


def check(stream: Stream, steps: list[dict[str, Any]], backend: str, speculating: bool | None,
          counters: tuple[Scrape | None, Scrape | None] | None = None) -> Checks:
    """Whether the chunks are the server's steps: token totals, per-step truth where the server has it, and the
    signs of steps split (one token a chunk under speculation) or coalesced (bursts faster than a step)."""
    usage = stream.body.get("usage") or {}
    c = Checks(sum(n for _, n in stream.chunks), usage.get("completion_tokens"))
    if c.completion_tokens is None:
        c.fail("the stream carried no usage (stream_options.include_usage): token totals unchecked")
    elif c.tokens_sum != c.completion_tokens:
        c.fail(f"the chunks hold {c.tokens_sum} tokens and usage says {c.completion_tokens}")
    if stream.counted == "text":
        c.fail("chunks carried no logprobs or token ids: each was counted as one token")
    if backend == "ddscope":
        _check_rounds(c, stream, steps)
    if backend == "vllm" and counters is not None:
        _check_counters(c, steps, *counters)
    if speculating is not False and len(steps) > 1 and all(s["commit"] == 1 for s in steps):
        c.fail("every chunk holds one token while the server speculates: it streams token by token, so a chunk "
               "is not a step (llama.cpp does; SGLang with --stream-interval 1 does not)" if speculating else
               "every chunk holds one token and the server does not say whether it drafted: the chunks are steps "
               "only if it decoded without speculation")
    gaps = sorted(s["gap_ms"] for s in steps)
    if len(gaps) >= 8 and gaps[len(gaps) // 4] < 0.1 * gaps[3 * len(gaps) // 4]:
        c.fail("a quarter of the chunks arrive within a tenth of the usual gap (its 75th percentile) after the one "
               "before: something between the engine and the client coalesces and splits them (a proxy's buffer, "
               "a stream interval)")
    return c


def _check_rounds(c: Checks, stream: Stream, steps: list[dict[str, Any]]) -> None:
    """ddscope's `return_rounds`: each step's commit and the engine's own step time."""
    rounds = (stream.body.get("ddscope") or {}).get("rounds")
    if not isinstance(rounds, list):
        c.fail("ddscope's final chunk has no rounds (return_rounds): steps unchecked")
        return
    commits = [int(r["committed"]) for r in rounds]
    mine = [s["commit"] for s in steps]
    c.facts["rounds_equal"] = commits == mine
    if commits != mine:
        c.fail(f"the stream's {len(mine)} steps differ from the server's {len(rounds)} rounds")
        return
    engine = [sum(r[f"{p}_ms"] for p in ("draft", "tree", "verify", "commit")) for r in rounds]
    for s, e, r in zip(steps, engine, rounds):
        s["engine_step_ms"], s["nodes"] = e, int(r["nodes"]) + 1  # tokens the step verified, root included
    late = slice(SKIP_STEPS, None) if len(steps) > SKIP_STEPS else slice(None)
    if not steps:
        return
    gap, own = statistics.median(s["gap_ms"] for s in steps[late]), statistics.median(engine[late])
    jitter = sorted(abs(s["gap_ms"] - e) for s, e in zip(steps[late], engine[late]))
    c.facts.update(median_gap_ms=gap, median_engine_step_ms=own, gap_over_engine=gap / own if own else None,
                   jitter_p50_ms=jitter[len(jitter) // 2] if jitter else None,
                   jitter_p90_ms=jitter[int(0.9 * (len(jitter) - 1))] if jitter else None)


VLLM_ACCEPTED, VLLM_DRAFTS = "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total"


def _check_counters(c: Checks, steps: list[dict[str, Any]], before: Scrape | None, after: Scrape | None) -> None:
    """vLLM's counters around the request: accepted drafts (each step's commit less its bonus token) and drafts
    (one per step that drafted). vLLM counts drafts accepted past max_tokens, so its last step may exceed."""
    if before is None or after is None or VLLM_ACCEPTED not in after.values:
        c.fail("vLLM's /metrics has no spec-decode counters: steps unchecked")
        return

    def delta(name: str) -> float:
        return sum(after.values.get(name, [])) - sum(before.values.get(name, []))

    accepted, drafts = delta(VLLM_ACCEPTED), delta(VLLM_DRAFTS)
    mine = sum(s["commit"] - 1 for s in steps)
    c.facts.update(counter_accepted=accepted, trace_accepted=mine, counter_drafts=drafts, trace_steps=len(steps))
    if not mine <= accepted <= mine + 16 or abs(drafts - len(steps)) > 1:
        c.fail(f"vLLM's counters say {accepted:.0f} accepted drafts over {drafts:.0f} steps; the stream "
               f"{mine} over {len(steps)}: its chunks are not its steps")
