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
from typing import Any


def usage(stats: dict[str, Any]) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.cached_tokens` as vLLM and SGLang report prefix-cache hits."""
    prompt, completion = stats["prompt_tokens"], stats["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": stats["cached_tokens"]}}


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

    def response(self, text: str, finish_reason: str, stats: dict[str, Any],
                 matched_stop: int | str | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        choice["matched_stop"] = matched_stop
        return {**self._envelope(True, [choice]), "usage": usage(stats), "ddscope": stats}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              matched_stop: int | str | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
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
