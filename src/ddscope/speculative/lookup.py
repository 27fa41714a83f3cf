"""Prompt lookup: a draft copied from the text itself, for the loops a drafter cannot see.

Deep in a long context the demo target repeats itself (`\"\"\"\\n    \"\"\"\\n    ...` on code), and a
small block drafter, unsure of the phase, drafts such a cycle about one token right per step. The
continuation of the last n-gram's latest earlier occurrence drafts it exactly, at no model cost. It is
one more branch of the tree the target verifies, so outputs are unchanged (as prompt-lookup and
n-gram speculation in vLLM and SGLang).
"""
from __future__ import annotations

LOOKUP_MAX = 15  # longest branch: a DFlash block's worth


class Lookup:
    """An index of the n-grams of a growing token list: each to where it last ended."""

    def __init__(self, n: int = 3):
        self.n = n
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end index of its latest indexed occurrence
        self.indexed = 0  # n-grams ending before this index are in `ends`

    def propose(self, tokens: list[int], length: int) -> list[int]:
        """Up to `length` tokens that followed the last n-gram where it occurred before; [] if it never did.
        The copy may run into the text it copies (a cycle shorter than `length` repeats)."""
        self._index(tokens)
        start = self.ends.get(tuple(tokens[-self.n:])) if len(tokens) >= self.n else None
        if start is None:
            return []
        out: list[int] = []
        for k in range(length):
            src = start + k
            out.append(tokens[src] if src < len(tokens) else out[src - len(tokens)])
        return out

    def _index(self, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (the last one is the query, not a match)."""
        for end in range(max(self.indexed, self.n), len(tokens)):
            self.ends[tuple(tokens[end - self.n:end])] = end
        self.indexed = max(self.indexed, len(tokens))
