"""One generation's decoding state, in the phases a batched step interleaves with other sequences':
prefill chunks, then rounds of draft -> tree (`plan`) -> verify (the batch's forward) -> `commit`.

Invariant between rounds: the target cache holds K/V for every committed token but the last one
(the root of the next tree), and the drafter's cache holds the target features of the same positions.
Prefill establishes it: it caches the whole prompt and chooses the first token, the first root. A
sequence resumed after preemption prefills again every token but its root, and chooses nothing.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ddscope.models.drafter import Drafter
from ddscope.models.kv_pool import BLOCK
from ddscope.models.target import ForwardOut, Segment, Target
from ddscope.speculative.law import Law, LawApplier
from ddscope.speculative.proposers import Proposer
from ddscope.speculative.sampling import Noise, SamplingParams, TokenLogprob, first_max, token_logprobs
from ddscope.speculative.tree import DraftTree, Steer, root_only
from ddscope.structured.walk import GrammarState

FORCED_MAX = 8  # tokens a plain round takes on where the grammar forces them (within a proposer's max_nodes)
SCORE_ROWS = 512  # prompt rows scored at a time (echo with logprobs): bounds the logits to 512 x vocab


class Clock:
    """perf_counter in ms, synchronising first on CUDA so phases are not smeared."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() * 1000


class Decoder:
    def __init__(self, target: Target, drafter: Drafter | None, proposer: Proposer, sampling: SamplingParams,
                 generator: torch.Generator | None, law: Law = Law(), logprobs: int | None = None,
                 grammar: GrammarState | None = None):
        self.target, self.drafter, self.proposer = target, drafter, proposer
        self.cache: Any = None  # KVCache-like: the sequence's own slots, attached when it is admitted
        self.draft_cache: Any = None
        self.sampling, self.noise = sampling, Noise(generator)
        self.top_logprobs = logprobs  # logprobs: None, or the top N to report with each token
        self.logprobs: list[TokenLogprob] = []  # one per generated token, when asked for
        self.prompt_logprobs: list[TokenLogprob | None] = []  # one per prompt token (echo), when asked for
        self.capture = drafter.cfg.target_layer_ids if proposer.uses_drafter else ()
        self.device = target.lm_head.weight.device
        self.law = LawApplier(law, target.cfg.vocab_size, self.device)
        self.grammar = grammar  # structured outputs: every node masked by its own state, drafts grown under it
        self.tokens: list[int] = []
        self.prompt_len = 0
        self.prefill_end = 0  # a prefill caches positions up to here
        self.resumed = False  # a resumed prefill chooses no token: its root is known
        self.features_from = 0  # the drafter's cache holds features from here on (a prefill skips older ones)
        self.features_to: int | None = None  # ... up to here, where `auto` first paused them (None: no pause)
        self.law_top: list[float] | None = None  # this plain round's root: its law's top-4 probabilities, if asked

    def attach(self, cache: Any, draft_cache: Any) -> None:
        self.cache, self.draft_cache = cache, draft_cache

    def begin(self, prompt: list[int] | None, cached: int = 0) -> None:
        """Start a prefill of `prompt`, or (None) a resumed one of every token but the root; the caches may
        already hold the first `cached` positions (a prefix-cache hit): only the rest is run."""
        self.resumed = prompt is None
        if prompt is not None:
            self.tokens, self.prompt_len = list(prompt), len(prompt)
        self.prefill_end = len(self.tokens) - self.resumed
        self.cache.length = cached
        if self.draft_cache is not None:
            self.draft_cache.length = 0  # the first draft takes in the features it can see
        # The last layer finishes only the rows read later: the first draft's reach from a block's start, so
        # whole blocks of features can be shared, and the last row (the first token's logits).
        self.features_from = self.first_draft_reach(self.prefill_end) // BLOCK * BLOCK if self.capture else 0
        self.features_to = None

    @property
    def capturing(self) -> bool:
        """Whether this round keeps the target's features for the drafter (`auto` pauses them where no drafter
        could pay, the drafter's reach permitting)."""
        return bool(self.capture) and self.proposer.captures

    @property
    def prefilling(self) -> bool:
        return self.cache is not None and self.cache.length < self.prefill_end

    def prefill_segment(self, limit: int, scored: bool = False) -> Segment:
        """The next chunk of the prefill, at most `limit` tokens. `scored`: every row's logits (echo with
        logprobs), so the chunk must be at most SCORE_ROWS."""
        a = self.cache.length
        b = min(self.prefill_end, a + limit)
        final = b == self.prefill_end and not self.resumed
        features = max(0, b - max(a, self.features_from)) if self.capture else None
        if scored:
            tail, logits = None, "all"
        else:  # the last layer runs for the features only where the drafter reads its output
            last_read = self.capture and self.target.cfg.geometry.num_layers - 1 in self.capture
            tail, logits = features if last_read else int(final), "last" if final else "none"
        ids = torch.tensor(self.tokens[a:b], dtype=torch.long, device=self.device)
        return Segment(ids, torch.arange(a, b, device=self.device), self.cache, None, tail, logits, features)

    def prefilled(self, seg: Segment, out: ForwardOut, top: int | None = None) -> int | None:
        """Take in a prefill chunk's output; return the first token once the last chunk of a fresh prefill
        ran (chosen from its last position's logits, as the DDTree reference and vLLM do: no verify round is
        spent on it). `top`: the chunk was scored, and each prompt token gets its log-prob under its prefix."""
        b = self.cache.length
        a = b - seg.tokens.shape[0]
        if self.capture and out.features is not None and len(out.features):
            self.draft_cache.features[b - len(out.features):b] = out.features
        if top is not None:
            if a == 0:
                self.prompt_logprobs = [None]  # the first token has no prefix, as OpenAI's echo
            following = self.tokens[a + 1:min(b + 1, self.prompt_len)]
            self.prompt_logprobs += token_logprobs(out.logits[:len(following)], following, top)
        if self.prefilling or self.resumed:
            return None
        last = out.logits[-1:]
        first = self.choose(last, root_only(self.tokens[-1]))[0]
        self._record_logprobs(last, [first])
        self.tokens.append(first)  # the root of the first tree
        if self.grammar is not None:
            self.grammar.advance([first])
        return first

    def _record_logprobs(self, logits: torch.Tensor, tokens: list[int]) -> None:
        if self.top_logprobs is not None:
            self.logprobs += token_logprobs(logits, tokens, self.top_logprobs)

    @property
    def steer(self) -> Steer | None:
        """Each node's legal candidates, when a grammar steers the drafts."""
        return self.grammar.children if self.grammar is not None and self.grammar.steer else None

    def first_draft_reach(self, prompt_len: int) -> int:
        """The first prompt position whose features the first draft reads (its window's reach)."""
        horizon = self.drafter.horizon
        return max(0, prompt_len - horizon) if horizon is not None else 0

    def plan(self, draft_logits: torch.Tensor | None, tree: DraftTree | None = None) -> tuple[DraftTree, Segment]:
        """This round's tree (the proposer's, unless given) and its forward: rooted at the last committed
        token, every node seeing its ancestors only."""
        start = self.cache.length
        if tree is None:
            tree = self.proposer.tree(self.tokens[-1], draft_logits, self.sampling, start, self.tokens, self.steer)
        if self.grammar is not None:
            if draft_logits is None and self.proposer.uses_drafter:  # a plain round: what the grammar forces is certain
                tree.graft(self.grammar.forced(FORCED_MAX))
            tree = self.grammar.prune(tree)
        tokens = torch.tensor(tree.tokens, dtype=torch.long, device=self.device)
        positions = torch.tensor(tree.depths, dtype=torch.long, device=self.device) + start
        mask = None
        if tree.size:
            mask = torch.ones(len(tree.tokens), start + len(tree.tokens), dtype=torch.bool, device=self.device)
            mask[:, start:] = tree.visibility().to(self.device)
        return tree, Segment(tokens, positions, self.cache, mask)

    def commit(self, tree: DraftTree, out: ForwardOut) -> tuple[list[int], list[int]]:
        """Accept, then keep the accepted path's K/V and features. Returns (the committed tokens, the accepted
        node indices)."""
        start = self.cache.length - len(tree.tokens)
        path, choices = self.accept(tree, out.logits)
        slots = torch.tensor(path, device=self.device)
        self.cache.keep(start, slots)
        if self.capture and out.features is not None:
            self.draft_cache.features[start:start + len(path)] = out.features.index_select(0, slots)
        elif self.capture and self.features_to is None:
            self.features_to = start
        new = [tree.tokens[i] for i in path[1:]] + [choices[path[-1]]]
        self._record_logprobs(out.logits.index_select(0, slots), new)  # node path[k] chose new[k]
        self.tokens += new
        if self.grammar is not None:
            self.grammar.advance(new)
        return new, path

    def accept(self, tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Lossless acceptance: draw the target's own choice at every node, then walk the tree. Under a grammar,
        where the sampler's law does not depend on the legal set (greedy, or sampling untruncated), only the
        path's nodes choose: each takes its row's own choice where the grammar admits it, which is the masked
        row's choice too, else chooses over its masked row; the rest are left at -1."""
        if self.grammar is None or not (self.sampling.greedy or self.sampling.untruncated):
            choices = self.choose(logits, tree)
            return tree.walk(choices.__getitem__), choices
        lawful = self._lawful(logits, tree)
        if self._wants_law_top(tree):
            self.law_top = self._law_top(self.grammar.mask_rows(lawful, [[]]))
        scores = self._scores(lawful, tree)
        firsts, choices = first_max(scores).tolist(), [-1] * len(tree.tokens)

        def choose(node: int) -> int:
            choices[node] = self.grammar.first_legal_max(scores[node], tree.path(node), firsts[node])
            return choices[node]
        return tree.walk(choose), choices

    def choose(self, logits: torch.Tensor, tree: DraftTree) -> list[int]:
        """The target's choice at each node, under the law with the node's own history; the node at depth d
        chooses generated index `generated + d`."""
        if self.grammar is not None:
            logits = self.grammar.mask_rows(logits, tree.paths())
        logits = self._lawful(logits, tree)
        if self._wants_law_top(tree):
            self.law_top = self._law_top(logits)
        return first_max(self._scores(logits, tree)).tolist()

    def _scores(self, lawful: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """What each node's choice is the first max of: its lawful logits (greedy), or its log-probs under the
        sampler minus the log of its generated index's Exp(1) noise: an exponential race, argmax(log p - log E),
        a Gumbel-max draw as vLLM's random_sample."""
        if self.sampling.greedy:
            return lawful
        noise = self.noise.at(self._generated(tree), lawful.shape[-1], lawful.device)
        return self.sampling.log_probs(lawful) - noise.log()

    def _wants_law_top(self, tree: DraftTree) -> bool:
        return tree.size == 0 and self.proposer.wants_law_top and not self.sampling.greedy

    def _law_top(self, lawful: torch.Tensor) -> list[float]:
        """A plain round's root (its lawful row, masked under a grammar) under the sampler: its 4 likeliest
        probabilities."""
        return self.sampling.log_probs(lawful[:1])[0].topk(4).values.exp().tolist()

    def _generated(self, tree: DraftTree) -> list[int]:
        """The generated index each node chooses."""
        return [len(self.tokens) - self.prompt_len + d for d in tree.depths]

    def _lawful(self, logits: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """The rows under the law, each with its node's own history (token by token, as a grammar's mask: the
        two commute)."""
        if not self.law.active:
            return logits
        paths = tree.paths() if self.law.law.reads_history else [[]] * len(tree.tokens)
        return self.law.apply(logits, self._generated(tree), self.tokens[:self.prompt_len],
                              self.tokens[self.prompt_len:], paths)
