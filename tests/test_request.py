"""One request object: a Request is checked once against the engine's Bounds, each fault names its field, and the
library, the CLIs and the server share one home for the defaults (EngineConfig)."""
from __future__ import annotations

import pytest

from ddscope.cli import build_parser
from ddscope.engine.limits import DEFAULT_BUDGET, MAX_BUDGET, EngineConfig
from ddscope.engine.request import Bounds, Request, RequestError

BOUNDS = Bounds(methods=("ar", "dflash", "ddtree"), max_model_len=256, vocab_size=100, default_budget=DEFAULT_BUDGET)


@pytest.mark.parametrize("fields, field, code", [
    (dict(method="beam"), "method", "invalid_parameter"),
    (dict(budget=0), "budget", "invalid_parameter"),
    (dict(budget=MAX_BUDGET + 1), "budget", "invalid_parameter"),
    (dict(max_new_tokens=0), "max_new_tokens", "invalid_parameter"),
    (dict(max_new_tokens=250), "max_new_tokens", "context_length_exceeded"),
    (dict(min_tokens=9, max_new_tokens=8), "min_tokens", "invalid_parameter"),
    (dict(stop=[""]), "stop", "invalid_parameter"),
    (dict(stop_token_ids=[100]), "stop_token_ids", "invalid_token_id"),
    (dict(logit_bias={-1: 1.0}), "logit_bias", "invalid_token_id"),
    (dict(logit_bias={1: 101.0}), "logit_bias", "invalid_parameter"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "invalid_parameter"),
    (dict(allowed_token_ids=[5, 100]), "allowed_token_ids", "invalid_token_id"),
    (dict(temperature=-1.0), "temperature", "invalid_parameter"),
    (dict(temperature=float("nan")), "temperature", "invalid_parameter"),
    (dict(top_p=0.0), "top_p", "invalid_parameter"),
    (dict(top_k=-2), "top_k", "invalid_parameter"),  # -1 is off, as in vLLM
    (dict(min_p=1.5), "min_p", "invalid_parameter"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "invalid_parameter"),
    (dict(presence_penalty=2.5), "presence_penalty", "invalid_parameter"),
    (dict(frequency_penalty=-3.0), "frequency_penalty", "invalid_parameter"),
    (dict(logprobs=21), "logprobs", "invalid_parameter"),
    (dict(prompt_logprobs=-1), "prompt_logprobs", "invalid_parameter"),
])
def test_each_fault_names_its_field(fields, field, code):
    with pytest.raises(RequestError) as caught:
        Request(**fields).resolved(BOUNDS, prompt_len=8)
    assert caught.value.field == field and caught.value.code == code
    assert field in str(caught.value) or field == "max_new_tokens" and "max_model_len" in str(caught.value)


def test_resolving_fills_the_engines_defaults_and_keeps_the_rest():
    plain = Request(max_new_tokens=8, temperature=0.5).resolved(BOUNDS, prompt_len=8)
    assert (plain.method, plain.budget, plain.temperature) == ("ddtree", DEFAULT_BUDGET, 0.5)
    alone = Request().resolved(Bounds(("ar",), 256, 100, 32), prompt_len=8)
    assert (alone.method, alone.budget) == ("ar", 32)
    with pytest.raises(RequestError, match="unknown or unavailable method 'ddtree'"):
        Request(method="ddtree").resolved(Bounds(("ar",), 256, 100, 32), prompt_len=8)
    assert Request(method="ar", budget=0).resolved(BOUNDS, 8).budget == 0  # a budget only a tree reads


def test_choices_are_seeded_one_apart_and_unseeded_ones_stay_unseeded():
    seeded = Request(seed=7)
    assert [seeded.child(i).seed for i in range(3)] == [7, 8, 9]
    assert Request().child(2) == Request()
    with pytest.raises(TypeError):
        Request.of(None, tempreature=1.0)  # a misspelt field is not silently dropped


def test_the_library_and_the_clis_share_one_default_budget():
    parser = build_parser()
    generate = parser.parse_args(["generate", "hi"])
    serve = parser.parse_args(["serve"])
    assert generate.budget == serve.budget == EngineConfig().budget == DEFAULT_BUDGET
    assert EngineConfig.of(None, budget=8).budget == 8
    assert EngineConfig.of(EngineConfig(), kv_cache_mb=8).kv_cache_mb == 8


def test_an_engine_checks_a_request_once_and_says_which_field(tiny_engine):
    with pytest.raises(RequestError) as caught:
        tiny_engine.sequence("hello", max_new_tokens=tiny_engine.max_model_len)
    assert caught.value.field == "max_new_tokens" and caught.value.code == "context_length_exceeded"
    request = Request(max_new_tokens=4, method="ar")
    assert tiny_engine.generate("hello", request).token_ids == tiny_engine.generate("hello", max_new_tokens=4,
                                                                                    method="ar").token_ids
