"""One generation's decoding state and its round: draft -> tree -> verify -> commit.

Invariant between rounds: the target cache holds K/V for every committed token but the last one
(the root of the next tree), and the drafter's cache holds the target features of the same positions.
Prefill establishes it: it caches the whole prompt and chooses the first token, the first root.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ddscope.drafter import Drafter, DrafterCache
from ddscope.model import KVCache, Target
from ddscope.prefix_cache import BLOCK
from ddscope.proposers import Proposer
from ddscope.sampling import Noise, SamplingParams, TokenLogprob, token_logprobs
from ddscope.stats import RoundStats
from ddscope.tree import DraftTree


SCORE_ROWS = 512  # prompt rows scored at a time (echo with logprobs): bounds the logits to 512 x vocab


class Clock:
    """perf_counter in ms, synchronising first on CUDA so phases are not smeared."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() * 1000


@dataclass(frozen=True)
class Law:
    """What a request changes in the target's law, at every node of every tree: a logit bias (OpenAI's
    `logit_bias`, added before temperature) and, below `min_tokens`, the ending tokens made impossible."""
    bias: dict[int, float] = field(default_factory=dict)
    ending: tuple[int, ...] = ()  # EOS and stop_token_ids
    min_tokens: int = 0

    def apply(self, logits: torch.Tensor, index: list[int], bias: torch.Tensor | None) -> torch.Tensor:
        early = [i for i, n in enumerate(index) if n < self.min_tokens]
        if bias is None and not (early and self.ending):
            return logits
        logits = logits.float() + bias if bias is not None else logits.clone()
        if early and self.ending:
            rows, ending = (torch.tensor(x, device=logits.device) for x in (early, self.ending))
            logits[rows[:, None], ending] = float("-inf")
        return logits


class Decoder:
    def __init__(self, target: Target, drafter: Drafter | None, proposer: Proposer, cache: KVCache,
                 draft_cache: DrafterCache | None, sampling: SamplingParams, generator: torch.Generator | None,
                 law: Law = Law(), logprobs: int | None = None):
        self.target, self.drafter, self.proposer = target, drafter, proposer
        self.cache, self.draft_cache = cache, draft_cache
        self.sampling, self.noise = sampling, Noise(generator)
        self.law, self.top_logprobs = law, logprobs  # logprobs: None, or the top N to report with each token
        self.logprobs: list[TokenLogprob] = []  # one per generated token, when asked for
        self.prompt_logprobs: list[TokenLogprob | None] = []  # one per prompt token (echo), when asked for
        self.capture = drafter.cfg.target_layer_ids if proposer.uses_drafter else ()
        self.device = target.lm_head.weight.device
        self._bias = self._bias_row(law.bias, target.cfg.vocab_size)
        self.clock = Clock(self.device)
        self.tokens: list[int] = []
        self.prompt_len = 0
        self.features_from = 0  # the drafter's cache holds features from here on (a prefill skips older ones)

    def _bias_row(self, bias: dict[int, float], vocab: int) -> torch.Tensor | None:
        if not bias:
            return None
        row = torch.zeros(vocab, device=self.device)
        row[list(bias)] = torch.tensor(list(bias.values()), device=self.device)
        return row

    def prefill(self, prompt: list[int], cached: int = 0, prompt_logprobs: int | None = None) -> tuple[int, float]:
        """Cache the whole prompt and choose the first token from its last position's logits, as the
        DDTree reference and vLLM do: no verify round is spent on it. The caches may already hold the
        first `cached` positions (a prefix-cache hit): only the rest is run. Returns (that token, ms).
        `prompt_logprobs` (top N, with cached == 0) also scores every prompt token under its prefix."""
        t0 = self.clock()
        self.cache.length = cached
        if self.draft_cache is not None:
            self.draft_cache.length = 0  # the first draft takes in the features it can see
        self.tokens, self.prompt_len = list(prompt), len(prompt)
        if prompt_logprobs is None:
            # The last layer finishes only the rows read later: the last (the first token's logits), and the first
            # draft's reach from a block's start, so the prefix cache keeps whole blocks of features.
            tail = len(prompt) - self.first_draft_reach(len(prompt)) // BLOCK * BLOCK if self.capture else 1
            out = self.target(torch.tensor(prompt[cached:], dtype=torch.long, device=self.device),
                              torch.arange(cached, len(prompt), device=self.device), self.cache,
                              capture=self.capture, last_only=True, tail=tail)
            features, last = out.features, out.logits[-1:]
        else:
            features, last = self._scored_prefill(prompt, prompt_logprobs)
        if self.capture:
            self.features_from = len(prompt) - len(features)
            self.draft_cache.features[self.features_from:len(prompt)] = features
        first = self.choose(last, [0])[0]
        self._record_logprobs(last, [first])
        self.tokens.append(first)  # the root of the first tree
        return first, self.clock() - t0

    def _scored_prefill(self, prompt: list[int], top: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The whole prompt's forward, scoring each token under its prefix (the first: None, as OpenAI's echo),
        in chunks of SCORE_ROWS: the logits are never more than [SCORE_ROWS, vocab] at once. Returns the
        captured features and the last position's logits."""
        self.prompt_logprobs, features = [None], []
        for a in range(0, len(prompt), SCORE_ROWS):
            ids = prompt[a:a + SCORE_ROWS]
            out = self.target(torch.tensor(ids, dtype=torch.long, device=self.device),
                              torch.arange(a, a + len(ids), device=self.device), self.cache, capture=self.capture)
            following = prompt[a + 1:a + 1 + len(ids)]
            self.prompt_logprobs += token_logprobs(out.logits[:len(following)], following, top)
            features.append(out.features)
        return (torch.cat(features) if self.capture else None), out.logits[-1:]

    def _record_logprobs(self, logits: torch.Tensor, tokens: list[int]) -> None:
        if self.top_logprobs is not None:
            self.logprobs += token_logprobs(logits, tokens, self.top_logprobs)

    def first_draft_reach(self, prompt_len: int) -> int:
        """The first prompt position whose features the first draft reads (its window's reach)."""
        horizon = self.drafter.horizon
        return max(0, prompt_len - horizon) if horizon is not None else 0

    def step(self) -> tuple[list[int], RoundStats]:
        start, root = self.cache.length, self.tokens[-1]
        t0 = self.clock()
        draft_logits = None
        if self.proposer.drafts(start):
            draft_logits = self.drafter.draft(self.target, root, start, self.draft_cache)
        t1 = self.clock()
        tree = self.proposer.tree(root, draft_logits, self.sampling, start, self.tokens)
        tokens = torch.tensor(tree.tokens, dtype=torch.long, device=self.device)
        positions = torch.tensor(tree.depths, dtype=torch.long, device=self.device) + start
        mask = None
        if tree.size:
            mask = torch.ones(len(tree.tokens), start + len(tree.tokens), dtype=torch.bool, device=self.device)
            mask[:, start:] = tree.visibility().to(self.device)
        t2 = self.clock()
        out = self.target(tokens, positions, self.cache, mask, capture=self.capture)
        t_fwd = self.clock()
        path, choices = self.accept(tree, out.logits)
        t3 = self.clock()
        slots = torch.tensor(path, device=self.device)
        self.cache.keep(start, slots)
        if self.capture:
            self.draft_cache.features[start:start + len(path)] = out.features.index_select(0, slots)
        new = [tree.tokens[i] for i in path[1:]] + [choices[path[-1]]]
        self._record_logprobs(out.logits.index_select(0, slots), new)  # node path[k] chose new[k]
        self.tokens += new
        t4 = self.clock()
        rnd = RoundStats(start, tree.size, len(new), t1 - t0, t2 - t1, t3 - t2, t4 - t3, (t1 - t0) + (t_fwd - t2),
                         draft_logits is not None)
        self.proposer.observe(rnd, path, new)
        rnd.commit_ms += self.clock() - t4  # the policy's bookkeeping is part of the round too
        return new, rnd

    def accept(self, tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Lossless acceptance: draw the target's own choice at every node, then walk the tree."""
        choices = self.choose(logits, tree.depths)
        return tree.walk(choices), choices

    def choose(self, logits: torch.Tensor, depths: list[int]) -> list[int]:
        """The target's choice at each node; the node at depth d chooses generated index `generated + d`."""
        index = [len(self.tokens) - self.prompt_len + d for d in depths]
        logits = self.law.apply(logits, index, self._bias)
        noise = None if self.sampling.greedy else self.noise.at(index, logits.shape[-1], logits.device)
        return self.sampling.choose(logits, noise)
