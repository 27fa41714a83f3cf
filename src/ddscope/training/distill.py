"""Self-distillation data for drafter training: the target's own continuations of corpus prompts.

Each record of the cache (`distill.<worker>.jsonl`) is one prompt and the target's continuation of it, as
token ids, with `prompt_len` so training can mask the prompt. Generation goes through the Engine
(`ar`, or `ddtree` with an existing drafter: both lossless), greedy for some items and sampled at
T=1 for the others, so the drafter sees both the argmax path and the spread around it. The prompt
list is a pure function of (data, seed), so a rerun appends only the items still missing.

With a context-length mix (`context_lengths`), each prompt is grown to a drawn length by prepending
earlier text of its own kind (whole files, documents or conversations; the sentence itself for
`padding`), so the target's continuation, and with it the drafter's anchors, sit deep in a context.
"""
from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ddscope.training.contexts import parse_context_lengths, sample_length
from ddscope.training.corpus import IM_START, READERS, iter_documents
from ddscope.util.atomic import atomic_write_text

ASSISTANT_HEADER = f"{IM_START}assistant\n"
# Corpus prompts: code, docs and pydoc are windows of a document (code often ending at a docstring), chat
# is a conversation up to its first reply. The default needs only the README's install (docs needs apt).
DEFAULT_DATA = "code:0.5,pydoc:0.2,chat:0.3"
# `padding`: one prose sentence repeated, then a short instruction, like the bench's padding prompts.
SOURCES = (*READERS, "padding")
PADDING_SUFFIXES = ("\nContinue:", "\n", "", "\nRepeat the text above:")


@dataclass(frozen=True)
class DistillSpec:
    """Everything that decides which records the cache holds; stored beside it to refuse mixing runs."""

    data: str = DEFAULT_DATA
    prompts: int = 512
    max_prompt_tokens: int = 192
    max_new_tokens: int = 256
    sampled_frac: float = 0.5
    seed: int = 0
    context_lengths: str = ""   # "" = prompts of up to max_prompt_tokens; else a LO-HI:WEIGHT mix

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.max_prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError("prompts, max_prompt_tokens and max_new_tokens must be >= 1")
        if not 0 <= self.sampled_frac <= 1:
            raise ValueError(f"sampled_frac must be in [0, 1], got {self.sampled_frac}")
        parse_data(self.data)
        if self.context_lengths:
            parse_context_lengths(self.context_lengths)


def parse_data(spec: str) -> dict[str, float]:
    """`code:0.5,chat:0.5` or `file:PATH` entries (weight optional, default 1) -> normalised shares."""
    shares: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, weight = item.rpartition(":")
        if not sep or not weight.replace(".", "", 1).isdigit():
            name, weight = item, "1"
        if not (name in SOURCES or name.startswith("file:")):
            raise ValueError(f"--data entry {item!r}: expected one of {', '.join(SOURCES)} or file:PATH, "
                             "optionally with :WEIGHT")
        shares[name] = float(weight)
    total = sum(shares.values())
    if not shares or total <= 0:
        raise ValueError(f"--data {spec!r} names no source with a positive weight")
    return {k: v / total for k, v in shares.items()}


def _window(text: str, rng: random.Random, chars: int) -> str:
    """Whole lines from a random point of a document, so a prompt starts and ends like real code or prose."""
    starts = [0] + [i + 1 for i, c in enumerate(text[:-chars]) if c == "\n"]
    start = rng.choice(starts)
    window = text[start:start + chars]
    end = window.rfind("\n", chars // 2)
    return window[:end + 1] if end >= 0 else window


# A function header and its docstring: cut right after it, the target writes the body (HumanEval's shape).
_DOCSTRING = re.compile(r'^[ \t]*(?:async )?def [^\n]*:\n[ \t]*[rRuU]?("""|\'\'\')[\s\S]*?\1[ \t]*\n', re.MULTILINE)


def _code_prompt(text: str, rng: random.Random, chars: int) -> str:
    """Half the time a function header and its docstring, else a plain window."""
    spans = [m.span() for m in _DOCSTRING.finditer(text)] if rng.random() < 0.5 else []
    if not spans:
        return _window(text, rng, chars)
    start, end = rng.choice(spans)
    return text[start:end]


def _chat_prompt(text: str) -> str | None:
    """A ChatML conversation up to and including its first assistant header (None if it has none)."""
    cut = text.find(ASSISTANT_HEADER)
    return text[:cut + len(ASSISTANT_HEADER)] if cut > 0 else None


# A prompt text and the texts that may precede it when it is grown to a long context.
Prompt = tuple[str, Sequence[str]]
_SENTENCE = re.compile(r"(?<![^\s])[A-Z][a-z]+ [a-z][a-z ,]{30,140}\. ")


def _padding_prompts(n: int, rng: random.Random) -> list[Prompt]:
    """A plain prose sentence of the docs, repeated (filler is the sentence itself), then an instruction."""
    sentences = sorted({m.group() for d in iter_documents("docs", "train") for m in _SENTENCE.finditer(d.text)})
    if not sentences:
        raise ValueError("the docs corpus has no plain sentences for padding prompts")
    out = []
    for _ in range(n):
        sentence = rng.choice(sentences)
        out.append((sentence * rng.randint(1, 8) + rng.choice(PADDING_SUFFIXES), (sentence,)))
    return out


def _source_prompts(name: str, n: int, rng: random.Random, window_chars: int) -> list[Prompt]:
    """`n` prompts from one source (fewer if the source runs dry), each with its filler pool."""
    if name == "padding":
        return _padding_prompts(n, rng)
    if name.startswith("file:"):
        from ddscope.bench.running.workloads import load_workload
        prompts = list(load_workload(name).prompts)
        rng.shuffle(prompts)
        pool = [p + "\n\n" for p in prompts]
        return [(p, pool) for p in prompts[:n]]
    if name == "chat":  # the ShareGPT file is large: take conversations in order, stop early
        out, pool = [], []
        for doc in iter_documents("chat", "train"):
            pool.append(doc.text)
            if (p := _chat_prompt(doc.text)) is not None and len(p) < 4 * window_chars:
                out.append(p)
            if len(out) == n:
                break
        return [(p, pool) for p in out]
    docs = [d.text for d in iter_documents(name, "train")]
    long_docs = [d for d in docs if len(d) > 2 * window_chars]
    if not long_docs:
        raise ValueError(f"corpus domain {name!r} has no documents longer than {2 * window_chars} characters")
    cut = _code_prompt if name == "code" else _window
    pool = [d + "\n\n" for d in docs]
    return [(cut(rng.choice(long_docs), rng, window_chars), pool) for _ in range(n)]


def grow_to(tokenizer: Any, prompt: Prompt, n_tokens: int, rng: random.Random) -> list[int]:
    """Exactly `n_tokens` ids that end like the prompt: filler texts are prepended whole (a long file,
    document or conversation before it), and the head is cut to the exact length."""
    text, pool = prompt
    parts = [text]
    for _ in range(64):  # each pass adds at least the missing characters, so a few passes suffice
        ids = tokenizer.encode("".join(parts), add_special_tokens=False, verbose=False)
        if len(ids) >= n_tokens:
            return ids[-n_tokens:]
        missing = 4 * (n_tokens - len(ids)) + 64
        while missing > 0:
            parts.insert(0, rng.choice(pool))
            missing -= max(1, len(parts[0]))
    raise ValueError(f"could not grow a prompt to {n_tokens} tokens from its filler")


def build_prompts(spec: DistillSpec, tokenizer: Any) -> list[tuple[str, list[int]]]:
    """(source, prompt ids) for every item, deterministic in `spec`. Without a context-length mix long
    prompts keep their tail; with one, each prompt is grown or cut to a drawn length."""
    rng = random.Random(spec.seed)
    buckets = parse_context_lengths(spec.context_lengths) if spec.context_lengths else None
    window_chars = 4 * spec.max_prompt_tokens  # ~4 chars per BPE token; clipped to tokens below
    items: list[tuple[str, list[int]]] = []
    for name, share in parse_data(spec.data).items():
        count = max(1, round(share * spec.prompts))
        for prompt in _source_prompts(name, count, rng, window_chars):
            if buckets:
                ids = grow_to(tokenizer, prompt, sample_length(buckets, rng), rng)
            else:
                ids = tokenizer.encode(prompt[0], add_special_tokens=False)[-spec.max_prompt_tokens:]
            if ids:
                items.append((name, ids))
    rng.shuffle(items)
    return items[:spec.prompts]


def read_cache(out_dir: Path) -> list[dict[str, Any]]:
    """All records of `out_dir/distill.*.jsonl` (one file per worker), by item; a torn last line is dropped."""
    records = []
    for path in sorted(out_dir.glob("distill.*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a run killed mid-write
    return sorted(records, key=lambda r: r["i"])


def append_whole_lines(path: Path) -> Any:
    """Open a record file for appending after dropping a torn last line (a run killed mid-write), so new
    records never glue onto it."""
    if path.is_file():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            os.truncate(path, data.rfind(b"\n") + 1)  # in place: a rewrite killed midway lost every record
    return path.open("a")


def check_meta(out_dir: Path, spec: DistillSpec) -> None:
    """Refuse to mix records of other settings into `out_dir`; record this run's settings. Settings without
    records (a run that failed before its first record) bind nothing, so a retry may change them."""
    meta = out_dir / "distill.meta.json"
    if meta.is_file() and read_cache(out_dir):
        old = {**asdict(DistillSpec()), **json.loads(meta.read_text())}  # fields added later take defaults
        if old != asdict(spec):
            raise ValueError(f"{out_dir} holds distillation data made with {old}; the current settings are "
                             f"{asdict(spec)}. Use another --work-dir or the same settings.")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(meta, json.dumps(asdict(spec), indent=2) + "\n")


def temperature_of(spec: DistillSpec, i: int) -> float:
    """Greedy or T=1 per item, fixed by (seed, i) so any worker split gives the same mix."""
    return 1.0 if random.Random(spec.seed * 1_000_003 + i).random() < spec.sampled_frac else 0.0


# A prompt still to distil: (item index, source, prompt ids).
Item = tuple[int, str, list[int]]


def pending(spec: DistillSpec, tokenizer: Any, out_dir: Path, time_budget_s: float | None) -> tuple[list[Item], float]:
    """The items of `spec` not yet in `out_dir` (after checking it holds this spec's records), and the
    wall-clock deadline of the run."""
    check_meta(out_dir, spec)
    done = {r["i"] for r in read_cache(out_dir)}
    todo = [(i, source, ids) for i, (source, ids) in enumerate(build_prompts(spec, tokenizer)) if i not in done]
    return todo, time.time() + (time_budget_s if time_budget_s is not None else float("inf"))


def _worker(worker: int, items: list[tuple[int, str, list[int]]], spec: DistillSpec, target: str,
            drafter: str | None, method: str, device: str, threads: int, out_dir: Path, deadline: float) -> int:
    """Generate `items` into `out_dir/distill.<worker>.jsonl`; returns the number written."""
    import torch

    from ddscope.engine import Engine

    torch.set_num_threads(threads)
    engine = Engine.load(target, drafter, device=device)
    written, generated, t0 = 0, 0, time.monotonic()
    with append_whole_lines(out_dir / f"distill.{worker}.jsonl") as f, \
            tqdm(items, desc=f"distill[{worker}]", unit="seq", position=worker, dynamic_ncols=True) as bar:
        for i, source, ids in bar:
            if time.time() > deadline:
                break
            temperature = temperature_of(spec, i)
            out = engine.generate(ids, max_new_tokens=spec.max_new_tokens, method=method, temperature=temperature,
                                  seed=spec.seed + i)
            record = {"i": i, "source": source, "temperature": temperature, "prompt_len": len(ids),
                      "ids": ids + out.token_ids}
            f.write(json.dumps(record) + "\n")
            f.flush()
            written += 1
            generated += len(out.token_ids)
            bar.set_postfix(tok_s=f"{generated / (time.monotonic() - t0):.0f}")
    return written


def distill(target: str | Path, spec: DistillSpec, out_dir: Path, drafter: str | Path | None = None,
            method: str = "ar", time_budget_s: float | None = None, workers: int = 1, threads: int = 1,
            device: str = "cpu") -> list[dict[str, Any]]:
    """Fill `out_dir` up to `spec.prompts` records (or until the time budget); return them all.

    `workers` processes (each with `threads` torch threads) split the missing items: batch-1 decoding
    of a small target is latency-bound, so processes use the cores better than threads do.
    """
    from transformers import AutoTokenizer

    if method == "ddtree" and drafter is None:
        raise ValueError("distilling with ddtree needs an existing drafter for this target")
    todo, deadline = pending(spec, AutoTokenizer.from_pretrained(str(target)), out_dir, time_budget_s)
    args = (spec, str(target), drafter and str(drafter), method, device, threads, out_dir, deadline)
    if workers <= 1 or len(todo) <= 1:
        _worker(0, todo, *args)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn, not fork: the parent may already hold torch thread pools.
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for job in [pool.submit(_worker, w, todo[w::workers], *args) for w in range(workers)]:
                job.result()
    return read_cache(out_dir)
