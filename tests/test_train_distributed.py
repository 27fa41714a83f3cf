"""Multi-process drafter training under torchrun (gloo on CPU): the same steps as one process, resume after a
kill on any world size, and one-line errors for malformed runs."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from ddscope.bench.synthetic_models import make_target
from ddscope.cli import main as ddscope_main
from ddscope.training import train_drafter
from ddscope.training.train import main as train_main
from ddscope.training.train_drafter import TrainSpec, batch_indices

STEPS = 8
# Stated tolerance: 2 ranks (or 2 micro-batches) sum the same terms in another order, and DDP averages
# gradients in fp32, so losses agree to float rounding; AdamW's 1/sqrt(v) amplifies that a little per step.
LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("dist") / "target", hidden=32, layers=2)


def _cache(work, n: int = 8, length: int = 40, prompt_len: int = 8) -> None:
    """A distilled cache in distill.py's record format: random ids from 10 of the vocabulary, so a few steps
    visibly learn (the tests are about the arithmetic of the steps)."""
    work.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    with (work / "distill.0.jsonl").open("w") as f:
        for i in range(n):
            ids = torch.randint(10, 20, (length,), generator=g).tolist()
            record = {"i": i, "source": "test", "temperature": 0.0, "prompt_len": prompt_len, "ids": ids}
            f.write(json.dumps(record) + "\n")


def _args(target, work, steps: int = STEPS, *extra: str) -> list[str]:
    return ["--target", str(target), "--out", str(work / "drafter"), "--work-dir", str(work), "--block-size", "4",
            "--batch-seqs", "4", "--anchors", "4", "--lr", "3e-3", "--threads", "1", "--steps", str(steps), *extra]


def _log(work) -> list[dict]:
    return [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]


def _torchrun(nproc: int, argv: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "ddscope.training.train", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _state(work) -> dict:
    return torch.load(work / "ckpt.pt", weights_only=False)


def _assert_same_state(a: dict, b: dict, atol: float) -> None:
    assert a["step"] == b["step"]
    for k, v in a["model"].items():
        torch.testing.assert_close(v, b["model"][k], atol=atol, rtol=0)
    for k, s in a["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(s[name], b["optimizer"]["state"][k][name], atol=atol, rtol=atol)


def test_batches_are_a_function_of_seed_and_step_and_cover_each_epoch():
    epoch = [i for step in range(3) for i in batch_indices(12, 4, step, seed=5)]
    assert sorted(epoch) == list(range(12))                       # one epoch = every sequence once
    assert batch_indices(12, 4, 7, seed=5) == batch_indices(12, 4, 7, seed=5)
    assert batch_indices(12, 4, 0, seed=5) != batch_indices(12, 4, 0, seed=6)


def test_two_ranks_and_grad_accum_match_one_process(target, tmp_path):
    works = {name: tmp_path / name for name in ("one", "accum", "two")}
    for w in works.values():
        _cache(w)
    assert train_main(_args(target, works["one"])) == 0
    assert train_main(_args(target, works["accum"], STEPS, "--grad-accum", "2")) == 0
    run = _torchrun(2, _args(target, works["two"]))
    assert run.returncode == 0, run.stderr[-3000:]

    one, accum, two = (_log(w) for w in works.values())
    assert [r["world_size"] for r in two] == [2] * STEPS and len(one) == STEPS
    ref = torch.tensor([r["loss"] for r in one])
    for other in (accum, two):
        torch.testing.assert_close(torch.tensor([r["loss"] for r in other]), ref, rtol=LOSS_RTOL, atol=0)
    assert ref[-2:].mean() < ref[:2].mean() - 0.5  # and it does learn
    _assert_same_state(_state(works["one"]), _state(works["two"]), atol=1e-4)


def test_resume_after_kill_equals_uninterrupted_run_on_any_world_size(target, tmp_path):
    steps = 40
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    for w in (ref, killed):
        _cache(w)
    assert train_main(_args(target, ref, steps)) == 0

    # Checkpoint every step, SIGKILL after a few, then resume.
    cmd = [sys.executable, "-m", "ddscope.training.train", *_args(target, killed, steps, "--checkpoint-min", "0")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        log = killed / "train_log.jsonl"
        if log.is_file() and log.read_text().count("\n") >= 6:  # step 6's line follows step 5's checkpoint
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    stopped_at = _state(killed)["step"]
    assert 5 <= stopped_at < steps, f"the run was not killed mid-way (checkpoint at step {stopped_at})"

    with (killed / "train_log.jsonl").open("a") as f:
        f.write('{"step": 99, "lo')  # a kill mid-write tears the last log line: --resume drops it
    two_ranks = tmp_path / "two-ranks"
    shutil.copytree(killed, two_ranks)
    assert train_main(_args(target, killed, steps, "--resume")) == 0
    _assert_same_state(_state(ref), _state(killed), atol=1e-6)   # same process count: the same state
    assert [r["step"] for r in _log(killed)] == list(range(1, steps + 1))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in _log(killed)]),
                               torch.tensor([r["loss"] for r in _log(ref)]), rtol=1e-6, atol=0)

    # And on another world size, through `ddscope train-drafter --nproc 2` (its cache is complete: no distilling).
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(8)))
    argv = _args(target, two_ranks, steps, "--resume", "--nproc", "2", "--data", f"file:{prompts}", "--prompts", "8")
    assert ddscope_main(["train-drafter", *argv]) == 0
    _assert_same_state(_state(ref), _state(two_ranks), atol=1e-4)
    assert [r["world_size"] for r in _log(two_ranks)] == [1] * stopped_at + [2] * (steps - stopped_at)


def _one_line_error(argv: list[str], capsys) -> str:
    assert ddscope_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # progress bars of distillation may come first
    assert lines[-1].startswith("ddscope: error: ") and not any("Traceback" in line for line in lines), lines
    return lines[-1]


def test_malformed_runs_fail_with_one_line(target, tmp_path, capsys, monkeypatch):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    base = ["train-drafter", "--target", str(target), "--out", str(tmp_path / "d"), "--steps", "2",
            "--data", f"file:{tmp_path / 'prompts.jsonl'}", "--prompts", "1", "--max-new-tokens", "8"]
    assert "no such layer" in _one_line_error(base + ["--target-layer-ids", "0,7"], capsys)

    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(target, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    assert "no usable tokenizer" in _one_line_error(
        ["train-drafter", "--target", str(no_tokenizer), "--out", str(tmp_path / "d"), "--steps", "2"], capsys)

    assert "larger than the data" in _one_line_error(base + ["--nproc", "3"], capsys)
    # The same check inside every rank, for a direct torchrun launch.
    monkeypatch.setattr(train_drafter, "_world", lambda: (3, 0))
    with pytest.raises(ValueError, match="world size 3 is larger than the data: 2 usable"):
        train_drafter.train(target, None, [{"ids": [1, 2, 3], "prompt_len": 1}] * 2, TrainSpec(steps=1),
                            train_drafter.DrafterPlan(3, [0]), tmp_path / "o", tmp_path / "w")
