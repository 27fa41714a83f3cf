"""One home for every sampling field's default and check (ddscope.speculative.sampling_fields): the server's schema,
the engine's Request and SamplingParams spell none of their own, and a default changed there is the server's."""
from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from ddscope.engine.request import Request, RequestError
from ddscope.server.launch import serve_in_background
from ddscope.server.schemas import CompletionRequest
from ddscope.speculative import sampling_fields
from ddscope.speculative.sampling import SamplingParams
from ddscope.speculative.sampling_fields import API_TEMPERATURE, SAMPLING, served_temperature


def test_request_and_sampler_take_their_defaults_from_the_home():
    request = {f.name: f.default for f in dataclasses.fields(Request)}
    sampler = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert all(request[name] == knob.default for name, knob in SAMPLING.items())
    assert all(sampler[name] == SAMPLING[name].default for name in sampler) and "seed" not in sampler
    # the schema leaves each unset (None), so the home's default applies; its checks are the home's too
    assert all(CompletionRequest.model_fields[name].default is None for name in SAMPLING)
    assert not any(CompletionRequest.model_fields[name].metadata for name in SAMPLING)


@pytest.mark.parametrize("name, bad", [("temperature", -0.5), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5),
                                       ("seed", -1), ("repetition_penalty", 0.0), ("presence_penalty", 2.5)])
def test_one_check_a_field(name, bad):
    assert SAMPLING[name].check(name, bad) is not None and SAMPLING[name].check(name, SAMPLING[name].default) is None
    with pytest.raises(RequestError) as caught:
        Request(**{name: bad})._check_sampling()
    assert caught.value.field == name


def test_temperature_follows_the_models_generation_config(tmp_path):
    assert served_temperature(tmp_path) == API_TEMPERATURE == 1.0  # no generation_config.json: the API's
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    assert served_temperature(tmp_path / "set") == 0.6
    (tmp_path / "unset").mkdir()
    (tmp_path / "unset" / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert served_temperature(tmp_path / "unset") == 1.0


def test_a_default_changed_in_its_home_is_the_servers(tiny_engine, monkeypatch):
    """n=2 needs sampling (vLLM's rule): with no temperature sent, the server's default decides."""
    body = {"prompt": "Hello", "max_tokens": 3, "n": 2, "seed": 1}
    with serve_in_background(engine=tiny_engine) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/v1/completions", json=body).status_code == 200  # the API's 1.0 samples
        monkeypatch.setattr(sampling_fields, "API_TEMPERATURE", 0.0)
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 400 and "greedy" in refused.json()["error"]["message"]
        greedy = client.post("/v1/completions", json={**body, "n": 1}).json()["choices"][0]["text"]
        sent = client.post("/v1/completions", json={**body, "n": 1, "temperature": 0}).json()["choices"][0]["text"]
        assert greedy == sent
