"""The engine's defaults and bounds, and the check of one request against them. Imports no torch: the CLI and
the server's schemas read them before any model loads."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DEMO_DIR = Path(__file__).parents[1] / "assets" / "demo"
METHODS = ("ar", "dflash", "ddtree")
DTYPES = ("float32", "bfloat16", "float16")
MAX_BUDGET = 512
DEFAULT_BUDGET = "auto"  # a request's tree size when it names none: the library's, the CLIs' and the server's
KV_CACHE_MB = 1024  # the pool: the demo pair's target K/V, drafter K/V and features are 8 KiB a token
MAX_NUM_SEQS = 16
MAX_PREFILL_TOKENS = 1024  # prefill tokens a step, over all sequences (chunked prefill)
# Bounds on a request's extras: every completed token rescans the held-back text for each stop string.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs
# The server's bound on one stretch of JSON's free whitespace, in characters (xgrammar's max_whitespace_cnt): a
# newline and 20 spaces, so pretty-printed JSON still fits (indent 2 to depth 10, indent 4 to depth 5, tabs to
# depth 20), while a model that fills free whitespace with newlines (the demo target does) still finishes.
MAX_WHITESPACE = 21


def default_method(methods: tuple[str, ...]) -> str:
    """ddtree where the engine has a drafter (its `methods`), else ar: the one method a target alone can run."""
    return "ddtree" if "ddtree" in methods else "ar"


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs and their defaults, for the library and every CLI alike. `max_model_len`: None, the
    target's max_position_embeddings; `budget`: a request's tree size when it names none; `kv_cache_mb`: the
    pool's size; `prefix_cache`: blocks of finished prompts kept for reuse; `max_num_seqs`: sequences a step;
    `max_prefill_tokens`: prefill tokens a step over all sequences; `prefill_threads`: None, torch's."""
    max_model_len: int | None = None
    budget: int | str = DEFAULT_BUDGET
    kv_cache_mb: int = KV_CACHE_MB
    prefix_cache: bool = True
    max_num_seqs: int = MAX_NUM_SEQS
    max_prefill_tokens: int = MAX_PREFILL_TOKENS
    prefill_threads: int | None = None

    @classmethod
    def of(cls, config: EngineConfig | None = None, **knobs: Any) -> EngineConfig:
        """`config` with `knobs` replaced, or a config of `knobs`; an unknown knob is a TypeError."""
        return replace(config, **knobs) if config is not None else cls(**knobs)
