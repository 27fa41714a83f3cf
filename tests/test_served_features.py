"""train-drafter --features-url against fake vLLM and SGLang servers that hand out a tiny target's own states
(features_fakes.py, from their sources): the same training as in process, portable layer choices, and a one-line
error naming the fix for each way a server or a target dir can fall short. The real vLLM: test_features_server.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from ddscope.bench.synthetic_models import make_target
from ddscope.cli import main as ddscope_main
from ddscope.config import CheckpointError
from ddscope.models.drafter_ckpt import check_layer_ids, pick_layer_ids
from ddscope.models.target import Target
from ddscope.peers.features_server import vllm_layer_ids
from ddscope.training.head import TargetHead, has_decoder, head_only
from ddscope.training.served_features import Journal, ServedFeatures
from ddscope.training.train import main as train_main
from ddscope.training.train_drafter import target_features
from support.bench_fakes import serve
from support.features_fakes import sglang_app, vllm_features_app

LAYERS = [0, 1]  # of a 3-layer target: all but the last


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("served") / "target", hidden=32, layers=3)


@pytest.fixture(scope="module")
def target(target_dir) -> Target:
    return Target.load(target_dir, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def stripped(target_dir, tmp_path_factory) -> Path:
    return head_only(target_dir, tmp_path_factory.mktemp("stripped") / "target")


def _records(work: Path, n: int = 8, length: int = 40) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    with (work / "distill.0.jsonl").open("w") as f:
        for i in range(n):
            ids = torch.randint(10, 30, (length,), generator=g).tolist()
            f.write(json.dumps({"i": i, "source": "test", "temperature": 0.0, "prompt_len": 8, "ids": ids}) + "\n")
    return work


def _args(target: Path, work: Path, *extra: str) -> list[str]:
    return ["--target", str(target), "--out", str(work / "drafter"), "--work-dir", str(work), "--block-size", "4",
            "--batch-seqs", "4", "--anchors", "4", "--lr", "3e-3", "--threads", "1", "--steps", "5",
            "--target-layer-ids", ",".join(map(str, LAYERS)), *extra]


def _losses(work: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (work / "train_log.jsonl").read_text().splitlines()]


def _last_error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("ddscope: error: ") and not any("Traceback" in x for x in lines), lines
    return lines[-1]


def test_training_from_a_vllm_equals_training_in_process(target, stripped, target_dir, tmp_path, capsys):
    local, remote = _records(tmp_path / "local"), _records(tmp_path / "remote")
    assert train_main(_args(target_dir, local)) == 0
    with serve(vllm_features_app(target, tmp_path / "storage", vllm_layer_ids(LAYERS))) as url:
        assert ddscope_main(["train-drafter", *_args(stripped, remote, "--features-url", url)]) == 0
    assert "engine check skipped" in capsys.readouterr().err
    torch.testing.assert_close(torch.tensor(_losses(remote)), torch.tensor(_losses(local)), rtol=1e-5, atol=0)
    assert not list((tmp_path / "storage").iterdir())


def test_sglang_states_equal_the_in_process_capture(target, tmp_path):
    seqs = [list(range(10, 10 + n)) for n in (5, 33)]
    with serve(sglang_app(target, [1, 0])) as url:  # SGLang captures in forward order, whatever the flag's
        got = ServedFeatures(url, [1, 0], tmp_path).features(seqs)
    for ids, g in zip(seqs, got):
        want = target_features(target, target.new_cache(len(ids)), ids, (1, 0))
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_a_radix_cache_hit_in_sglang_is_a_one_line_error_naming_the_flag(target, stripped, tmp_path, capsys):
    work = _records(tmp_path / "work")
    with serve(sglang_app(target, LAYERS, radix_cache=True)) as url:
        features = ServedFeatures(url, LAYERS, tmp_path)
        features.features([[10, 11, 12, 13]])
        with pytest.raises(ValueError, match="--disable-radix-cache"):
            features.features([[10, 11, 12, 13, 14]])
        assert ddscope_main(["train-drafter", *_args(stripped, work, "--features-url", url)]) == 2
    assert "--disable-radix-cache" in _last_error(capsys)


@pytest.mark.parametrize(("server", "fix"), [
    ("plain-vllm", "ddscope features-server"),
    ("sglang-without-aux", "--enable-return-aux-hidden-states"),
    ("vllm-other-layers", "does not capture z-lab layer ids [0]"),
    ("vllm-unrecorded-count", "does not say which"),
    ("vllm-bos-added", "token ids do not round-trip"),
    ("nothing", "no vLLM or SGLang answers there"),
])
def test_a_server_that_cannot_serve_the_run_is_a_one_line_error(server, fix, target, stripped, tmp_path, capsys):
    apps = {"plain-vllm": lambda: vllm_features_app(target, tmp_path / "s", [1, 2], hidden_states=False),
            "sglang-without-aux": lambda: sglang_app(target, None),
            "vllm-other-layers": lambda: vllm_features_app(target, tmp_path / "s", [2]),
            "vllm-unrecorded-count": lambda: vllm_features_app(target, tmp_path / "s", [1, 2, 3], record_ids=False),
            "vllm-bos-added": lambda: vllm_features_app(target, tmp_path / "s", [1, 2], token_shift=1)}
    work = _records(tmp_path / "work")
    if server == "nothing":
        code = ddscope_main(["train-drafter", *_args(stripped, work, "--features-url", "http://127.0.0.1:9")])
    else:
        with serve(apps[server]()) as url:
            code = ddscope_main(["train-drafter", *_args(stripped, work, "--features-url", url)])
    assert code == 2
    assert fix in _last_error(capsys)
    assert not (work / "drafter").exists()


def test_a_target_dir_without_its_head_or_records_says_what_to_copy(target_dir, stripped, tmp_path, capsys):
    no_head = tmp_path / "no-head"
    shutil.copytree(stripped, no_head)
    (no_head / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="sits in shard model-00001-of-00002.safetensors, which is missing"):
        TargetHead.load(no_head, torch.device("cpu"), torch.float32)
    index = json.loads((stripped / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "embed_tokens" not in k}
    (no_head / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="no embed_tokens.weight"):
        TargetHead.load(no_head, torch.device("cpu"), torch.float32)

    assert ddscope_main(["train-drafter", *_args(stripped, tmp_path / "empty", "--features-url", "http://x")]) == 2
    assert "give --distill-url" in _last_error(capsys)
    assert has_decoder(target_dir) and not has_decoder(stripped)


def test_the_head_alone_equals_the_targets(target, stripped):
    head = TargetHead.load(stripped, torch.device("cpu"), torch.float32)
    ids = torch.tensor([3, 7, 11])
    torch.testing.assert_close(head.embed(ids), target.embed(ids))
    h = torch.randn(2, 32)
    torch.testing.assert_close(head.logits(h), target.logits(h))


def test_a_killed_readers_files_are_deleted_by_the_next_run(tmp_path):
    left = tmp_path / "storage" / "req.safetensors"
    left.parent.mkdir()
    left.write_bytes(b"x")
    Path(str(left) + ".lock").write_text("")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "features.rank0.open").write_text(f"{left}\n")
    Journal(tmp_path / "work" / "features.rank0.open")
    assert not list(left.parent.iterdir())


def test_default_layers_never_include_the_last_and_asking_for_it_is_refused():
    for layers in range(2, 64):
        for n in range(1, min(layers - 1, 6) + 1):
            ids = pick_layer_ids(layers, n)
            assert len(set(ids)) == n and ids == sorted(ids) and max(ids) < layers - 1, (layers, n, ids)
    assert pick_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab's spread where it holds
    with pytest.raises(ValueError, match="last layer; vLLM hands out its output before the final norm, SGLang"):
        check_layer_ids([1, 3], 4)
    with pytest.raises(ValueError, match="need 1..0"):
        pick_layer_ids(1, 1)
    with pytest.raises(ValueError, match=r"ascending order \(\[0, 2\]\), the order vLLM feeds them"):
        check_layer_ids([2, 0], 4)


def test_features_server_prints_vllms_command_with_its_ids(target_dir, capsys):
    assert ddscope_main(["features-server", "--target", str(target_dir), "--print-command", "--port", "8200",
                         "--", "--tensor-parallel-size", "8"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("PYTHONPATH=") and "assets/vllm_plugin" in line
    assert '"eagle_aux_hidden_state_layer_ids": [1, 2]' in line  # z-lab 0, 1 are vLLM's inputs of layers 1, 2
    assert '"kv_connector_module_path": "ddscope_hidden_states"' in line
    assert line.endswith("--tensor-parallel-size 8") and "--port 8200" in line
    assert ddscope_main(["features-server", "--target", str(target_dir), "--layer-ids", "2", "--print-command"]) == 2
    assert "last layer" in _last_error(capsys)


def test_a_connection_the_server_dropped_is_retried(target, tmp_path, monkeypatch):
    """uvicorn closes idle keep-alive connections after 5 s; one reused at that moment fails in transport."""
    with serve(vllm_features_app(target, tmp_path / "s", vllm_layer_ids(LAYERS))) as url:
        features = ServedFeatures(url, LAYERS, tmp_path)
        post, calls = features.client.post, []

        def flaky(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            return post(*args, **kwargs)

        monkeypatch.setattr(features.client, "post", flaky)
        [got] = features.features([[10, 11, 12]])
    assert len(calls) == 2 and got.shape == (3, 2 * 32)


def test_a_timeout_is_not_retried_and_names_the_option(target, tmp_path, monkeypatch):
    """A request that timed out would time out again: one attempt, then the option to raise."""
    with serve(vllm_features_app(target, tmp_path / "s", vllm_layer_ids(LAYERS))) as url:
        features = ServedFeatures(url, LAYERS, tmp_path)
        calls = []

        def slow(*args, **kwargs):
            calls.append(1)
            raise httpx.ReadTimeout("timed out")

        monkeypatch.setattr(features.client, "post", slow)
        with pytest.raises(ValueError, match="ReadTimeout on /v1/completions after 1 attempt.*--features-timeout"):
            features.features([[10, 11, 12], [13, 14]])
    assert len(calls) <= 2  # at most the one request per sequence already in flight


def test_a_head_only_target_without_features_url_is_refused_before_any_work(stripped, tmp_path, capsys):
    work = _records(tmp_path / "w")
    assert ddscope_main(["train-drafter", *_args(stripped, work)]) == 2
    assert "holds only part of the target (no decoder layers): train from the serving engine's hidden states " \
           "with --features-url" in _last_error(capsys)
    assert not (work / "train_log.jsonl").exists()


def test_the_targets_last_layer_is_refused_naming_the_engines(stripped, tmp_path, capsys):
    """Before any server is asked: the URL here answers nothing."""
    argv = _args(stripped, _records(tmp_path / "w"), "--features-url", "http://127.0.0.1:9")
    argv[argv.index("--target-layer-ids") + 1] = "0,2"
    assert ddscope_main(["train-drafter", *argv]) == 2
    err = _last_error(capsys)
    assert err.startswith("ddscope: error: --target-layer-ids: 2 is the target's last layer"), err
    assert "vLLM" in err and "SGLang" in err
