"""OpenAI response and SSE chunk bodies for /v1/completions and /v1/chat/completions.

Every final body (the response, or the last streamed chunk) carries the `ddscope` extension:
the engine's generation stats, documented in docs/server.md. Final choices carry SGLang's
`matched_stop` (sglang/srt/entrypoints/openai/protocol.py:511, serving_completions.py:610-620 in
0.5.23): the EOS id or stop string the generation stopped on, null otherwise. The text leaves the EOS
out, so a client of a target with several EOS ids can still tell which one ended it.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ddscope.structured.tool_parsers import ToolParser
from ddscope.speculative.sampling import TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def usage(stats: dict[str, Any]) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.cached_tokens` as vLLM and SGLang report prefix-cache hits."""
    prompt, completion = stats["prompt_tokens"], stats["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": stats["cached_tokens"]}}


def spec_decode_record(rounds: list[Any], num_spec_tokens: int) -> dict[str, Any]:
    """vLLM 0.32's `metrics.speculative_decoding` (vllm/entrypoints/generate/base/protocol.py:100-119) for one
    sequence's rounds, every engine step a step (drafted or not), so mean_acceptance_length is ddscope's avg_commit:
    j = tokens committed - 1, drafted = draft nodes verified (what the tree cost), counts as delivered. The
    per-step arrays are kept for `detailed`; `summary` drops them."""
    accepted = [r.committed - 1 for r in rounds]
    drafted = [r.nodes for r in rounds]
    width = max([num_spec_tokens, *accepted])
    histogram = [0] * (width + 1)
    for j in accepted:
        histogram[j] += 1
    steps, total, proposed = len(rounds), sum(accepted), sum(drafted)
    return {"mean_acceptance_length": 1 + total / steps if steps else 0.0,
            "draft_acceptance_rate": total / proposed if proposed else 0.0, "acceptance_histogram": histogram,
            "num_spec_steps": steps, "num_accepted_draft_tokens": total, "num_draft_tokens": proposed,
            "num_spec_tokens": width, "per_step_accepted": accepted, "per_step_drafted": drafted}


def timing_record(arrival: float, start: float, first: float, last: float, tokens: int) -> dict[str, Any]:
    """vLLM's per-request timing (`--enable-per-request-metrics`; generate/base/serving.py:45-97): TTFT from
    scheduling, generation from the first token to the last, queue time, mean ITL, and tokens over the inference."""
    return {"time_to_first_token_ms": 1e3 * (first - start), "generation_time_ms": 1e3 * (last - first),
            "queue_time_ms": 1e3 * (start - arrival),
            "mean_itl_ms": 1e3 * (last - first) / (tokens - 1) if tokens > 1 else None,
            "tokens_per_second": tokens / (last - start) if last > start else None}


def per_request_metrics(records: list[dict[str, Any]], level: str, timing: bool) -> dict[str, Any] | None:
    """The response's `metrics`, as vLLM builds it: None unless one sequence answers the request, or nothing asked."""
    if len(records) != 1 or (level == "none" and not timing):
        return None
    out = {k: v for k, v in records[0]["timing"].items() if v is not None} if timing else {}
    if level != "none":
        spec = records[0]["spec"]
        out["speculative_decoding"] = spec if level == "detailed" else {
            k: v for k, v in spec.items() if not k.startswith("per_step_")}
    return out


def total_usage(stats: list[dict[str, Any]], shared: int = 1) -> dict[str, Any]:
    """One usage over a batch of choices, each run of `shared` choices answering one prompt: its prompt counted
    once, as vLLM counts n > 1 (chat_completion/serving.py:1095-1105)."""
    prompts = stats[::shared]
    return usage({"prompt_tokens": sum(s["prompt_tokens"] for s in prompts),
                  "cached_tokens": sum(s["cached_tokens"] for s in prompts),
                  "completion_tokens": sum(s["completion_tokens"] for s in stats)})


class Logprobs:
    """One choice's OpenAI logprobs objects, chunk by chunk: the legacy completions shape (tokens,
    token_logprobs, top_logprobs with the chosen token among them, text_offset running across chunks),
    or chat's `content` list. Token strings are decoded one id at a time, so call it on the tokenizer's thread."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat: bool, offset: int = 0):
        self.tokenizer, self.chat, self.offset = tokenizer, chat, offset

    def render(self, ids: list[int], lps: list[TokenLogprob | None]) -> dict[str, Any]:
        text = [self.tokenizer.decode([t]) for t in ids]
        if self.chat:
            return {"content": [self._chat_entry(s, lp) for s, lp in zip(text, lps)]}
        offsets = []
        for s in text:
            offsets.append(self.offset)
            self.offset += len(s)
        tops = [None if lp is None else {**{self.tokenizer.decode([i]): v for i, v in lp[1]}, s: lp[0]}
                for s, lp in zip(text, lps)]
        return {"tokens": text, "token_logprobs": [None if lp is None else lp[0] for lp in lps],
                "top_logprobs": tops, "text_offset": offsets}

    def _chat_entry(self, token: str, lp: TokenLogprob) -> dict[str, Any]:
        def entry(s: str, v: float) -> dict[str, Any]:
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
        return {**entry(token, lp[0]), "top_logprobs": [entry(self.tokenizer.decode([i]), v) for i, v in lp[1]]}


def merge_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Logprobs objects of consecutive pieces of one choice (an echoed prompt, then the completion), as one."""
    if not parts:
        return None
    return {key: [x for part in parts for x in part[key]] for key in parts[0]}


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


@dataclass
class Reply:
    """Builds the bodies of one request's answer, in the completions or the chat format."""

    chat: bool
    model: str
    include_usage: bool = False  # stream_options.include_usage
    id: str = ""
    tool: ToolParser | None = None  # chat whose tools' calls are read (tool_choice other than none)
    shared: int = 1  # choices per prompt (n): usage counts each prompt once
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _envelope(self, final: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion" if final else "chat.completion.chunk"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def choice(self, text: str, finish_reason: str, matched_stop: int | str | None = None,
               logprobs: dict[str, Any] | None = None, index: int = 0, **extra: Any) -> dict[str, Any]:
        """One final choice; `extra`: vLLM's per-choice fields asked for (token_ids, prompt_token_ids, ...)."""
        if self.chat and self.tool:
            content, calls = self.tool.extract(text)
            body = {"index": index, "message": {"role": "assistant", "content": content,
                                                "tool_calls": [c.to_dict() for c in calls]}}
            finish_reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
        elif self.chat:
            body = {"index": index, "message": {"role": "assistant", "content": text}}
        else:
            body = {"index": index, "text": text}
        return {**body, "logprobs": logprobs, "finish_reason": finish_reason, "matched_stop": matched_stop, **extra}

    def response(self, choices: list[dict[str, Any]], stats: list[dict[str, Any]],
                 metrics: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        """The whole answer; the `ddscope` extension is one choice's stats, or a list for several; `metrics` is
        vLLM's per-request object, at the body's root, as are `extra` (chat's prompt_token_ids, ...)."""
        return {**self._envelope(True, choices), "usage": total_usage(stats, self.shared), **extra,
                **({"metrics": metrics} if metrics is not None else {}),
                "ddscope": stats[0] if len(stats) == 1 else stats}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              matched_stop: int | str | None = None, logprobs: dict[str, Any] | None = None, index: int = 0,
              delta: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        """One streamed chunk of choice `index`; `extra` goes on the choice (token_ids, prompt_token_ids); chat's
        `delta` is given whole (tool calls) or made of the text."""
        if self.chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason:
            choice["matched_stop"] = matched_stop
        body = self._envelope(False, [{**choice, **extra}])
        if self.include_usage:  # as OpenAI: usage is null on every chunk but the last
            body["usage"] = None
        return body

    def usage_chunk(self, stats: list[dict[str, Any]], metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """The chunk with no choices that ends an include_usage stream; it carries vLLM's per-request `metrics`
        as vLLM's does (completion/serving.py:458-490 in vLLM 0.32)."""
        return {**self._envelope(False, []), "usage": total_usage(stats, self.shared),
                **({"metrics": metrics} if metrics is not None else {})}


def prompt_logprobs(tokenizer: PreTrainedTokenizerBase, ids: list[int], lps: list[TokenLogprob | None]
                    ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` (logprobs.py:165-209 in 0.32): null for the first token, then per token a map of
    id -> {logprob, rank, decoded_token}, the prompt's own token first and then the top N; -inf as -9999.0."""
    def entry(token: int, value: float, rank: int) -> dict[str, Any]:
        return {"logprob": max(value, -9999.0), "rank": rank, "decoded_token": tokenizer.decode([token])}

    out: list[dict[str, dict[str, Any]] | None] = []
    for token, lp in zip(ids, lps):
        if lp is None:
            out.append(None)
            continue
        ranked = {str(token): entry(token, lp.logprob, lp.rank)}
        for rank, (other, value) in enumerate(lp.top, 1):
            ranked.setdefault(str(other), entry(other, value, rank))
        out.append(ranked)
    return out
