"""Structured outputs in the engine: every tree node masked by its own grammar state, so `dflash` and `ddtree`
equal `ar` under the same constraint (greedy and seeded), drafts grown under the grammar are accepted, outputs
match the constraint (or are a prefix it accepts, on `length`), and the grammar's state survives rejected branches
and preemption."""
from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr

from ddscope.bench.synthetic_models import oracle_engine
from ddscope.engine import Engine
from ddscope.speculative.sampling import SamplingParams, first_max
from ddscope.speculative.tree import best_first
from ddscope.structured.backend import backend_class
from ddscope.structured.compiler import Grammars
from ddscope.structured.constraint import Constraint, ConstraintError
from ddscope.structured import masks
from ddscope.structured.walk import GrammarState

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "[a-z]{1,8}"}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"]}
REGEX = r"(ab|cd){1,4}-[0-9]{2,4}x"
CHOICES = ["def add", "The quick brown fox", "Hello"]
EBNF = 'root ::= "f(" arg ("," arg)? ")"\narg ::= [a-z] | [0-9] [0-9]?'
CONSTRAINTS = {
    "json": (Constraint("json", json.dumps(SCHEMA), any_whitespace=False), lambda t: json.loads(t)),
    "regex": (Constraint("regex", REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "choice": (Constraint("choice", json.dumps(CHOICES)), lambda t: t in CHOICES or pytest.fail(t)),
    "grammar": (Constraint("grammar", EBNF), lambda t: re.fullmatch(r"f\(([a-z]|[0-9]{1,2})(,([a-z]|[0-9]{1,2}))?\)", t)
                or pytest.fail(t)),
}
PROMPTS = ["Hello, how", "def add(a,", "The quick brown"]


@pytest.fixture(scope="module")
def oracle(tiny_engine):
    """The target's own continuation, right at 80% of depths: an unconstrained drafter, which the grammar steers."""
    return oracle_engine(tiny_engine, accuracy=0.8)


def _accepts(grammars: Grammars, c: Constraint, ids: list[int]) -> bool:
    m = grammars.compile(c).matcher()
    return all(m.accept(t) for t in ids)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_greedy_under_a_grammar_equals_ar_and_steered_drafts_are_accepted(oracle, kind):
    constraint, valid = CONSTRAINTS[kind]
    steered = {True: [0, 0], False: [0, 0]}  # steer -> [committed, steps]
    for prompt in PROMPTS:
        ref = oracle.generate(prompt, max_new_tokens=48, method="ar", constraint=constraint)
        assert ref.finish_reason == "stop" and ref.token_ids[-1] in oracle.eos_ids
        valid(ref.text)
        for method, budget in (("dflash", None), ("ddtree", 8), ("ddtree", 32), ("ddtree", "auto")):
            for steer in (True, False):
                out = oracle.generate(prompt, max_new_tokens=48, method=method, budget=budget, constraint=constraint,
                                      steer=steer)
                assert out.token_ids == ref.token_ids, (kind, method, budget, steer)
                assert out.finish_reason == ref.finish_reason
                steered[steer][0] += out.stats.committed_tokens
                steered[steer][1] += out.stats.verify_steps
                assert out.stats.to_dict()["grammar_masks"] > 0
    on, off = (c / s for c, s in steered.values())
    assert on > 1.5, f"steered drafts were hardly accepted ({on:.2f} a step): the test lost its power"
    assert on > off  # the lever: a tree grown under the grammar commits more than one cut at verify


def test_seeded_sampling_under_a_grammar_is_the_same_under_every_method(oracle):
    constraint, valid = CONSTRAINTS["json"]
    committed = steps = 0
    for seed, prompt in enumerate(PROMPTS):
        kw = dict(max_new_tokens=48, temperature=0.9, seed=seed, constraint=constraint)
        ref = oracle.generate(prompt, method="ar", **kw)
        for method, budget in (("dflash", None), ("ddtree", 16), ("ddtree", "auto")):
            out = oracle.generate(prompt, method=method, budget=budget, **kw)
            assert out.token_ids == ref.token_ids
            committed, steps = committed + out.stats.committed_tokens, steps + out.stats.verify_steps
        if ref.finish_reason == "stop":
            valid(ref.text)
    assert committed / steps > 1.2


def test_every_token_is_legal_where_the_target_would_choose_otherwise(tiny_engine):
    """Unconstrained, the tiny target writes no JSON at all: the mask, not luck, makes the output valid."""
    constraint, valid = CONSTRAINTS["json"]
    free = tiny_engine.generate(PROMPTS[0], max_new_tokens=24, method="ar", ignore_eos=True)
    assert not free.text.startswith("{")
    out = tiny_engine.generate(PROMPTS[0], max_new_tokens=64, method="ddtree", budget=16, constraint=constraint)
    valid(out.text)


def test_a_cut_output_is_a_prefix_the_grammar_accepts(tiny_engine):
    constraint = Constraint("json", json.dumps({"type": "object", "properties": {"s": {"type": "string"}},
                                                "required": ["s"]}))
    out = tiny_engine.generate(PROMPTS[1], max_new_tokens=6, method="ddtree", budget=16, constraint=constraint)
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert _accepts(tiny_engine.grammars, constraint, out.token_ids)


def test_rejected_branches_and_preemption_leave_the_grammar_in_step(tiny_engine):
    """Half-right drafts (branches rejected every round) in a pool so small that sequences are preempted and
    recomputed: every constrained output equals its run alone, and matches its constraint up to its end (decoding
    goes on past it, ignore_eos, so that the load outgrows the pool)."""
    plans = [("json", "ddtree", 16), ("regex", "dflash", None), ("grammar", "ddtree", 8), ("json", "ar", None),
             ("choice", "ddtree", 32), ("regex", "ddtree", 16), ("json", "dflash", None), ("grammar", "ddtree", 32),
             ("json", "ddtree", "auto"), ("regex", "ddtree", "auto")]
    requests = [(PROMPTS[i % 3], dict(method=m, budget=b, max_new_tokens=100, ignore_eos=True,
                                      constraint=CONSTRAINTS[k][0])) for i, (k, m, b) in enumerate(plans * 2)]
    alone = oracle_engine(tiny_engine, accuracy=0.5)
    want = [alone.generate(p, **kw).token_ids for p, kw in requests]
    small = oracle_engine(tiny_engine, accuracy=0.5, max_model_len=160, kv_cache_mb=2)
    seqs = [small.sequence(p, **kw) for p, kw in requests]
    for s in seqs:
        small.add(s)
    for _ in range(5000):
        if not small.busy:
            break
        small.step()
    got = [[t for step in s.outbox for t in step.token_ids] for s in seqs]
    assert small.preemptions > 0
    assert got == want
    for (p, kw), ids in zip(requests, got):
        end = next(i for i, t in enumerate(ids) if t in small.eos_ids)
        assert _accepts(small.grammars, kw["constraint"], ids[:end + 1])


def test_a_plain_round_takes_on_what_the_grammar_forces(tiny_engine):
    """`forced`: each token the only one legal after those before it. `auto`'s plain rounds (here lookup is off and
    the random drafter never pays) verify them with the root, so a round commits a forced run and the target's
    next token at once, and the output is `ar`'s."""
    regex = r'(\{"key": [0-9]\}\n){12}'
    state = GrammarState(tiny_engine.grammars.compile(Constraint("regex", regex)), tiny_engine.vocab_size)
    chain = state.forced(8)
    assert chain
    for i, token in enumerate(chain):
        allowed = state.allowed(chain[:i])
        assert allowed.sum() == 1 and allowed[token]
    assert len(chain) == 8 or state.allowed(chain).sum() > 1
    kw = dict(max_new_tokens=64, constraint=Constraint("regex", regex), lookup=False)
    ref = tiny_engine.generate(PROMPTS[0], method="ar", **kw)
    out = tiny_engine.generate(PROMPTS[0], method="ddtree", budget="auto", **kw)
    assert out.token_ids == ref.token_ids
    assert any(not r.drafted and r.committed > 1 for r in out.stats.rounds)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_each_backend_says_cheaply_whether_the_next_bytes_are_forced(tiny_engine, backend):
    """`forces`, the test before `forced`'s fills: true at a string's opening quote, false inside it, and false past
    the grammar's stop token (ignore_eos decodes on there; xgrammar raises if asked)."""
    b = backend_class(backend)(tiny_engine.tokenizer, tiny_engine.vocab_size, list(tiny_engine.eos_ids))
    b.ready()
    m = b.compile(Constraint("regex", '"[a-z]*"')).matcher()
    assert m.forces()
    quote = next(t for t in range(tiny_engine.vocab_size) if tiny_engine.tokenizer.decode([t]) == '"')
    assert m.accept(quote) and not m.forces()
    assert m.accept(quote) and m.accept(tiny_engine.eos_ids[0]) and m.is_terminated() and not m.forces()


def test_the_tree_grows_only_legal_tokens_and_a_forced_token_is_certain(tiny_engine):
    c = Constraint("regex", r"\{\"key\": [0-9]+\}")
    state = GrammarState(tiny_engine.grammars.compile(c), tiny_engine.vocab_size)
    logprobs = torch.randn(15, tiny_engine.vocab_size).log_softmax(-1)
    tree = best_first(0, logprobs, 24, state.children(logprobs, 24))
    assert tree.size == 24
    for i, path in enumerate(tree.paths()):
        assert state.legal(path), path
    forced = [i for i in range(1, len(tree.tokens)) if tree.ranks[i] == 0 and
              state.allowed(tree.path(tree.parents[i])).sum() == 1]
    assert forced and all(tree.logps[i] == 0.0 for i in forced)  # "{" then '"' ... : the drafter's word overruled


def test_candidates_are_the_likeliest_legal_tokens_renormalised(tiny_engine):
    """Mask.best against the whole vocabulary masked and renormalised: a large legal set (read off the drafter's
    likeliest tokens) and a small one (scanned whole) alike."""
    vocab, seeded = tiny_engine.vocab_size, torch.Generator().manual_seed(0)
    for c in (Constraint("regex", '"[a-z ]*"'), Constraint("regex", "[0-9]{1,3}")):
        state = GrammarState(tiny_engine.grammars.compile(c), vocab)
        logprobs = (3 * torch.randn(15, vocab, generator=seeded)).log_softmax(-1)
        children = state.children(logprobs, 8)
        tree = best_first(0, logprobs, 12, children)
        for node in range(len(tree.tokens)):
            allowed = state.allowed(tree.path(node))
            if allowed is None or tree.depths[node] >= 15:  # past the grammar's end; past the drafter's block
                continue
            legal = torch.from_numpy(allowed)
            row = logprobs[tree.depths[node]].masked_fill(~legal, float("-inf"))
            vals, ids = (row - row.logsumexp(0)).topk(min(8, int(legal.sum())))
            got_vals, got_ids = children(tree, node)
            assert got_ids == ids.tolist() and got_vals == pytest.approx(vals.tolist(), abs=1e-4)


def test_the_greedy_walk_masks_each_path_row_as_mask_rows_does(tiny_engine):
    compiled = tiny_engine.grammars.compile(Constraint("regex", '"[a-z ]{0,6}" [0-9]+'))
    state = GrammarState(compiled, tiny_engine.vocab_size)
    logprobs = torch.randn(15, tiny_engine.vocab_size).log_softmax(-1)
    tree = state.prune(best_first(0, logprobs, 24, state.children(logprobs, 24)))
    logits = torch.randn(len(tree.tokens), tiny_engine.vocab_size)
    masked = state.mask_rows(logits, tree.paths()).max(-1).indices.tolist()
    assert [state.first_legal_max(logits[i], p) for i, p in enumerate(tree.paths())] == masked
    assert any(masked[i] != logits[i].argmax() for i in range(len(masked)))  # the masks did choose


def _fills(compiled, paths: list[list[int]], vocab: int) -> list[bytes]:
    """Each path's bitmask, filled by a fresh matcher (none where the grammar ended)."""
    out = []
    for path in paths:
        m, bitmask = compiled.matcher(), torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
        assert all(m.accept(t) for t in path)
        if not m.is_terminated():
            m.fill(bitmask)
            out.append(bitmask.numpy().tobytes())
    return out


def test_nodes_of_one_legal_set_share_one_mask_and_the_verify_fills_only_the_last_node(tiny_engine):
    """Inside a free string every node's fill gives the same bitmask: the round builds one mask for all of them
    (candidates, verify rows), so the masks built are exactly the distinct legal sets, far fewer than the nodes;
    each node's state is read once, and the verify reuses what the tree's growth filled: all but the last node's,
    whose children the growth never asks for."""
    compiled = tiny_engine.grammars.compile(Constraint("regex", '"[a-z ]*"'))
    state = GrammarState(compiled, tiny_engine.vocab_size)
    logprobs = torch.randn(15, tiny_engine.vocab_size).log_softmax(-1)
    tree = state.prune(best_first(0, logprobs, 32, state.children(logprobs, 32)))
    grown = state.take_cost()
    fills = _fills(compiled, tree.paths(), tiny_engine.vocab_size)
    assert grown.fills == len(fills) - 1 and grown.masks <= len(set(fills)) < len(tree.tokens) / 4
    state.mask_rows(torch.zeros(len(tree.tokens), tiny_engine.vocab_size), tree.paths())
    assert (state.take_cost().fills, state.masks[()].legal.sum() > 0) == (1, True)


def test_a_greedy_row_whose_best_token_is_legal_fills_nothing_and_a_refused_one_is_masked(tiny_engine):
    """`ar` under a grammar, and a verify's last node: the row's own first max, checked, where the grammar admits
    it; where it refuses it, the node's legal set is filled and the masked row's first max taken."""
    state = GrammarState(tiny_engine.grammars.compile(Constraint("regex", '"[a-z]*"')), tiny_engine.vocab_size)
    quote = int(torch.from_numpy(state.allowed(())).nonzero()[0])
    state.advance([quote])
    state.take_cost()
    letters = torch.from_numpy(GrammarState(tiny_engine.grammars.compile(Constraint("regex", "[a-z]")),
                                            tiny_engine.vocab_size).allowed(()).copy()).nonzero().flatten()
    row = torch.zeros(tiny_engine.vocab_size)
    row[letters[3]], row[letters[5]] = 10.0, 10.0  # a tie: the first is the masked row's choice too
    assert state.first_legal_max(row, []) == letters[3] and state.take_cost().fills == 0
    row[1] = 50.0  # a special token, which no string admits, on top
    assert state.first_legal_max(row, []) == letters[3] and state.take_cost().fills == 1


def test_an_untruncated_sampler_s_draw_over_the_legal_set_is_the_row_s_own_where_legal(tiny_engine):
    """A sampled verify under a grammar takes each row's own draw where the grammar admits it: for a sampler that
    keeps every token, masking only shifts a row's log-probs, so its draw (the first max of log p - log E) over the
    legal set is that one; where the sampler truncates (top-p here) the masked law is another, and the verify masks
    every row first (`SamplingParams.untruncated` says which)."""
    state = GrammarState(tiny_engine.grammars.compile(Constraint("regex", "[0-9]{1,4}")), tiny_engine.vocab_size)
    seeded = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(64, tiny_engine.vocab_size, generator=seeded)
    noise = torch.rand(64, tiny_engine.vocab_size, generator=seeded).neg_().log1p_().neg_()
    differs = 0
    for sampler in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)):
        masked = first_max(sampler.log_probs(state.mask_rows(logits, [[]] * 64)) - noise.log()).tolist()
        own = sampler.log_probs(logits) - noise.log()
        got = [state.first_legal_max(row, []) for row in own]
        assert sampler.untruncated == (got == masked)
        differs += sum(a != b for a, b in zip(got, masked))
    assert differs  # the truncated sampler's law did move under the mask


@pytest.mark.parametrize("large", [False, True])  # the set read on the host, or the row masked by addition
def test_a_row_whose_every_legal_token_the_law_refused_takes_the_grammar_s_first(tiny_engine, large, monkeypatch):
    """A law against the grammar (min_tokens banning the stop where only the stop is legal) leaves every legal token
    at -inf: the choice is the first legal token, whichever way the set is read, never an illegal one (here token
    0, the stop, which the string's set does not admit: a masked row's plain first max would take it)."""
    monkeypatch.setattr(masks, "LARGE_SET", 64 if large else 10**9)
    state = GrammarState(tiny_engine.grammars.compile(Constraint("regex", '"[^"]*"')), tiny_engine.vocab_size)
    path = [int(torch.from_numpy(state.allowed(())).nonzero()[0])]  # past the opening quote
    legal = torch.from_numpy(state.allowed(path).copy())
    assert not legal[0] and (state.mask(path).count >= masks.LARGE_SET) == large
    row = torch.where(legal, float("-inf"), 1.0)
    assert state.first_legal_max(row, path) == int(legal.nonzero()[0])


@pytest.mark.parametrize("constraint,message", [
    (Constraint("regex", "(unclosed"), "parenthesis"),
    (Constraint("json", '{"type": "nonsense"}'), "does not compile"),
    (Constraint("grammar", "root ::= undefined_rule"), "does not compile"),
    (Constraint("choice", "[]"), "does not compile"),
])
def test_a_constraint_that_does_not_compile_is_refused(tiny_engine, constraint, message):
    with pytest.raises(ConstraintError, match=message):
        tiny_engine.sequence("hi", constraint=constraint)
    assert tiny_engine.generate("hi", max_new_tokens=4, constraint=CONSTRAINTS["regex"][0]).token_ids


def test_a_compile_past_its_time_is_refused_and_not_run_again(tiny_pair):
    engine = Engine.load(*tiny_pair)
    slow = Grammars(engine.tokenizer, engine.vocab_size, list(engine.eos_ids), timeout_s=1e-4)
    big = Constraint("json", json.dumps({"type": "object", "properties": {
        f"k{i}": {"type": "array", "items": {"type": "string", "pattern": "[a-z]{2,9}"}} for i in range(40)}}))
    with pytest.raises(ConstraintError, match="took over"):
        slow.compile(big)
    assert ("auto", big) not in slow.cache


def test_the_grammar_cost_is_recorded_per_round(oracle):
    out = oracle.generate(PROMPTS[0], max_new_tokens=32, method="ddtree", budget=16,
                          constraint=CONSTRAINTS["json"][0])
    rounds = out.stats.rounds
    assert sum(r.grammar_masks for r in rounds) == out.stats.to_dict()["grammar_masks"] > len(rounds)
    assert all(r.grammar_masks <= r.grammar_fills for r in rounds)  # nodes of one legal set share a mask
    assert all(r.grammar_ms >= 0 for r in rounds) and out.stats.to_dict()["grammar_ms"] > 0


def test_past_the_grammar_s_end_nothing_is_constrained(tiny_engine):
    """With ignore_eos, decoding goes on after the grammar's stop token, unconstrained, as vLLM leaves a
    terminated grammar's bitmask unfilled; every method agrees there too."""
    constraint = CONSTRAINTS["choice"][0]
    ref = tiny_engine.generate(PROMPTS[2], max_new_tokens=20, method="ar", constraint=constraint, ignore_eos=True)
    assert len(ref.token_ids) == 20
    out = tiny_engine.generate(PROMPTS[2], max_new_tokens=20, method="ddtree", budget=8, constraint=constraint,
                               ignore_eos=True)
    assert out.token_ids == ref.token_ids

