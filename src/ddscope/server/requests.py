"""A request body as the engine's: prompt and chat token ids (with their length checks), truncation, and the
engine's Request."""
from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from jinja2 import TemplateError

from ddscope.structured.backend import Compiled
from ddscope.engine.request import Request, RequestError
from ddscope.server.schemas import APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest
from ddscope.server.state import ServerState
from ddscope.speculative.sampling_fields import GREEDY_BELOW, served_temperature

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ddscope.engine import Engine

DEFAULT_MAX_TOKENS = 16  # /v1/completions, as in the OpenAI API; chat defaults to the rest of the context
PROMPT_CHARS_PER_TOKEN = 32  # a text prompt longer than this x max_model_len cannot fit: refused before tokenizing


def prompt_ids(tokenizer: PreTrainedTokenizerBase, engine: Engine, prompt: str | list[int],
                special: bool = False) -> list[int]:
    if isinstance(prompt, list):
        bad = [t for t in prompt if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {engine.vocab_size}); got {bad[:5]}", param="prompt",
                           code="invalid_token_id")
        return prompt
    return _encode_text(tokenizer, prompt, "prompt", engine.max_model_len, special)


def truncate(ids: list[int], req: SamplingRequest, engine: Engine) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last N tokens (after the chat template); -1 is max_model_len - 1."""
    n = req.truncate_prompt_tokens
    if n is None:
        return ids
    n = engine.max_model_len - 1 if n == -1 else n
    if not 0 < n <= engine.max_model_len:
        raise APIError(400, f"truncate_prompt_tokens={req.truncate_prompt_tokens} must be -1 or in "
                            f"[1, max_model_len = {engine.max_model_len}]", param="truncate_prompt_tokens",
                       code="invalid_parameter")
    return ids[-n:]


def check_text(text: str, param: str, max_model_len: int) -> None:
    """Text that cannot be tokenized, or is too long to fit any context, is refused before the tokenizer runs."""
    if len(text) > PROMPT_CHARS_PER_TOKEN * max_model_len:
        raise APIError(400, f"{param}: {len(text)} characters, over the {PROMPT_CHARS_PER_TOKEN * max_model_len} "
                            f"that could fit max_model_len ({max_model_len})", param=param, code="prompt_too_long")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # JSON can carry lone surrogates ("\ud800"); tokenizers reject them
        raise APIError(400, f"{param}: not valid Unicode (a lone surrogate)", param=param,
                       code="invalid_parameter") from None


def _encode_text(tokenizer: PreTrainedTokenizerBase, text: str, param: str, max_model_len: int,
                 special: bool) -> list[int]:
    check_text(text, param, max_model_len)
    # Too long to fit is refused first, so the tokenizer's own too-long warning never fires; `special`: the
    # request's add_special_tokens (a chat template spells out its own, so chat's default adds none).
    ids = tokenizer.encode(text, add_special_tokens=special, verbose=False)
    if not ids:
        raise APIError(400, f"{param}: tokenizes to no tokens", param=param, code="empty_prompt")
    return ids


def chat_ids(tokenizer: PreTrainedTokenizerBase, engine: Engine, req: ChatCompletionRequest) -> list[int]:
    if not (req.chat_template or tokenizer.chat_template):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions or send "
                            "chat_template", param="messages", code="no_chat_template")
    messages = [m.template_dict() for m in req.messages]
    for m in messages:
        check_text(m["content"], "messages", engine.max_model_len)
    # vLLM's merge: the request's template variables, then the top-level flags over them
    kwargs = {**(req.chat_template_kwargs or {}), "add_generation_prompt": req.add_generation_prompt,
              "continue_final_message": req.continue_final_message}
    if req.tools:  # rendered whatever tool_choice says, `none` included, as vLLM renders them
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    try:  # transformers renders in a sandboxed Jinja environment: a request's own template is safe to run
        text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=req.chat_template, **kwargs)
    except (TemplateError, ValueError, TypeError) as e:  # a template's raise_exception, or a bad conversation
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages",
                       code="invalid_messages") from None
    return _encode_text(tokenizer, text, "messages", engine.max_model_len, bool(req.add_special_tokens))


def _api_names(req: SamplingRequest) -> dict[str, str]:
    """A Request field's name in the API where the two differ: the length field the body used."""
    return {"max_new_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}


# The Request fields a body carries under their own name, passed on as sent where set (None: the field's default);
# engine_request fills in the rest, and those the server defaults or converts.
SAME_NAMES = tuple(f.name for f in fields(Request) if f.name in SamplingRequest.model_fields)


def engine_request(state: ServerState, req: SamplingRequest, prompt_len: int,
                   constraint: Compiled | None = None) -> Request:
    """The body as the engine's Request, the server's defaults filled in and checked once (400 naming the field)."""
    engine = state.engine
    room = engine.max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"prompt ({prompt_len} tokens) leaves no room under max_model_len "
                            f"({engine.max_model_len})", param="prompt", code="context_length_exceeded")
    max_tokens = req.requested_max_tokens()
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS if isinstance(req, CompletionRequest) else room
    logprobs = req.top_logprobs_wanted()
    if req.best_of is not None and req.best_of > req.n and logprobs is None:
        logprobs = 0  # best_of ranks its choices by their tokens' log-probs
    sent = {name: value for name in SAME_NAMES if (value := getattr(req, name)) is not None}
    request = Request(**{
        **sent, "max_new_tokens": max_tokens, "method": req.method or state.config.method,
        "budget": req.budget if req.budget is not None else state.config.budget,
        "temperature": served_temperature(engine.source) if req.temperature is None else req.temperature,
        "logit_bias": {int(k): v for k, v in (req.logit_bias or {}).items()} or None, "logprobs": logprobs,
        "prompt_logprobs": _prompt_logprobs_wanted(req), "constraint": constraint})
    try:
        request = request.resolved(engine.bounds, prompt_len)
    except RequestError as e:
        message, names = str(e), _api_names(req)
        for ours, theirs in names.items():
            message = message.replace(ours, theirs)
        raise APIError(400, message, param=names.get(e.field, e.field), code=e.code) from None
    if req.choices > 1 and request.temperature < GREEDY_BELOW:
        raise APIError(400, f"n must be 1 when using greedy sampling, got {req.choices} (vLLM's rule)",
                       code="invalid_parameter")
    return request


def _prompt_logprobs_wanted(req: SamplingRequest) -> int | None:
    """vLLM: the field, or on a completions echo the logprobs asked for (completion/protocol.py:373-375)."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return req.logprobs if isinstance(req, CompletionRequest) and req.echo else None
