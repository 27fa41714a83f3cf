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
from ddscope.decoding import Decoder, Law
from ddscope.drafter import Drafter
from ddscope.hf_target import HFTarget, load_target
from ddscope.lookup import LOOKUP_MAX
from ddscope.model import Target
from ddscope.prefix_cache import PrefixCache
from ddscope.proposers import AR, DDTree, DFlash, Proposer
from ddscope.sampling import SamplingParams, TokenLogprob
from ddscope.stats import GenerationStats, RoundStats
from ddscope.threads import prefill_threads, torch_threads

DEMO_DIR = Path(__file__).parent / "assets" / "demo"
METHODS = ("ar", "dflash", "ddtree")
DTYPES = ("float32", "bfloat16", "float16")
MAX_BUDGET = 512
PREFIX_CACHE_MB = 512  # default prefix-cache budget: the demo pair's K/V is 6 KiB a token
# Bounds on a request's extras: every completed token rescans the held-back text for each stop string.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs


@dataclass
class Step:
    token_ids: list[int]
    text: str
    round: RoundStats | None  # None for the first token, which the prefill chose
    stats: GenerationStats  # running totals of this generation, final on the last step
    finish_reason: str | None = None
    matched_stop: int | str | None = None  # on "stop": the EOS id, stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first Step, when asked for


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Engine:
    """Batch-1 engine; one generation at a time (the server serialises requests)."""

    def __init__(self, target: Target | HFTarget, drafter: Drafter | None, tokenizer, source: Path, max_model_len: int,
                 default_budget: int | str = 32, prefix_cache_mb: int = PREFIX_CACHE_MB,
                 prefill_threads: int | None = None):
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.prefill_threads = prefill_threads  # None: the idle CPUs at each prefill (ddscope.threads)
        self.source, self.model_name = str(source.resolve()), source.name
        self.max_model_len, self.default_budget = max_model_len, default_budget
        self.verify_cost: VerifyCost | None = None  # calibrated on first use of budget="auto"
        self.learned: dict[tuple, Learned] = {}  # auto's model of the pair, per sampler, across requests
        self.device = target.lm_head.weight.device
        self.cache = target.new_cache(max_model_len + MAX_BUDGET + LOOKUP_MAX + 1)  # + root, tree, lookup
        # + root and the longest path a round commits: a drafted block or a lookup branch, whichever is longer
        self.draft_cache = drafter.new_cache(max_model_len + 1 + LOOKUP_MAX) if drafter is not None else None
        self.eos_ids = eos_ids(source, tokenizer, target.cfg.eos_token_ids)
        # The native target's caches only: transformers' DynamicCache (HFTarget) is rebuilt per request.
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20) if isinstance(target, Target) else None

    @classmethod
    def load(cls, target: str | Path | None = None, drafter: str | Path | None = None, device: str = "cpu",
             dtype: str = "float32", max_model_len: int | None = None, target_backend: str = "auto",
             device_map: str | None = None, prefix_cache_mb: int = PREFIX_CACHE_MB,
             prefill_threads: int | None = None) -> "Engine":
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
        return cls(model, draft, tokenizer, target_dir, max_model_len or limit, prefix_cache_mb=prefix_cache_mb,
                   prefill_threads=prefill_threads)

    def with_drafter(self, drafter: str | Path) -> "Engine":
        """Another engine over this one's target (weights shared, caches its own), with another drafter:
        two drafters compared side by side in one process."""
        return Engine(self.target, Drafter.load(Path(drafter), self.target), self.tokenizer, Path(self.source),
                      self.max_model_len, self.default_budget, prefill_threads=self.prefill_threads)

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

    def check(self, method: str, budget: int | str | None) -> None:
        """Raise ValueError unless `method` and `budget` can be served; touches no state (any thread)."""
        if method not in self.methods:
            raise ValueError(f"unknown or unavailable method {method!r}; available: {', '.join(self.methods)}")
        budget = self.default_budget if budget is None else budget
        if method == "ddtree" and budget != "auto" and (
                not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= MAX_BUDGET):
            raise ValueError(f"budget must be an integer in [1, {MAX_BUDGET}] or 'auto', got {budget!r}")

    def calibrate(self) -> None:
        """Time the verify cost `auto` needs (or read it from the cache on disk), now rather than at the first
        `auto` request: a server calls this on its load thread, before it serves anything."""
        if self.drafter is not None and self.verify_cost is None:
            self.verify_cost = VerifyCost.cached(self.target, self.max_model_len, self.source)

    def proposer(self, method: str, budget: int | str | None, sampling: SamplingParams = SamplingParams(),
                 lookup: bool = True) -> Proposer:
        """A fresh proposer; `lookup=False` leaves the prompt-lookup branch out of `ddtree` (the drafter alone)."""
        self.check(method, budget)
        if method == "ar":
            return AR()
        if method == "dflash":
            return DFlash()
        budget = self.default_budget if budget is None else budget
        if budget == "auto":
            self.calibrate()
            return DDTree(AutoBudget(self.verify_cost, self._learned(sampling, lookup),
                                     block=self.drafter.block_size), lookup)
        return DDTree(budget, lookup)

    def _learned(self, sampling: SamplingParams, lookup: bool) -> Learned:
        """What `auto` learned under this sampler, with or without lookup, kept across requests (the 16 latest)."""
        key = (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, lookup)
        if key not in self.learned and len(self.learned) >= 16:
            del self.learned[next(iter(self.learned))]
        return self.learned.setdefault(key, Learned())

    def stream(self, prompt: str | list[int], *, max_new_tokens: int = 128, method: str = "ddtree",
               budget: int | str | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               min_p: float = 0.0, seed: int | None = None, ignore_eos: bool = False, min_tokens: int = 0,
               stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
               logit_bias: dict[int, float] | None = None, logprobs: int | None = None,
               prompt_logprobs: int | None = None, lookup: bool = True) -> Iterator[Step]:
        """Validate now, then yield the prefill's token as the first Step (prefill runs at the first `next`)
        and one Step per verify round after it.

        `stop_token_ids` end a generation as EOS does (kept, and their text with them, as vLLM), also under
        `ignore_eos`; `logit_bias` is added to the target's logits at every node; `logprobs` (top N >= 0)
        puts each token's log-prob on its Step, `prompt_logprobs` each prompt token's on the first Step
        (the prompt is then run in full, prefix cache or not). `lookup=False` leaves the prompt-lookup branch
        out of `ddtree` trees (the drafter alone). Closing the iterator cancels generation at the next round.
        """
        ids = self.encode(prompt)
        self._validate(len(ids), max_new_tokens, min_tokens, stop, stop_token_ids, logit_bias, logprobs,
                       prompt_logprobs)
        sampling = SamplingParams(temperature, top_p, top_k, seed, min_p)
        proposer = self.proposer(method, budget, sampling, lookup)
        generator = torch.Generator(self.device).manual_seed(seed if seed is not None else random.getrandbits(63))
        eos = () if ignore_eos else tuple(self.eos_ids)
        stops = tuple(stop_token_ids or ())
        law = Law(dict(logit_bias or {}), eos + stops, min_tokens)
        decoder = Decoder(self.target, self.drafter, proposer, self.cache, self.draft_cache, sampling, generator,
                          law, logprobs)
        stats = GenerationStats(method, getattr(proposer, "budget", None), len(ids))
        completion = Completion(self.tokenizer, eos, max_new_tokens, min_tokens, stop or [], stops)
        return self._rounds(decoder, ids, stats, completion, prompt_logprobs)

    def _validate(self, prompt_len: int, max_new_tokens: int, min_tokens: int, stop: list[str] | None,
                  stop_token_ids: list[int] | None, logit_bias: dict[int, float] | None, logprobs: int | None,
                  prompt_logprobs: int | None) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if prompt_len + max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        if not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_new_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_new_tokens], got {min_tokens!r}")
        if stop is not None and not (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS
                                     and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
            raise ValueError(f"stop must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters, got {stop!r:.200}")
        for name, ids in (("stop_token_ids", stop_token_ids), ("logit_bias", logit_bias)):
            if ids and not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                               for t in ids):
                raise ValueError(f"{name}: token ids must be integers in [0, {self.vocab_size})")
        if logit_bias and not all(isinstance(b, (int, float)) and -100 <= b <= 100 for b in logit_bias.values()):
            raise ValueError("logit_bias values must be numbers in [-100, 100]")
        for name, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if n is not None and not (isinstance(n, int) and 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")

    def _rounds(self, decoder: Decoder, prompt: list[int], stats: GenerationStats, completion: Completion,
                prompt_logprobs: int | None) -> Iterator[Step]:
        features = self.draft_cache.features if decoder.capture else None
        reach = decoder.first_draft_reach(len(prompt)) if decoder.capture else 0
        scored = prompt_logprobs is not None  # every prompt position's logits: nothing may come from the cache
        cached = self.prefix_cache.load(prompt, self.cache, features, reach) if self.prefix_cache and not scored else 0
        stats.prefill_threads = prefill_threads(len(prompt) - cached, self.prefill_threads)
        with torch_threads(stats.prefill_threads):
            first, stats.prefill_ms = decoder.prefill(prompt, cached, prompt_logprobs)
        stats.from_prefill, stats.cached_tokens = 1, cached
        new, rnd = [first], None  # the prefill's token is yielded on its own, before any verify round
        while True:
            done = completion.count
            kept = completion.extend(new)
            if rnd is not None:
                rnd.committed = len(kept)
                stats.rounds.append(rnd)
            if completion.finish_reason and self.prefix_cache:  # the caches hold what the tokens say
                self.prefix_cache.save(decoder.tokens, self.cache, features, decoder.features_from)
            logprobs = decoder.logprobs[done:done + len(kept)] if decoder.top_logprobs is not None else None
            yield Step(kept, completion.release(), rnd, stats, completion.finish_reason, completion.matched_stop,
                       logprobs, decoder.prompt_logprobs if rnd is None and scored else None)
            if completion.finish_reason:
                return
            new, rnd = decoder.step()

    def generate(self, prompt: str | list[int], **kwargs) -> Generation:
        steps = list(self.stream(prompt, **kwargs))
        ids = [t for s in steps for t in s.token_ids]
        text = "".join(s.text for s in steps)
        last = steps[-1]
        logprobs = [lp for s in steps for lp in s.logprobs] if last.logprobs is not None else None
        return Generation(text, ids, last.finish_reason, last.stats.prompt_tokens, last.stats, logprobs,
                          steps[0].prompt_logprobs)


class Completion:
    """The tokens and text so far, grown one token at a time through the EOS, stop-string and length checks.

    A verify round commits several tokens at once; feeding them one by one makes the result (tokens,
    text, finish reason) exactly what `ar` gives, wherever the round boundaries fall. The rules are
    vLLM v1's: EOS ends it and adds no text; a stop string must end in the text of a token past
    min_tokens; it ends the tokens at the one that completes it and the text before it; when one token
    completes several, the one that ends first wins, then list order.
    """

    def __init__(self, tokenizer, eos: list[int] | tuple[int, ...], max_new: int, min_tokens: int, stop: list[str],
                 stop_ids: tuple[int, ...] = ()):
        self.text = IncrementalText(tokenizer)
        self.eos, self.max_new, self.min_tokens, self.stop = set(eos), max_new, min_tokens, stop
        self.stop_ids = set(stop_ids) - self.eos
        self.count = 0  # tokens kept
        self.cut: int | None = None  # the text's end once a stop string matched
        self.released = 0  # characters handed out
        self.holdback = max((len(s) for s in stop), default=1) - 1  # what may yet begin a stop string
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None

    def extend(self, tokens: list[int]) -> list[int]:
        """Add tokens up to and including the one that ends the generation; return those kept."""
        for i, token in enumerate(tokens):
            self._add(token)
            if self.finish_reason:
                return tokens[:i + 1]
        return tokens

    def release(self) -> str:
        """The text not yet handed out that no later token can take back."""
        if self.finish_reason:
            end = len(self.text.text) if self.cut is None else self.cut
        else:
            end = max(self.released, len(self.text.text) - self.holdback)
        delta = self.text.text[self.released:end]
        self.released = end
        return delta

    def _add(self, token: int) -> None:
        self.count += 1
        if token in self.eos:  # the decoder masks EOS before min_tokens
            self._finish("stop", token)
            return
        old = len(self.text.text)
        text = self.text.push(token)
        hit = first_stop(text, old, self.stop) if self.count > self.min_tokens else None
        if token in self.stop_ids and hit is None:  # the decoder masks these before min_tokens too
            self._finish("stop", token)
        elif hit is not None:
            self.cut, string = hit
            self._finish("stop", string)
        elif self.count == self.max_new:
            self._finish("length", None)

    def _finish(self, reason: str, matched: int | str | None) -> None:
        self.finish_reason, self.matched_stop = reason, matched
        if self.cut is None:
            self.text.flush()


def first_stop(text: str, old: int, stop: list[str]) -> tuple[int, str] | None:
    """(start, string) of the stop string that ends first past `old`; ties go to list order."""
    hits = [(i + len(s), k, i, s) for k, s in enumerate(stop) if (i := text.find(s, max(0, old - len(s) + 1))) >= 0]
    if not hits:
        return None
    _, _, start, string = min(hits)
    return start, string


class IncrementalText:
    """Detokenize a few ids per token; re-decoding everything would cost O(length) each time.

    New text = decode(ids[prefix:]) minus decode(ids[prefix:read]), as vLLM and TGI do: the previous
    token gives context to tokenizers that drop a leading space at the start of a decode, and text
    ending in an incomplete UTF-8 character waits for the tokens that complete it.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""

    def push(self, token: int) -> str:
        """Add a token; return the whole text so far, minus a trailing incomplete UTF-8 character."""
        self.ids.append(token)
        self._decode(final=False)
        return self.text

    def flush(self) -> None:
        """The end: take what is held back, incomplete character and all."""
        if self.read < len(self.ids):
            self._decode(final=True)

    def _decode(self, final: bool) -> None:
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if final or (len(after) > len(before) and not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
