"""What a request changes in the target's law, applied at every node of every tree with that node's own history.

A node's history is the committed text plus its own path through the tree: siblings differ, so a penalty or
a banned word computed from the root's history would not be the law `ar` samples from, and the verify would
not be lossless. The order is vLLM v1's sampler (vllm/v1/sample/sampler.py, `apply_logits_processors`):
allowed_token_ids, bad_words, then logit_bias and the min_tokens mask, then the repetition, frequency and
presence penalties; temperature and the filters come after, in SamplingParams.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Law:
    bias: dict[int, float] = field(default_factory=dict)  # OpenAI's logit_bias
    ending: tuple[int, ...] = ()  # EOS and stop_token_ids, impossible below min_tokens
    min_tokens: int = 0
    allowed: tuple[int, ...] | None = None  # vLLM's allowed_token_ids: every other token impossible
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences whose last token is banned after the rest
    repetition: float = 1.0  # divides positive logits (multiplies others) of tokens in the prompt or output
    frequency: float = 0.0  # subtracted once per occurrence in the output
    presence: float = 0.0  # subtracted once if the token occurs in the output

    @property
    def penalized(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0

    @property
    def reads_history(self) -> bool:
        return self.penalized or any(len(w) > 1 for w in self.bad_words)


class LawApplier:
    """One sequence's law on its device: the constant rows built once, the history-dependent parts per call."""

    def __init__(self, law: Law, vocab: int, device: torch.device):
        self.law, self.vocab, self.device = law, vocab, device
        self.bias = _row(law.bias, vocab, device)
        self.banned = torch.zeros(vocab, dtype=torch.bool, device=device)
        if law.allowed is not None:
            self.banned[:] = True
            self.banned[list(law.allowed)] = False
        single = [w[0] for w in law.bad_words if len(w) == 1]
        if single:
            self.banned[single] = True
        self.any_banned = bool(self.banned.any())
        self.multi = [w for w in law.bad_words if len(w) > 1]
        self._prompt_mask: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        law = self.law
        return self.bias is not None or self.any_banned or self.law.reads_history or bool(law.ending and law.min_tokens)

    def apply(self, logits: torch.Tensor, index: list[int], prompt: list[int], output: list[int],
              paths: list[list[int]]) -> torch.Tensor:
        """Rows of `logits` under the law. Row i chooses generated index `index[i]`, after the committed `output`
        and then `paths[i]` (the tree tokens between the root and the node, both excluded from `output`)."""
        if not self.active:
            return logits
        logits = logits.float().clone()
        if self.any_banned:
            logits.masked_fill_(self.banned, float("-inf"))
        for row, last in self._bad_word_hits(output, paths):
            logits[row, last] = float("-inf")
        if self.bias is not None:
            logits += self.bias
        early = [i for i, n in enumerate(index) if n < self.law.min_tokens]
        if early and self.law.ending:
            rows, ending = (torch.tensor(x, device=logits.device) for x in (early, self.law.ending))
            logits[rows[:, None], ending] = float("-inf")
        if self.law.penalized:
            self._penalize(logits, prompt, output, paths)
        return logits

    def _bad_word_hits(self, output: list[int], paths: list[list[int]]) -> list[tuple[int, int]]:
        """(row, token) for each multi-token bad word whose head the row's history ends with (vLLM matches the
        output only: v1/sample/ops/bad_words.py)."""
        if not self.multi:
            return []
        reach = max(len(w) for w in self.multi) - 1
        hits = []
        for row, path in enumerate(paths):
            tail = (output[-reach:] + path)[-reach:]
            for w in self.multi:
                head = list(w[:-1])
                if len(head) <= len(tail) and tail[len(tail) - len(head):] == head:
                    hits.append((row, w[-1]))
        return hits

    def _penalize(self, logits: torch.Tensor, prompt: list[int], output: list[int], paths: list[list[int]]) -> None:
        """vLLM's apply_penalties (model_executor/layers/utils.py), with each row's own output counts."""
        law, n = self.law, logits.shape[0]
        base = torch.bincount(torch.tensor(output, dtype=torch.long, device=self.device), minlength=self.vocab)
        counts = base.to(logits.dtype).expand(n, -1).clone()
        pairs = [(row, t) for row, path in enumerate(paths) for t in path]
        if pairs:
            rows, toks = torch.tensor(pairs, device=self.device).T
            counts.index_put_((rows, toks), torch.ones(len(pairs), device=self.device), accumulate=True)
        seen = counts > 0
        if law.repetition != 1.0:
            scale = torch.where(seen | self._prompt(prompt), law.repetition, 1.0)
            logits.copy_(torch.where(logits > 0, logits / scale, logits * scale))
        if law.frequency:
            logits -= law.frequency * counts
        if law.presence:
            logits -= law.presence * seen.to(logits.dtype)

    def _prompt(self, prompt: list[int]) -> torch.Tensor:
        if self._prompt_mask is None:
            self._prompt_mask = torch.zeros(self.vocab, dtype=torch.bool, device=self.device)
            self._prompt_mask[torch.tensor(prompt, dtype=torch.long, device=self.device)] = True
        return self._prompt_mask


def _row(bias: dict[int, float], vocab: int, device: torch.device) -> torch.Tensor | None:
    if not bias:
        return None
    row = torch.zeros(vocab, device=device)
    row[list(bias)] = torch.tensor(list(bias.values()), device=device)
    return row


MAX_BAD_WORDS = 128  # token sequences after tokenization, as vLLM's VLLM_MAX_NUM_BAD_WORDS


def bad_word_ids(tokenizer, words: list[str], vocab: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of `bad_words` (sampling_params.py:802-860 in vLLM 0.32): each word as it is and, if
    that makes a new first token of the same length, with a leading space, so it is banned at the start of the
    text and mid-text alike. ValueError on an empty word, one that tokenizes to nothing, or too many."""
    out: list[list[int]] = []
    for word in dict.fromkeys(words):
        if not word:
            raise ValueError("bad_words cannot contain an empty string")
        for spaced in (False, True):
            ids = tokenizer.encode((" " if spaced else "") + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not spaced:
                    raise ValueError(f"bad_words entry {word!r:.40} tokenizes to no tokens")
                continue
            if not spaced or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    if len(out) > MAX_BAD_WORDS:
        raise ValueError(f"too many bad words after tokenization: {len(out)}, at most {MAX_BAD_WORDS}")
    if any(not 0 <= t < vocab for ids in out for t in ids):
        raise ValueError(f"bad_words tokenize to ids outside the model's vocabulary ({vocab})")
    return tuple(tuple(ids) for ids in out)
