"""The engine's defaults and bounds, and the check of one request against them. Imports no torch: the CLI and
the server's schemas read them before any model loads."""
from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).parents[1] / "assets" / "demo"
METHODS = ("ar", "dflash", "ddtree")
DTYPES = ("float32", "bfloat16", "float16")
MAX_BUDGET = 512
KV_CACHE_MB = 1024  # the pool: the demo pair's target K/V, drafter K/V and features are 8 KiB a token
MAX_NUM_SEQS = 16
MAX_PREFILL_TOKENS = 1024  # prefill tokens a step, over all sequences (chunked prefill)
# Bounds on a request's extras: every completed token rescans the held-back text for each stop string.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs


def default_method(methods: tuple[str, ...]) -> str:
    """ddtree where the engine has a drafter (its `methods`), else ar: the one method a target alone can run."""
    return "ddtree" if "ddtree" in methods else "ar"


def check_request(prompt_len: int, max_model_len: int, vocab_size: int, max_new_tokens: int, min_tokens: int,
                  stop: list[str] | None, stop_token_ids: list[int] | None, logit_bias: dict[int, float] | None,
                  logprobs: int | None, prompt_logprobs: int | None) -> None:
    """Raise ValueError unless a request's lengths and extras are within the engine's bounds."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if prompt_len + max_new_tokens > max_model_len:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_model_len ({max_model_len})")
    if not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_new_tokens:
        raise ValueError(f"min_tokens must be an integer in [0, max_new_tokens], got {min_tokens!r}")
    if stop is not None and not (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS
                                 and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise ValueError(f"stop must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
                         f"{MAX_STOP_CHARS} characters, got {stop!r:.200}")
    for name, ids in (("stop_token_ids", stop_token_ids), ("logit_bias", logit_bias)):
        if ids and not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                           for t in ids):
            raise ValueError(f"{name}: token ids must be integers in [0, {vocab_size})")
    if logit_bias and not all(isinstance(b, (int, float)) and -100 <= b <= 100 for b in logit_bias.values()):
        raise ValueError("logit_bias values must be numbers in [-100, 100]")
    for name, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if n is not None and not (isinstance(n, int) and 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
