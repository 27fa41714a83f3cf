"""Stops are token-exact (issue 18): with drafters that are accepted, every method returns what `ar`
returns (token ids, text, finish_reason, matched_stop, usage, streamed deltas), wherever a stop string,
an EOS or the length limit falls inside a verify round."""
from __future__ import annotations

import itertools

import pytest

from ddscope import Engine
from ddscope.bench.synthetic_models import oracle_engine

METHODS = [("dflash", None), ("ddtree", 1), ("ddtree", 8), ("ddtree", 32), ("ddtree", "auto")]
PROMPT, N = "naïve résumé", 64  # the tiny target's greedy text here splits 2-byte characters over two tokens
PAD = "Distributed systems require careful reasoning about consistency and failure. " * 3


@pytest.fixture(scope="module")
def engines(tiny_engine) -> dict[str, Engine]:
    """Drafters the target accepts always, about half the time, and (the random one) almost never."""
    return {"oracle": oracle_engine(tiny_engine), "half": oracle_engine(tiny_engine, 0.5, seed=1),
            "random": tiny_engine}


class Ref:
    """ar's unstopped output on PROMPT, and where each token's text ends as the engine releases it."""

    def __init__(self, engine: Engine):
        steps = list(engine.stream(PROMPT, max_new_tokens=N, method="ar", ignore_eos=True))  # one token per step
        self.ids, self.text = [s.token_ids[0] for s in steps], "".join(s.text for s in steps)
        self.ends = list(itertools.accumulate(len(s.text) for s in steps))

    def ending_in(self, i: int, start: int | None = None) -> str | None:
        """A stop string ending where token i's text ends whose first occurrence ends in token i's text (so a
        stop on it ends at token i): text[start:], else the shortest such tail of 2 to 5 characters, else 1."""
        for s in [self.text[start:self.ends[i]]] if start is not None else \
                 [self.text[self.ends[i] - n:self.ends[i]] for n in (2, 3, 4, 5, 1)]:
            if s and "\ufffd" not in s and self.text.find(s) + len(s) > self.ends[i - 1]:
                return s
        return None

    def token_ending(self, stop: str, after: int = -1) -> int:
        """The index of the token whose text completes the first `stop` that ends past token `after`."""
        start = self.text.find(stop, max(0, self.ends[after] - len(stop) + 1) if after >= 0 else 0)
        return next(i for i, end in enumerate(self.ends) if end >= start + len(stop))


@pytest.fixture(scope="module")
def ref(tiny_engine) -> Ref:
    return Ref(tiny_engine)


@pytest.fixture(scope="module")
def accepted():
    """Committed tokens and verify steps of the oracle engines' runs, to show the drafts were accepted."""
    totals = {"oracle": [0, 0], "half": [0, 0]}
    yield totals
    for name, (committed, steps) in totals.items():
        assert steps and committed / steps > 1.5, f"{name}: avg_commit {committed / max(steps, 1):.2f}"


def outcome(engine: Engine, prompt, **kw) -> tuple[dict, object]:
    """What a client sees, from the stream; the stream's own bookkeeping is checked on the way."""
    steps = list(engine.stream(prompt, **kw))
    ids = [t for s in steps for t in s.token_ids]
    stats = steps[-1].stats
    assert all(s.finish_reason is None for s in steps[:-1]) and steps[-1].finish_reason
    assert stats.completion_tokens == len(ids) == stats.committed_tokens + 1
    assert [s.round.committed for s in steps[1:]] == [len(s.token_ids) for s in steps[1:]]
    return {"token_ids": ids, "text": "".join(s.text for s in steps), "finish_reason": steps[-1].finish_reason,
            "matched_stop": steps[-1].matched_stop, "completion_tokens": stats.completion_tokens}, stats


def same_as_ar(engines: dict[str, Engine], accepted: dict, prompt=PROMPT, **kw) -> dict:
    """Run every method on every engine; each must equal ar. Returns ar's outcome."""
    expected, _ = outcome(engines["random"], prompt, method="ar", **kw)
    for name, engine in engines.items():
        for method, budget in METHODS:
            got, stats = outcome(engine, prompt, method=method, budget=budget, **kw)
            assert got == expected, f"{name} {method} {budget}"
            if name in accepted:
                accepted[name][0] += stats.committed_tokens
                accepted[name][1] += stats.verify_steps
    return expected


@pytest.mark.parametrize("i", [9, 12, 15, 16, 21, 30])
def test_stop_string_ending_anywhere_in_a_round(engines, accepted, ref, i):
    """The oracle's dflash rounds commit tokens 1-8, 9-16, ...: these stops end first, mid and last in a round."""
    stop = next(s for k in range(i, i + 8) if (s := ref.ending_in(k)))
    k = ref.token_ending(stop)
    out = same_as_ar(engines, accepted, max_new_tokens=N, ignore_eos=True, stop=[stop])
    assert out["token_ids"] == ref.ids[:k + 1] and out["text"] == ref.text[:ref.text.index(stop)]
    assert (out["finish_reason"], out["matched_stop"], out["completion_tokens"]) == ("stop", stop, k + 1)


def test_stop_string_spanning_a_round_boundary(engines, accepted, ref):
    stop = next(s for i in (9, 17, 25) if (s := ref.ending_in(i, start=ref.ends[i - 2] - 1)))
    out = same_as_ar(engines, accepted, max_new_tokens=N, ignore_eos=True, stop=[stop])
    assert out["token_ids"] == ref.ids[:ref.token_ending(stop) + 1] and out["matched_stop"] == stop


def split_characters(ref: Ref, tokenizer) -> list[int]:
    """Indices of tokens that complete a multi-byte character begun by the token before."""
    return [i for i in range(1, len(ref.ids)) if tokenizer.decode(ref.ids[i - 1:i]).endswith("\ufffd")
            and not tokenizer.decode(ref.ids[:i + 1]).endswith("\ufffd") and ord(ref.text[ref.ends[i] - 1]) > 127]


def test_stop_string_spanning_a_multibyte_character(engines, accepted, ref, tiny_engine):
    spans = split_characters(ref, tiny_engine.tokenizer)
    assert len(spans) >= 3, "the tiny target's text lost its split multi-byte characters: the test lost its power"
    for i in spans:
        char = ref.text[ref.ends[i] - 1]
        assert len(char.encode()) > 1
        stop = ref.ending_in(i)  # the character and the one before it
        out = same_as_ar(engines, accepted, max_new_tokens=N, ignore_eos=True, stop=[stop])
        assert out["token_ids"] == ref.ids[:ref.token_ending(stop) + 1]
        assert out["text"] == ref.text[:ref.text.index(stop)]


def test_several_stop_strings_first_to_end_wins(engines, accepted, ref):
    late, early = (next(s for i in range(a, a + 8) if (s := ref.ending_in(i))) for a in (30, 12))
    out = same_as_ar(engines, accepted, max_new_tokens=N, ignore_eos=True, stop=[late, early])
    assert out["matched_stop"] == early and out["token_ids"] == ref.ids[:ref.token_ending(early) + 1]
    # One token completing two stop strings: the one ending first in its text wins, then list order (vLLM).
    i = next(i for i in range(10, N) if ref.ends[i] - ref.ends[i - 1] >= 2 and ref.ending_in(i, ref.ends[i] - 1))
    whole, tail = ref.text[ref.ends[i - 1]:ref.ends[i]], ref.text[ref.ends[i] - 1:ref.ends[i]]
    head = ref.text[ref.ends[i - 1]:ref.ends[i] - 1]
    for stops, winner in (([whole, tail], whole), ([tail, whole], tail), ([whole, head], head)):
        if ref.text.find(winner) + len(winner) <= ref.ends[i - 1]:
            continue  # appears earlier: not this token's
        out = same_as_ar(engines, accepted, max_new_tokens=N, ignore_eos=True, stop=stops)
        assert out["matched_stop"] == winner and len(out["token_ids"]) <= i + 1


def test_several_eos_ids_and_min_tokens(engines, accepted, ref, tiny_engine):
    first, second = ref.ids[14], ref.ids[25]
    second = next(t for t in ref.ids[25:] if t != first)
    stop_at = min(ref.ids.index(first), ref.ids.index(second))
    saved = {name: e.eos_ids for name, e in engines.items()}
    try:
        for e in engines.values():
            e.eos_ids = (second, first)
        out = same_as_ar(engines, accepted, max_new_tokens=N)
        assert out["token_ids"] == ref.ids[:stop_at + 1] and out["matched_stop"] == ref.ids[stop_at]
        assert out["finish_reason"] == "stop"
        assert out["text"] == tiny_engine.tokenizer.decode(ref.ids[:stop_at], skip_special_tokens=True)  # not the EOS
        later = same_as_ar(engines, accepted, max_new_tokens=N, min_tokens=stop_at + 3)
        assert not {first, second} & set(later["token_ids"][:stop_at + 3])  # masked, part of the target law
        assert later["finish_reason"] == "length" or later["token_ids"][-1] in (first, second)
    finally:
        for name, e in engines.items():
            e.eos_ids = saved[name]


def test_stop_strings_wait_for_min_tokens(engines, accepted, ref):
    """vLLM's rule: a stop string counts only if it ends in the text of a token past min_tokens."""
    i = next(i for i in range(8, 40) if (s := ref.ending_in(i)) and ref.text.count(s) >= 2
             and ref.token_ending(s, after=i) < N - 1)
    stop = ref.ending_in(i)
    k = ref.token_ending(stop, after=i)
    out = same_as_ar(engines, accepted, max_new_tokens=N, ignore_eos=True, stop=[stop], min_tokens=i + 1)
    assert out["token_ids"] == ref.ids[:k + 1] and out["matched_stop"] == stop
    assert out["text"] == ref.text[:ref.text.index(stop, ref.ends[i])]


def test_max_tokens_against_stops(engines, accepted, ref):
    stop = next(s for i in range(12, 20) if (s := ref.ending_in(i)))
    k = ref.token_ending(stop)
    cut = same_as_ar(engines, accepted, max_new_tokens=k, ignore_eos=True, stop=[stop])
    assert (cut["finish_reason"], cut["token_ids"]) == ("length", ref.ids[:k])
    on_last = same_as_ar(engines, accepted, max_new_tokens=k + 1, ignore_eos=True, stop=[stop])
    assert (on_last["finish_reason"], on_last["matched_stop"]) == ("stop", stop)  # the stop string wins, as in vLLM


def test_a_stop_string_longer_than_the_text_holds_it_back_and_loses_nothing(engines, accepted, ref):
    never = "x" * 40 + "\u00e9"
    head = ref.text[:ref.ends[30]]
    out = same_as_ar(engines, accepted, max_new_tokens=N, ignore_eos=True, stop=[never, head])
    assert (out["finish_reason"], out["text"]) == ("stop", "")
    assert out["token_ids"] == ref.ids[:ref.token_ending(head) + 1]
    out = same_as_ar(engines, accepted, max_new_tokens=20, ignore_eos=True, stop=[never])
    assert (out["text"], out["finish_reason"]) == (ref.text[:len(out["text"])], "length")
    steps = list(engines["oracle"].stream(PROMPT, max_new_tokens=20, method="ddtree", ignore_eos=True, stop=[never]))
    assert all(s.text == "" for s in steps[:-1]) and steps[-1].text == out["text"]  # everything held back


def test_first_token_can_end_it(engines, accepted, ref):
    stop = ref.text[:ref.ends[0]]
    if stop:
        out = same_as_ar(engines, accepted, max_new_tokens=N, ignore_eos=True, stop=[stop])
        assert out["token_ids"] == ref.ids[:1] and out["text"] == ""
    one = same_as_ar(engines, accepted, max_new_tokens=1, ignore_eos=True, stop=["zzzz"])
    assert one["token_ids"] == ref.ids[:1] and one["finish_reason"] == "length"


def shortest_unique_tail(text: str, ends: list[int], i: int) -> str:
    """The shortest tail (3 characters or more) of text[:ends[i]] whose first occurrence ends in token i."""
    return next(s for n in range(3, ends[i] + 1) if text.find(s := text[ends[i] - n:ends[i]]) + n > ends[i - 1])


@pytest.fixture(scope="module")
def demo() -> Engine:
    return Engine.load()


def test_demo_pair_stops_taken_from_ar_output(demo):
    """The bundled pair on looping text (avg_commit ~8): stop strings from ar's own text, ending at tokens
    spread over it, most of them mid-round in the loop where whole blocks are accepted."""
    full = demo.generate(PAD, max_new_tokens=96, method="ar", ignore_eos=True)
    ends = [len(demo.tokenizer.decode(full.token_ids[:i + 1])) for i in range(len(full.token_ids))]
    stops = [shortest_unique_tail(full.text, ends, i) for i in (5, 15, 25, 35, 50, 70, 90)]
    committed = steps = 0
    for stop in stops:
        ar = demo.generate(PAD, max_new_tokens=96, method="ar", ignore_eos=True, stop=[stop])
        assert ar.finish_reason == "stop" and ar.text == full.text[:full.text.index(stop)]
        for method, budget in (("dflash", None), ("ddtree", 32), ("ddtree", "auto")):
            out = demo.generate(PAD, max_new_tokens=96, method=method, budget=budget, ignore_eos=True, stop=[stop])
            assert (out.token_ids, out.text, out.finish_reason) == (ar.token_ids, ar.text, ar.finish_reason), \
                f"{stop!r}: {method} {budget}"
            committed, steps = committed + out.stats.committed_tokens, steps + out.stats.verify_steps
    assert committed / steps > 1.5
