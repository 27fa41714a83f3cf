"""Draft trees: best-first DDTree construction, the chain and root-only special cases, and the walk.

Node 0 is the root (the previous bonus token, already committed); every parent index is smaller
than its children's, so masks and walks can go in index order.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int]   # [root, n1..nB]
    parents: list[int]  # parents[0] == -1
    depths: list[int]   # depths[0] == 0
    scores: list[float] = field(default_factory=list)  # grow only: log-score of each node's prefix
    ranks: list[int] = field(default_factory=list)     # grow only: rank of the node's token at its depth

    def prefix(self, size: int) -> "DraftTree":
        """The first `size` draft nodes: a valid tree, since parents precede children."""
        n = size + 1
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.scores[:n], self.ranks[:n])

    @property
    def size(self) -> int:
        """Draft nodes, the root excluded."""
        return len(self.tokens) - 1

    def visibility(self) -> torch.Tensor:
        """Boolean [n, n]: row i is True exactly on i's ancestors and i itself."""
        n = len(self.tokens)
        parents = torch.tensor([max(p, 0) for p in self.parents])
        vis = torch.zeros(n, n, dtype=torch.bool)
        rows, node = torch.arange(n), torch.arange(n)
        for _ in range(max(self.depths) + 1):  # climb one level per pass, all nodes at once
            vis[rows, node] = True
            node = parents[node]
        return vis

    def paths(self) -> list[list[int]]:
        """Each node's tokens below the root, down to and including its own (the root's is empty)."""
        out: list[list[int]] = [[]]
        for i in range(1, len(self.tokens)):
            out.append(out[self.parents[i]] + [self.tokens[i]])
        return out

    def _children(self) -> dict[tuple[int, int], int]:
        """(parent, token) -> node: tokens are unique among siblings."""
        return {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens)) if i}

    def graft(self, tokens: list[int]) -> set[int]:
        """Add `tokens` as a path under the root, through the nodes that already spell its start; return
        the path's nodes (tokens past the end of the tree's own are new leaves)."""
        children = self._children()
        node, path = 0, set()
        for token in tokens:
            child = children.get((node, token))
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                if self.scores:  # grown trees keep these per node; a grafted node has no drafter score
                    self.scores.append(float("-inf"))
                    self.ranks.append(-1)
            path.add(child)
            node = child
        return path

    def walk(self, choices: list[int]) -> list[int]:
        """Node indices of the accepted path: follow the child matching the target's choice."""
        children = self._children()
        path = [0]
        while (nxt := children.get((path[-1], choices[path[-1]]))) is not None:
            path.append(nxt)
        return path


def root_only(root: int) -> DraftTree:
    return DraftTree([root], [-1], [0])


def chain(root: int, tokens: list[int]) -> DraftTree:
    n = len(tokens)
    return DraftTree([root, *tokens], list(range(-1, n)), list(range(n + 1)))


Score = Callable[[int, int], float]  # (depth index, rank) -> the token's log-score, non-increasing in rank


def top_k(logprobs: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Each depth's `k` best log-probs and their token ids, in rank order."""
    vals, idx = torch.topk(logprobs.float(), min(k, logprobs.shape[1]), dim=-1)
    return vals.tolist(), idx.tolist()


def best_first(root: int, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """The `budget` highest-scoring prefixes, score = sum of per-depth log-probs."""
    vals, idx = top_k(logprobs, budget)
    return grow(root, idx, budget, lambda d, r: vals[d][r])


def grow(root: int, idx: list[list[int]], budget: int, score: Score) -> DraftTree:
    """Best-first tree over per-depth candidates `idx` [depths][k], scored by `score`.

    Depths are treated as independent, so a pop of (depth d, rank r) can only be followed by its
    next sibling (d, r+1) or its first child (d+1, 0): the heap never holds more than B+1 items,
    and `score` is asked for only the candidates the heap reaches.
    """
    depth_max, k = len(idx), len(idx[0])
    tree = root_only(root)
    tree.scores.append(0.0)
    tree.ranks.append(0)
    heap = [(-score(0, 0), 1, 0, 0, 0.0)]  # (-score, depth, rank, parent, parent score)
    while heap and tree.size < budget:
        neg, depth, rank, parent, parent_score = heapq.heappop(heap)
        node = len(tree.tokens)
        tree.tokens.append(idx[depth - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(-neg)
        tree.ranks.append(rank)
        if rank + 1 < k:
            heapq.heappush(heap, (-(parent_score + score(depth - 1, rank + 1)), depth, rank + 1, parent, parent_score))
        if depth < depth_max:
            heapq.heappush(heap, (neg - score(depth, 0), depth + 1, 0, node, -neg))
    return tree
