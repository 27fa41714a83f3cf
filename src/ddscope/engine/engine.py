"""The public engine: load a target (and drafter), then generate with `ar`, `dflash` or `ddtree`."""
from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ddscope.config import CheckpointError, eos_ids
from ddscope.engine.block_manager import sized_pool
from ddscope.engine.limits import DEMO_DIR, DTYPES, MAX_BUDGET, METHODS, EngineConfig
from ddscope.engine.request import Bounds, Request
from ddscope.engine.runner import Runner, StepReport
from ddscope.engine.scheduler import Scheduler
from ddscope.engine.sequence import Sequence, Step
from ddscope.models import native
from ddscope.models.drafter import Drafter
from ddscope.models.hf_target import HFTarget, load_target
from ddscope.models.kv_pool import Pages
from ddscope.models.pages import keep_freed
from ddscope.models.target import Target
from ddscope.policy.auto import AutoBudget
from ddscope.policy.batch import BatchBudget
from ddscope.policy.cost import VerifyCost
from ddscope.policy.learn import LearnedBySampler
from ddscope.speculative.completion import Completion
from ddscope.speculative.decoder import Decoder
from ddscope.structured.backend import Compiled
from ddscope.structured.compiler import Grammars
from ddscope.structured.walk import GrammarState
from ddscope.speculative.law import Law, bad_word_ids
from ddscope.speculative.lookup import LOOKUP_MAX
from ddscope.speculative.proposers import AR, DDTree, DFlash, Proposer
from ddscope.speculative.sampling import SamplingParams, TokenLogprob
from ddscope.speculative.stats import GenerationStats


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
    """The engine: sequences added at any time are decoded together, one batched step at a time
    (ddscope.engine.scheduler, ddscope.engine.runner); `stream` and `generate` follow one of them."""

    def __init__(self, target: Target | HFTarget, drafter: Drafter | None, tokenizer, source: Path,
                 config: EngineConfig | None = None, **knobs: Any):
        """`config`, or `knobs` (EngineConfig's fields) over it."""
        keep_freed()  # a step's activations: reused, not faulted in again from Linux
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.source, self.model_name = str(source.resolve()), source.name
        self.config = config = EngineConfig.of(config, **knobs)
        self.max_model_len = config.max_model_len or target.cfg.max_position_embeddings
        self.verify_cost: VerifyCost | None = None  # calibrated on first use of budget="auto"
        self.learned = LearnedBySampler()  # auto's model of the pair, across requests
        self.device = target.lm_head.weight.device
        self.eos_ids = eos_ids(source, tokenizer, target.cfg.eos_token_ids)
        self.pool, blocks = (sized_pool(target, drafter, self.max_model_len, config.kv_cache_mb, config.prefix_cache,
                                        config.max_num_seqs) if isinstance(target, Target) else (None, None))
        self.scheduler = Scheduler(blocks, config.max_num_seqs, config.max_prefill_tokens)
        self.runner = Runner(target, drafter, config.prefill_threads)
        self.grammars = Grammars(tokenizer, target.cfg.vocab_size, list(self.eos_ids))  # structured outputs
        self.bounds = Bounds(self.methods, self.max_model_len, self.vocab_size, config.budget)

    @classmethod
    def load(cls, target: str | Path | None = None, drafter: str | Path | None = None, device: str = "cpu",
             dtype: str = "float32", target_backend: str = "auto", device_map: str | None = None,
             config: EngineConfig | None = None, **knobs: Any) -> "Engine":
        """`target_backend`: native Qwen3/Llama where it applies (auto), or transformers for any other causal LM
        (ddscope.models.hf_target); `device_map` (transformers) shards a target over several GPUs. `config`, or
        `knobs` (EngineConfig's fields) over it: the engine's."""
        config = EngineConfig.of(config, **knobs)
        if target is None:
            target, drafter = DEMO_DIR / "target", drafter or DEMO_DIR / "drafter"
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        cpu = torch.device(device).type == "cpu"
        if cpu and (why := native.inexact(getattr(torch, dtype))):
            raise ValueError(why)
        target_dir = Path(target)
        if not target_dir.is_dir():
            raise CheckpointError(f"target checkpoint directory not found: {target_dir}")
        model = load_target(target_dir, torch.device(device), getattr(torch, dtype), target_backend, device_map)
        if cpu and dtype != "float32" and not (isinstance(model, Target) and model.panelled()):
            raise ValueError(f"{dtype} on the CPU needs every product of the target on kernels.c's panels, and this "
                             "one has some on torch's (transformers' backend, or a weight not of whole panels), "
                             "which give a row other bits among other rows: speculation would not be lossless. "
                             "Use float32.")
        draft = Drafter.load(Path(drafter), model) if drafter is not None else None
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{target_dir}: no usable tokenizer ({e})") from e
        limit = model.cfg.max_position_embeddings
        if config.max_model_len is not None and not 1 < config.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}], got {config.max_model_len}")
        return cls(model, draft, tokenizer, target_dir, config)

    def with_drafter(self, drafter: str | Path) -> "Engine":  # weights shared, caches its own: drafters side by side
        return Engine(self.target, Drafter.load(Path(drafter), self.target), self.tokenizer, Path(self.source),
                      self.config, max_model_len=self.max_model_len)

    @property
    def methods(self) -> tuple[str, ...]:
        return METHODS if self.drafter is not None else ("ar",)

    @property
    def vocab_size(self) -> int:
        return self.target.cfg.vocab_size

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False, verbose=False)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def calibrate(self) -> None:
        """Time the verify cost `auto` needs (or read it from disk) now: a server's load thread, before serving."""
        if self.drafter is not None and self.verify_cost is None:
            self.verify_cost = VerifyCost.cached(self.target, self.max_model_len, self.source)
            self.runner.budget = BatchBudget(self.verify_cost)

    def proposer(self, method: str, budget: int | str, sampling: SamplingParams = SamplingParams(),
                 lookup: bool = True, steered: bool = False) -> Proposer:
        """A fresh proposer for a checked method and budget (Request.resolved); `lookup=False` leaves the
        prompt-lookup branch out of `ddtree` (the drafter alone); `steered`: a grammar grows the tree, so `auto`
        learns apart from free text (a forced token is certain, and a node costs its grammar work)."""
        if method == "ar":
            return AR()
        if method == "dflash":
            return DFlash()
        if budget == "auto":
            self.calibrate()
            return DDTree(AutoBudget(self.verify_cost, self.learned.under(sampling, lookup, steered),
                                     block=self.drafter.block_size, reach=self.drafter.horizon), lookup)
        return DDTree(budget, lookup)

    def stream(self, prompt: str | list[int], request: Request | None = None, **fields: Any) -> Iterator[Step]:
        """`follow(sequence(prompt, request, **fields))`: validate now (ValueError), then yield the prefill's token
        as the first Step (the sequence joins the batch at the first `next`) and one Step per verify round after
        it. Other sequences in the engine (other streams, `add`ed ones) advance in the same steps. Closing the
        iterator cancels generation at the next step."""
        return self.follow(self.sequence(prompt, request, **fields))

    def compiled(self, r: Request) -> Compiled:
        """The request's grammar: compiled already where the server compiled it before admission, else now (a
        library caller's thread)."""
        return r.constraint if isinstance(r.constraint, Compiled) else self.grammars.compile(r.constraint)

    def sequence(self, prompt: str | list[int], request: Request | None = None, **fields: Any) -> Sequence:
        """`request`, or `fields` (Request's) over it, validated and not yet added: RequestError (a ValueError
        naming the field) on bad input."""
        ids = self.encode(prompt)
        r = Request.of(request, **fields).resolved(self.bounds, len(ids))
        eos = () if r.ignore_eos else tuple(self.eos_ids)
        stops = tuple(r.stop_token_ids or ())
        law = Law(dict(r.logit_bias or {}), eos + stops, r.min_tokens,
                  tuple(r.allowed_token_ids) if r.allowed_token_ids is not None else None,
                  bad_word_ids(self.tokenizer, r.bad_words or [], self.vocab_size), r.repetition_penalty,
                  r.frequency_penalty, r.presence_penalty)
        sampling = SamplingParams.of(r)
        proposer = self.proposer(r.method, r.budget, sampling, r.lookup, bool(r.constraint) and r.steer)
        generator = torch.Generator(self.device).manual_seed(r.seed if r.seed is not None else random.getrandbits(63))
        pages = Pages(device=self.device, salt=r.cache_salt)
        grammar = GrammarState(self.compiled(r), self.vocab_size, r.steer) if r.constraint else None
        decoder = Decoder(self.target, self.drafter, proposer, sampling, generator, law, r.logprobs, grammar)
        stats = GenerationStats(r.method, getattr(proposer, "budget", None), len(ids))
        completion = Completion(self.tokenizer, eos, r.max_new_tokens, r.min_tokens, list(r.stop or []), stops,
                                r.include_stop_str_in_output, r.skip_special_tokens, r.spaces_between_special_tokens)
        seq = Sequence(ids, decoder, completion, stats, pages, r.prompt_logprobs, r.priority)
        seq.caches = lambda: self._caches(pages, len(ids) + r.max_new_tokens)
        if self.pool is not None:  # views of its pages, which hold nothing until admission
            decoder.attach(*seq.caches())
        return seq

    def _caches(self, pages: Pages, length: int) -> tuple:
        """A sequence's target and drafter caches: its pages of the pool, or (transformers) its own, made only
        when it is admitted (Scheduler._admit): a queue holds no memory."""
        if self.pool is not None:
            return self.pool.target_cache(pages), self.pool.drafter_cache(pages) if self.drafter else None
        room = length + MAX_BUDGET + LOOKUP_MAX + 1  # + root, tree, lookup
        return self.target.new_cache(room), self.drafter.new_cache(room) if self.drafter else None

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; `step` advances it with the rest and puts its Steps in its outbox."""
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop `seq` wherever it is (a cancelled request); its blocks go back to the pool."""
        self.scheduler.finish(seq, keep=seq.error is None)

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def waiting(self) -> int:
        """Sequences added but not running (not admitted yet, or preempted)."""
        return len(self.scheduler.waiting)

    @property
    def preemptions(self) -> int:
        """Sequences preempted so far (their blocks taken back when the pool ran out)."""
        return self.scheduler.preemptions

    @property
    def max_drafts(self) -> int:
        """The most drafts one step can accept: a drafter block less its root, or a prompt-lookup branch."""
        return max(LOOKUP_MAX, self.drafter.block_size - 1 if self.drafter is not None else 0)

    @property
    def kv_usage(self) -> float:
        """The share of the pool's blocks that running sequences hold (0 without a pool)."""
        blocks = self.scheduler.blocks
        return blocks.used / blocks.blocks if blocks is not None else 0.0

    def step(self) -> StepReport:
        """One batched step over the sequences the scheduler picks; finished ones leave the batch."""
        batch = self.scheduler.schedule()
        report = self.runner.step(batch)
        for seq, error in report.failed:  # its cache rewound: it leaves, and offers no block to the prefix cache
            seq.error = error
            self.scheduler.finish(seq, keep=False)
        for seq in self.scheduler.running[:]:
            if seq.finished:
                self.scheduler.finish(seq)
            elif seq in batch.decodes or any(s is seq for s, _ in batch.prefills):
                self.scheduler.register(seq)
        return report

    def follow(self, seq: Sequence) -> Iterator[Step]:
        """Add `seq` (at the first `next`) and yield its Steps as the engine steps; closing stops it."""
        self.add(seq)
        try:
            while True:
                while not seq.outbox:
                    if seq.error is not None:
                        raise seq.error
                    if seq.finished:
                        return
                    self.step()
                step = seq.outbox.popleft()
                yield step
                if step.finish_reason:
                    return
        finally:
            if not seq.finished:
                self.abort(seq)

    def generate(self, prompt: str | list[int], request: Request | None = None, **fields: Any) -> Generation:
        steps = list(self.stream(prompt, request, **fields))
        ids = [t for s in steps for t in s.token_ids]
        text = "".join(s.text for s in steps)
        last = steps[-1]
        logprobs = [lp for s in steps for lp in s.logprobs] if last.logprobs is not None else None
        return Generation(text, ids, last.finish_reason, last.stats.prompt_tokens, last.stats, logprobs,
                          steps[0].prompt_logprobs)


def load_engine(args: argparse.Namespace, **kw: Any) -> Engine:
    """The engine named by the options of ddscope.util.options.add_model_args."""
    return Engine.load(args.target, args.drafter, device=args.device, dtype=args.dtype,
                       prefill_threads=args.prefill_threads, **kw)
