"""Engine behaviour around the loop: stops, streaming text, stats consistency."""
import json

import pytest

from ddscope.cli import main


def test_stats_are_consistent(tiny_engine):
    out = tiny_engine.generate("def add(a, b):", max_new_tokens=40, method="ddtree", budget=8, ignore_eos=True)
    s = out.stats.to_dict()
    assert s["completion_tokens"] == len(out.token_ids) == 40
    assert s["committed_tokens"] == 39  # the first token is the prefill's, not a verify round's
    assert s["avg_commit"] == pytest.approx(s["committed_tokens"] / s["verify_steps"])
    assert sum(int(k) * v for k, v in s["commit_histogram"].items()) == 39
    assert len(s["rounds"]) == s["verify_steps"]
    assert s["nodes_verified"] == sum(r["nodes"] for r in s["rounds"]) == 8 * s["verify_steps"]
    assert s["mean_step_ms"] > 0 and s["decode_tok_per_s"] > 0
    assert [r["ctx_len"] for r in s["rounds"]][0] == s["prompt_tokens"]  # the whole prompt is cached
    json.dumps(s)


def test_ar_commits_one_token_per_step(tiny_engine):
    s = tiny_engine.generate([7, 8, 9], max_new_tokens=25, method="ar", ignore_eos=True).stats.to_dict()
    assert s["verify_steps"] == 24 and s["avg_commit"] == 1.0 and s["nodes_verified"] == 0


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_one_token_comes_from_prefill_alone(tiny_engine, method):
    steps = list(tiny_engine.stream([7, 8, 9], max_new_tokens=1, method=method, ignore_eos=True))
    assert len(steps) == 1 and steps[0].round is None and steps[0].finish_reason == "length"
    s = steps[0].stats.to_dict()
    assert (s["completion_tokens"], s["committed_tokens"], s["verify_steps"]) == (1, 0, 0)
    assert s["avg_commit"] == s["mean_step_ms"] == s["decode_tok_per_s"] == 0.0 and s["commit_histogram"] == {}


def test_first_step_is_the_prefill_token(tiny_engine):
    ref = tiny_engine.generate([7, 8, 9], max_new_tokens=6, method="ar", ignore_eos=True).token_ids
    steps = tiny_engine.stream([7, 8, 9], max_new_tokens=6, method="ddtree", ignore_eos=True)
    first = next(steps)
    assert first.token_ids == ref[:1] and first.round is None and first.stats.verify_steps == 0
    steps.close()


def test_streamed_text_equals_full_decode(tiny_engine):
    steps = list(tiny_engine.stream("The quick", max_new_tokens=60, method="ddtree", ignore_eos=True))
    ids = [t for s in steps for t in s.token_ids]
    assert "".join(s.text for s in steps) == tiny_engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert [s.finish_reason for s in steps][-1] == "length" and all(s.finish_reason is None for s in steps[:-1])


def test_stop_string_cuts_text(tiny_engine):
    full = tiny_engine.generate("The quick", max_new_tokens=60, method="ar", ignore_eos=True)
    words = [tiny_engine.tokenizer.decode([t]) for t in full.token_ids[5:]]
    stop = next(w for w in words if w.isascii() and w.strip().isalnum())
    cut = tiny_engine.generate("The quick", max_new_tokens=60, method="ddtree", ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    assert cut.stats.completion_tokens == len(cut.token_ids) < 60


def test_eos_stops_and_min_tokens_defers_it(tiny_engine):
    eos = tiny_engine.tokenizer.eos_token_id
    # find a prompt whose greedy continuation hits EOS: force it with a target whose EOS is any token seen
    ref = tiny_engine.generate([11, 12], max_new_tokens=30, method="ar", ignore_eos=True).token_ids
    tiny_engine.eos_ids = (ref[4],)
    try:
        stopped = tiny_engine.generate([11, 12], max_new_tokens=30, method="ddtree")
        assert stopped.finish_reason == "stop" and stopped.token_ids == ref[:ref.index(ref[4]) + 1]
        assert list(tiny_engine.stream([11, 12], max_new_tokens=30, method="ddtree"))[-1].matched_stop == ref[4]
        later = tiny_engine.generate([11, 12], max_new_tokens=30, method="ddtree", min_tokens=ref.index(ref[4]) + 2)
        assert ref[4] not in later.token_ids[:ref.index(ref[4]) + 2]
    finally:
        tiny_engine.eos_ids = (eos,)


def test_cli_generate_json(tiny_pair, capsys):
    target, drafter = tiny_pair
    assert main(["generate", "hello", "--target", str(target), "--drafter", str(drafter), "--max-tokens", "12",
                 "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["completion_tokens"] == 12 and len(out["token_ids"]) == 12


def test_cli_reports_bad_checkpoint(tmp_path, capsys):
    assert main(["generate", "x", "--target", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


def test_stop_string_spanning_two_steps_never_leaks(tiny_engine):
    full = tiny_engine.generate("The quick", max_new_tokens=40, method="ar", ignore_eos=True)
    pieces = [tiny_engine.tokenizer.decode([t]) for t in full.token_ids]
    k = next(i for i in range(3, 39) if pieces[i].isascii() and pieces[i + 1].isascii()
             and pieces[i].strip() and pieces[i + 1].strip())
    stop = pieces[k][-1] + pieces[k + 1][0]  # ar commits one token per step: the stop spans two steps
    steps = list(tiny_engine.stream("The quick", max_new_tokens=40, method="ar", ignore_eos=True, stop=[stop]))
    text = "".join(s.text for s in steps)
    assert steps[-1].finish_reason == "stop" and steps[-1].matched_stop == stop and stop not in text
    assert text == full.text[:full.text.index(stop)]
