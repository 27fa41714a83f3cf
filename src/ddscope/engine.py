"""The public engine: load a target (and drafter), then generate with `ar`, `dflash` or `ddtree`."""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ddscope.budget import AutoBudget, Learned, VerifyCost
from ddscope.config import CheckpointError, eos_ids
from ddscope.decoding import Decoder
from ddscope.drafter import Drafter
from ddscope.hf_target import HFTarget, load_target
from ddscope.model import Target
from ddscope.proposers import AR, DDTree, DFlash, Proposer
from ddscope.sampling import SamplingParams
from ddscope.stats import GenerationStats, RoundStats

DEMO_DIR = Path(__file__).parent / "assets" / "demo"
METHODS = ("ar", "dflash", "ddtree")
DTYPES = ("float32", "bfloat16", "float16")
MAX_BUDGET = 512


@dataclass
class Step:
    token_ids: list[int]
    text: str
    round: RoundStats | None  # None for the first token, which the prefill chose
    stats: GenerationStats  # running totals of this generation, final on the last step
    finish_reason: str | None = None
    matched_stop: int | str | None = None  # on "stop": the EOS id or the stop string that ended it


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    stats: GenerationStats


class Engine:
    """Batch-1 engine; one generation at a time (the server serialises requests)."""

    def __init__(self, target: Target | HFTarget, drafter: Drafter | None, tokenizer, source: Path, max_model_len: int,
                 default_budget: int | str = 32):
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.source, self.model_name = str(source.resolve()), source.name
        self.max_model_len, self.default_budget = max_model_len, default_budget
        self.verify_cost: VerifyCost | None = None  # calibrated on first use of budget="auto"
        self.learned: dict[tuple, Learned] = {}  # auto's model of the pair, per sampler, across requests
        self.device = target.lm_head.weight.device
        self.cache = target.new_cache(max_model_len + MAX_BUDGET + 1)
        self.draft_cache = drafter.new_cache(max_model_len + 1) if drafter is not None else None
        self.eos_ids = eos_ids(source, tokenizer, target.cfg.eos_token_ids)

    @classmethod
    def load(cls, target: str | Path | None = None, drafter: str | Path | None = None, device: str = "cpu",
             dtype: str = "float32", max_model_len: int | None = None, target_backend: str = "auto",
             device_map: str | None = None) -> "Engine":
        """`target_backend`: the native Qwen3/Llama model where it applies (auto), or transformers for any
        other causal LM (ddscope.hf_target); `device_map` (transformers) shards a target over several GPUs."""
        if target is None:
            target, drafter = DEMO_DIR / "target", drafter or DEMO_DIR / "drafter"
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        target_dir = Path(target)
        if not target_dir.is_dir():
            raise CheckpointError(f"target checkpoint directory not found: {target_dir}")
        model = load_target(target_dir, torch.device(device), getattr(torch, dtype), target_backend, device_map)
        draft = Drafter.load(Path(drafter), model) if drafter is not None else None
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{target_dir}: no usable tokenizer ({e})") from e
        limit = model.cfg.max_position_embeddings
        if max_model_len is not None and not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}], got {max_model_len}")
        return cls(model, draft, tokenizer, target_dir, max_model_len or limit)

    def with_drafter(self, drafter: str | Path) -> "Engine":
        """Another engine over this one's target (weights shared, caches its own), with another drafter:
        two drafters compared side by side in one process."""
        return Engine(self.target, Drafter.load(Path(drafter), self.target), self.tokenizer, Path(self.source),
                      self.max_model_len, self.default_budget)

    @property
    def methods(self) -> tuple[str, ...]:
        return METHODS if self.drafter is not None else ("ar",)

    @property
    def vocab_size(self) -> int:
        return self.target.cfg.vocab_size

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def proposer(self, method: str, budget: int | None, sampling: SamplingParams = SamplingParams()) -> Proposer:
        if method not in self.methods:
            raise ValueError(f"unknown or unavailable method {method!r}; available: {', '.join(self.methods)}")
        if method == "ar":
            return AR()
        if method == "dflash":
            return DFlash()
        budget = self.default_budget if budget is None else budget
        if budget == "auto":
            if self.verify_cost is None:
                self.verify_cost = VerifyCost.cached(self.target, self.max_model_len, self.source)
            return DDTree(AutoBudget(self.verify_cost, self._learned(sampling)))
        if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= MAX_BUDGET:
            raise ValueError(f"budget must be an integer in [1, {MAX_BUDGET}] or 'auto', got {budget!r}")
        return DDTree(budget)

    def _learned(self, sampling: SamplingParams) -> Learned:
        """What `auto` learned under this sampler, kept across requests (the 16 latest samplers)."""
        key = (sampling.temperature, sampling.top_p, sampling.top_k)
        if key not in self.learned and len(self.learned) >= 16:
            del self.learned[next(iter(self.learned))]
        return self.learned.setdefault(key, Learned())

    def stream(self, prompt: str | list[int], *, max_new_tokens: int = 128, method: str = "ddtree",
               budget: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: int | None = None, ignore_eos: bool = False, min_tokens: int = 0,
               stop: list[str] | None = None) -> Iterator[Step]:
        """Validate now, then yield the prefill's token as the first Step (prefill runs at the first `next`)
        and one Step per verify round after it.

        Closing the iterator cancels generation at the next round.
        """
        ids = self.encode(prompt)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(ids) + max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        if not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_new_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_new_tokens], got {min_tokens!r}")
        sampling = SamplingParams(temperature, top_p, top_k, seed)
        proposer = self.proposer(method, budget, sampling)
        generator = torch.Generator(self.device).manual_seed(seed if seed is not None else random.getrandbits(63))
        decoder = Decoder(self.target, self.drafter, proposer, self.cache, self.draft_cache, sampling, generator,
                          () if ignore_eos else self.eos_ids, min_tokens)
        stats = GenerationStats(method, getattr(proposer, "budget", None), len(ids))
        return self._rounds(decoder, ids, stats, max_new_tokens, () if ignore_eos else self.eos_ids, stop or [])

    def _rounds(self, decoder: Decoder, prompt: list[int], stats: GenerationStats, max_new: int,
                eos: tuple[int, ...], stop: list[str]) -> Iterator[Step]:
        first, stats.prefill_ms = decoder.prefill(prompt)
        stats.from_prefill = 1
        new, rnd = [first], None  # the prefill's token is yielded on its own, before any verify round
        n_out, emitted = 0, 0  # tokens kept, characters yielded
        text = IncrementalText(self.tokenizer)
        holdback = max((len(s) for s in stop), default=1) - 1
        while True:
            kept, reason = _truncate(new, n_out, eos, max_new, decoder.min_tokens)
            n_out += len(kept)
            full = text.push(kept, final=reason is not None)
            matched: int | str | None = kept[-1] if reason == "stop" else None
            # A stop string can only end past what was yielded (the hold-back guarantees it).
            hit, string = min(((i, s) for s in stop if (i := full.find(s, max(0, emitted - len(s)))) >= 0),
                              default=(-1, None))
            end = len(full)
            if hit >= 0:
                end, reason, matched = hit, "stop", string
            elif reason is None:  # hold back what may still become a stop string
                end = max(emitted, end - holdback)
            if rnd is not None:
                rnd.committed = len(kept)
                stats.rounds.append(rnd)
            delta, emitted = full[emitted:end], max(emitted, end)
            yield Step(kept, delta, rnd, stats, reason, matched)
            if reason:
                return
            new, rnd = decoder.step()

    def generate(self, prompt: str | list[int], **kwargs) -> Generation:
        steps = list(self.stream(prompt, **kwargs))
        ids = [t for s in steps for t in s.token_ids]
        text = "".join(s.text for s in steps)
        last = steps[-1]
        return Generation(text, ids, last.finish_reason, last.stats.prompt_tokens, last.stats)


def _truncate(new: list[int], n_out: int, eos: tuple[int, ...], max_new: int,
              min_tokens: int) -> tuple[list[int], str | None]:
    """The committed tokens to keep, up to the first EOS (past min_tokens) or the length limit."""
    for i, tok in enumerate(new):
        n = n_out + i + 1
        if tok in eos and n > min_tokens:
            return new[:i + 1], "stop"
        if n == max_new:
            return new[:i + 1], "length"
    return new, None


class IncrementalText:
    """Detokenize a short window per step; re-decoding everything would cost O(length) each round."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending: list[int] = []  # ids whose text may still be an incomplete UTF-8 character
        self.text = ""

    def push(self, ids: list[int], final: bool = False) -> str:
        """Add ids; return the whole text so far, minus a trailing incomplete UTF-8 character."""
        self.pending += ids
        piece = self.tokenizer.decode(self.pending, skip_special_tokens=True)
        if final or not piece.endswith("\ufffd"):
            self.text += piece
            self.pending = []
        return self.text
