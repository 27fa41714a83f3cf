"""Per-round and per-generation instrumentation, serialisable to JSON.

The first completion token comes from the prefill, not from a verify round; every later one is
committed by a round. So committed_tokens = completion_tokens - 1 and avg_commit = committed_tokens /
verify_steps, which is vLLM's delivered (completion_tokens - 1) / num_drafts.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

PHASES = ("draft", "tree", "verify", "commit")


@dataclass
class RoundStats:
    ctx_len: int     # committed context (cache length) at the start of the round
    nodes: int       # draft nodes verified, root excluded
    committed: int   # tokens committed, bonus included
    draft_ms: float = 0.0
    tree_ms: float = 0.0
    verify_ms: float = 0.0
    commit_ms: float = 0.0
    model_ms: float = 0.0  # inside drafter and target forwards; the rest of step_ms is engine overhead
    drafted: bool = False  # the drafter ran (`auto` may verify the root and a prompt-lookup branch alone)
    batch: int = 1  # sequences in the step (its times are the whole batch's)
    grammar_masks: int = 0  # structured outputs: distinct token masks this round built (tree and verify share them)
    grammar_fills: int = 0  # and the backend's fills they came from (one per node whose state was read)
    grammar_ms: float = 0.0  # and the time in the matcher and masking, within tree_ms and commit_ms
    # A plain round's root under the sampler's law: its 4 likeliest tokens' probabilities, when `auto` asked for
    # them (what a drafter that knew the target could have had accepted at each depth).
    law_top: list[float] | None = None

    @property
    def step_ms(self) -> float:
        return self.draft_ms + self.tree_ms + self.verify_ms + self.commit_ms


@dataclass
class GenerationStats:
    method: str
    budget: int | str | None
    prompt_tokens: int
    prefill_ms: float = 0.0
    from_prefill: int = 0  # completion tokens chosen from the prefill's logits: 1 once it ran, 0 before
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (not prefilled)
    prefill_threads: int = 0  # torch threads the prefill ran on (ddscope.engine.threads)
    rounds: list[RoundStats] = field(default_factory=list)

    @property
    def verify_steps(self) -> int:
        return len(self.rounds)

    @property
    def committed_tokens(self) -> int:
        """Tokens committed by verify rounds: every completion token but the prefill's."""
        return sum(r.committed for r in self.rounds)

    @property
    def completion_tokens(self) -> int:
        return self.from_prefill + self.committed_tokens

    @property
    def decode_s(self) -> float:
        return sum(r.step_ms for r in self.rounds) / 1000

    def to_dict(self, rounds: bool = True) -> dict:
        steps, committed, decode_s = self.verify_steps, self.committed_tokens, self.decode_s
        out = {
            "method": self.method,
            "budget": self.budget,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "verify_steps": steps,
            "committed_tokens": committed,
            "avg_commit": committed / steps if steps else 0.0,
            "commit_histogram": {str(k): v for k, v in sorted(Counter(r.committed for r in self.rounds).items())},
            "nodes_verified": sum(r.nodes for r in self.rounds),
            "drafted_steps": sum(r.drafted for r in self.rounds),
            "mean_step_ms": 1000 * decode_s / steps if steps else 0.0,
            "phase_ms": {p: sum(getattr(r, f"{p}_ms") for r in self.rounds) for p in PHASES},
            "model_ms": sum(r.model_ms for r in self.rounds),
            "grammar_masks": sum(r.grammar_masks for r in self.rounds),
            "grammar_fills": sum(r.grammar_fills for r in self.rounds),
            "grammar_ms": sum(r.grammar_ms for r in self.rounds),
            "prefill_ms": self.prefill_ms,
            "prefill_threads": self.prefill_threads,
            "decode_s": decode_s,
            "decode_tok_per_s": committed / decode_s if decode_s else 0.0,
        }
        if rounds:
            out["rounds"] = [asdict(r) for r in self.rounds]
        return out
