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

from ddscope.sampling import TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def usage(stats: dict[str, Any]) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.cached_tokens` as vLLM and SGLang report prefix-cache hits."""
    prompt, completion = stats["prompt_tokens"], stats["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": stats["cached_tokens"]}}


def total_usage(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One usage over a batch of choices."""
    keys = ("prompt_tokens", "completion_tokens", "cached_tokens")
    return usage({k: sum(s[k] for s in stats) for k in keys})


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
               logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
        if self.chat:
            body = {"index": index, "message": {"role": "assistant", "content": text}}
        else:
            body = {"index": index, "text": text}
        return {**body, "logprobs": logprobs, "finish_reason": finish_reason, "matched_stop": matched_stop}

    def response(self, choices: list[dict[str, Any]], stats: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole answer; the `ddscope` extension is one choice's stats, or a list for a batch of prompts."""
        return {**self._envelope(True, choices), "usage": total_usage(stats),
                "ddscope": stats[0] if len(stats) == 1 else stats}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              matched_stop: int | str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason:
            choice["matched_stop"] = matched_stop
        body = self._envelope(False, [choice])
        if self.include_usage:  # as OpenAI: usage is null on every chunk but the last
            body["usage"] = None
        return body

    def final_chunks(self, finish_reason: str, stats: dict[str, Any],
                     matched_stop: int | str | None = None) -> list[dict[str, Any]]:
        """The finish_reason chunk, then (with include_usage) the usage chunk with no choices.

        The `ddscope` extension rides on whichever of them is last before `[DONE]`.
        """
        chunks = [self.chunk(None, finish_reason, matched_stop=matched_stop)]
        if self.include_usage:
            chunks.append({**self._envelope(False, []), "usage": usage(stats)})
        chunks[-1]["ddscope"] = stats
        return chunks
