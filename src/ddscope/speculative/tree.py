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
    ranks: list[int] = field(default_factory=list)     # grow only: rank of the node's token among its siblings'
    logps: list[float] = field(default_factory=list)   # grow only: the drafter's log-p of each node's token

    def prefix(self, size: int) -> "DraftTree":
        """The first `size` draft nodes: a valid tree, since parents precede children."""
        n = size + 1
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.scores[:n], self.ranks[:n],
                         self.logps[:n])

    def keep(self, nodes: list[int]) -> "DraftTree":
        """The tree of `nodes` (ascending, the root first, each one's parent among them), renumbered."""
        new = {old: i for i, old in enumerate(nodes)}
        pick = lambda xs: [xs[i] for i in nodes] if xs else []
        return DraftTree(pick(self.tokens), [new.get(self.parents[i], -1) for i in nodes], pick(self.depths),
                         pick(self.scores), pick(self.ranks), pick(self.logps))

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

    def path(self, node: int) -> list[int]:
        """The node's tokens below the root, its own last (the root's is empty)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

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
                    self.logps.append(float("-inf"))
            path.add(child)
            node = child
        return path

    def walk(self, choose: Callable[[int], int]) -> list[int]:
        """Node indices of the accepted path: follow the child matching the target's choice at each node,
        `choose(node)`, asked of the path's nodes only."""
        children = self._children()
        path = [0]
        while (nxt := children.get((path[-1], choose(path[-1])))) is not None:
            path.append(nxt)
        return path


def root_only(root: int) -> DraftTree:
    return DraftTree([root], [-1], [0])


def chain(root: int, tokens: list[int]) -> DraftTree:
    n = len(tokens)
    return DraftTree([root, *tokens], list(range(-1, n)), list(range(n + 1)))


Children = Callable[["DraftTree", int], tuple[list[float], list[int]]]  # node -> (log-ps, tokens), rank order
Score = Callable[[int, list[float], int], float]  # (node depth, its candidates' log-ps, rank) -> log-score of the rank
Steer = Callable[[torch.Tensor, int], Children]  # (drafter log-probs, k) -> each node's k candidates (a grammar's)


def top_k(logprobs: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Each depth's `k` best log-probs and their token ids, in rank order."""
    vals, idx = torch.topk(logprobs.float(), min(k, logprobs.shape[1]), dim=-1)
    return vals.tolist(), idx.tolist()


def per_depth(logprobs: torch.Tensor, k: int) -> Children:
    """Every node at depth d draws from the drafter's `k` best at d (DFlash's block: depths are independent)."""
    vals, idx = top_k(logprobs, k)
    return lambda tree, node: (vals[tree.depths[node]], idx[tree.depths[node]])


def best_first(root: int, logprobs: torch.Tensor, budget: int, children: Children | None = None) -> DraftTree:
    """The `budget` highest-scoring prefixes, score = sum of per-depth log-probs."""
    return grow(root, budget, logprobs.shape[0], children or per_depth(logprobs, budget), lambda d, vals, r: vals[r])


def greedy_chain(root: int, depth: int, children: Children) -> DraftTree:
    """Each depth's best candidate under its parent: DFlash's chain (under a grammar, the best legal one)."""
    tree = root_only(root)
    for last in range(depth):
        _, tokens = children(tree, last)
        if not tokens:
            break
        tree.tokens.append(tokens[0])
        tree.parents.append(last)
        tree.depths.append(last + 1)
    return tree


def grow(root: int, budget: int, depth_max: int, children: Children, score: Score,
         enough: Callable[[float], bool] | None = None) -> DraftTree:
    """Best-first tree of `budget` nodes: a node's children are `children(tree, node)`, in rank order, each
    scored `score(depth, candidates, rank)` on top of its parent's score. `enough`, told each node's score as it
    is added, may stop the growth sooner (the node it stops at asks for no children).

    A pop of a node can only be followed by its next sibling or its own first child, so the heap never holds
    more than B+1 items, and `score` is asked for only the candidates the heap reaches.
    """
    tree = root_only(root)
    tree.scores.append(0.0)
    tree.ranks.append(0)
    tree.logps.append(0.0)
    lists = [children(tree, 0)] if depth_max else [([], [])]
    heap: list[tuple[float, int, int, int]] = []  # (-score, depth, rank, parent)

    def offer(parent: int, rank: int) -> None:
        vals, tokens = lists[parent]
        if rank < len(tokens):
            depth = tree.depths[parent]
            heapq.heappush(heap, (-(tree.scores[parent] + score(depth, vals, rank)), depth + 1, rank, parent))

    offer(0, 0)
    while heap and tree.size < budget:
        neg, depth, rank, parent = heapq.heappop(heap)
        tree.tokens.append(lists[parent][1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(-neg)
        tree.ranks.append(rank)
        tree.logps.append(lists[parent][0][rank])
        if tree.size == budget or (enough is not None and enough(-neg)):  # the last node's children: never asked
            break
        offer(parent, rank + 1)
        lists.append(children(tree, tree.size) if depth < depth_max else ([], []))
        offer(tree.size, 0)
    return tree
