"""Tiny end-to-end runs of the CLI: prompts, a `file:` workload, and `ddscope ARGV` in this process."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

# Prompts for tiny end-to-end runs (distillation, training, evaluation).
TINY_PROMPTS = ("def add(a, b):", "The quick brown fox", "Hello, how are", "for i in range(10):",
                "Distributed systems require", "print(i * i)")


def write_prompts(path: Path, prompts: Iterable[str]) -> Path:
    """A `file:` workload: one {"prompt": ...} JSON object per line."""
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))
    return path


def run_cli(argv: list[str]) -> int:
    """`ddscope ARGV` in this process, letting errors raise (`ddscope.cli.main` turns them into exit codes)."""
    from ddscope.cli import build_parser

    args = build_parser().parse_args(argv)
    return args.func(args)
