"""The default decoding method is ddtree where a drafter is loaded and ar for a target alone, which
cannot run ddtree: `generate --target T` without --drafter works, and so does a server for it."""
from __future__ import annotations

import httpx
import pytest

from ddscope.bench.synthetic_models import make_target
from ddscope.cli import main
from ddscope.server.launch import serve_in_background


@pytest.fixture(scope="module")
def lone_target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("lone") / "target")


def stats_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_generate_defaults_to_ar_without_a_drafter_and_ddtree_with_one(lone_target, tiny_pair, capsys):
    assert main(["generate", "hello", "--target", str(lone_target), "--max-tokens", "4", "--threads", "1"]) == 0
    assert stats_line(capsys).startswith("[ar budget=None] 4 tokens")
    target, drafter = tiny_pair
    assert main(["generate", "hello", "--target", str(target), "--drafter", str(drafter), "--max-tokens", "4",
                 "--threads", "1"]) == 0
    assert stats_line(capsys).startswith("[ddtree budget=auto] 4 tokens")


def test_a_server_for_a_target_alone_defaults_to_ar(lone_target):
    with serve_in_background(lone_target) as url:
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=60)
    assert resp.status_code == 200 and resp.json()["ddscope"]["method"] == "ar"
