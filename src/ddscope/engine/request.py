"""One request, typed and frozen: what `Engine.sequence` runs. It is built once (by the server from the HTTP body, by
a library user from keywords), checked once against the engine's bounds, and carried whole to the sequence. Imports
no torch: the server builds and checks it before the engine thread sees it."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ddscope.engine.limits import MAX_BUDGET, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS, default_method
from ddscope.speculative.sampling_fields import SAMPLING, default, integer

if TYPE_CHECKING:
    from ddscope.structured.backend import Compiled
    from ddscope.structured.constraint import Constraint


class RequestError(ValueError):
    """A request the engine cannot serve; `field` names the Request field at fault, `code` the kind of fault."""

    def __init__(self, field: str, message: str, code: str = "invalid_parameter"):
        super().__init__(message)
        self.field, self.code = field, code


@dataclass(frozen=True)
class Bounds:
    """What an engine can serve: its methods, lengths and vocabulary, and the budget a request leaves unset."""
    methods: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    default_budget: int | str


@dataclass(frozen=True)
class Request:
    """A generation's every option. Lengths: `max_new_tokens`, `min_tokens`. Method: `method` (None: ddtree with a
    drafter, else ar), `budget` (None: the engine's), `lookup` (the prompt-lookup branch in ddtree trees). Sampling:
    `temperature` .. `seed` (each one's default and check: `speculative.sampling_fields`). The target's law at every
    node (ddscope.speculative.law): `logit_bias`, `allowed_token_ids`,
    `bad_words`, the penalties, EOS unless `ignore_eos`, and `stop_token_ids`, which end a generation as EOS does.
    Text: the `stop` strings and vLLM's detokenizing switches. Outputs: `logprobs` (top N per token),
    `prompt_logprobs` (top N per prompt token; the prompt then runs in full). Scheduling: `cache_salt` keeps prefix-
    cache entries apart, `priority` orders admission (lower first). Structure: `constraint` (structured outputs: a
    Constraint, or the grammar compiled of it before admission, which the engine then uses as it is);
    `steer=False` masks at the verify only, as vLLM does, for side-by-side measurements."""
    max_new_tokens: int = 128
    min_tokens: int = 0
    method: str | None = None
    budget: int | str | None = None
    lookup: bool = True
    temperature: float = default("temperature")
    top_p: float = default("top_p")
    top_k: int = default("top_k")
    min_p: float = default("min_p")
    seed: int | None = default("seed")
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    bad_words: tuple[str, ...] | list[str] | None = None
    repetition_penalty: float = default("repetition_penalty")
    presence_penalty: float = default("presence_penalty")
    frequency_penalty: float = default("frequency_penalty")
    stop: tuple[str, ...] | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    priority: int = 0
    constraint: Constraint | Compiled | None = None
    steer: bool = True

    @classmethod
    def of(cls, request: Request | None = None, **fields: Any) -> Request:
        """`request` with `fields` replaced, or a Request of `fields`; an unknown field is a TypeError."""
        return replace(request, **fields) if request is not None else cls(**fields)

    def child(self, index: int) -> Request:
        """The `index`-th of n choices: seeded at seed + index, as vLLM's parallel sampling."""
        return self if self.seed is None else replace(self, seed=self.seed + index)

    def resolved(self, bounds: Bounds, prompt_len: int) -> Request:
        """The engine's defaults filled in, checked after a `prompt_len` prompt (RequestError naming the field)."""
        method = self.method or default_method(bounds.methods)
        resolved = replace(self, method=method, budget=bounds.default_budget if self.budget is None else self.budget)
        resolved._check(bounds, prompt_len)
        return resolved

    def _check(self, bounds: Bounds, prompt_len: int) -> None:
        check_method(self.method, self.budget, bounds)
        n = self.max_new_tokens
        if not integer(n) or n < 1:
            raise RequestError("max_new_tokens", f"max_new_tokens must be an integer >= 1, got {n!r}")
        if prompt_len + n > bounds.max_model_len:
            raise RequestError("max_new_tokens", f"prompt ({prompt_len} tokens) + max_new_tokens ({n}) exceeds "
                               f"max_model_len ({bounds.max_model_len})", "context_length_exceeded")
        if not integer(self.min_tokens) or not 0 <= self.min_tokens <= n:
            raise RequestError("min_tokens", f"min_tokens must be an integer in [0, max_new_tokens ({n})], "
                               f"got {self.min_tokens!r}")
        _check_stop(self.stop)
        self._check_sampling()
        self._check_law()
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias),
                          ("allowed_token_ids", self.allowed_token_ids)):
            if ids and not all(integer(t) and 0 <= t < bounds.vocab_size for t in ids):
                raise RequestError(name, f"{name}: token ids must be integers in [0, {bounds.vocab_size})",
                                   "invalid_token_id")
        if self.logit_bias and not all(isinstance(b, (int, float)) and -100 <= b <= 100
                                       for b in self.logit_bias.values()):
            raise RequestError("logit_bias", "logit_bias values must be numbers in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (integer(k) and 0 <= k <= MAX_LOGPROBS):
                raise RequestError(name, f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")

    def _check_sampling(self) -> None:
        for name, knob in SAMPLING.items():
            if (why := knob.check(name, getattr(self, name))) is not None:
                raise RequestError(name, why)

    def _check_law(self) -> None:
        """What vLLM refuses (sampling_params.py `_verify_args`) beyond the sampling fields' own checks."""
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise RequestError("allowed_token_ids", "allowed_token_ids must not be empty")


def check_method(method: str, budget: int | str | None, bounds: Bounds) -> None:
    """Raise RequestError unless `method` (with `budget`, None for the default) can be served: also a server's
    defaults, at start-up."""
    if method not in bounds.methods:
        raise RequestError("method", f"unknown or unavailable method {method!r}; available: "
                                     f"{', '.join(bounds.methods)}")
    budget = bounds.default_budget if budget is None else budget
    if method == "ddtree" and budget != "auto" and not (integer(budget) and 1 <= budget <= MAX_BUDGET):
        raise RequestError("budget", f"budget must be an integer in [1, {MAX_BUDGET}] or 'auto', got {budget!r}")


def _check_stop(stop: Any) -> None:
    if stop is not None and not (isinstance(stop, (list, tuple)) and len(stop) <= MAX_STOP_STRINGS
                                 and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise RequestError("stop", f"stop must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
                                   f"{MAX_STOP_CHARS} characters, got {stop!r:.200}")
