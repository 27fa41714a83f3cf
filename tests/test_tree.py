"""DDTree construction and walk: budget, ordering, depth, optimality, visibility."""
import itertools

import pytest
import torch

from ddscope.speculative.tree import best_first, chain


def random_logprobs(depth: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)).mul(2).log_softmax(-1)


def brute_force_scores(logprobs: torch.Tensor, budget: int) -> list[float]:
    """Scores of the top-`budget` prefixes among all prefixes of all depths."""
    depth, vocab = logprobs.shape
    scores = []
    for d in range(1, depth + 1):
        for prefix in itertools.product(range(vocab), repeat=d):
            scores.append(sum(logprobs[i, t].item() for i, t in enumerate(prefix)))
    return sorted(scores, reverse=True)[:budget]


def node_scores(tree, logprobs):
    scores = [0.0]
    for i in range(1, len(tree.tokens)):
        scores.append(scores[tree.parents[i]] + logprobs[tree.depths[i] - 1, tree.tokens[i]].item())
    return scores[1:]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("budget", [1, 3, 7, 20])
def test_tree_is_brute_force_top_b(seed, budget):
    lp = random_logprobs(3, 4, seed)
    tree = best_first(99, lp, budget)
    assert tree.size == min(budget, 4 + 16 + 64)
    assert tree.tokens[0] == 99 and tree.parents[0] == -1
    assert all(tree.parents[i] < i for i in range(1, len(tree.tokens)))
    assert all(1 <= d <= 3 for d in tree.depths[1:])
    assert all(tree.depths[i] == tree.depths[tree.parents[i]] + 1 for i in range(1, len(tree.tokens)))
    # distinct prefixes: no two siblings share a token
    assert len({(p, t) for p, t in zip(tree.parents[1:], tree.tokens[1:])}) == tree.size
    got = sorted(node_scores(tree, lp), reverse=True)
    assert got == pytest.approx(brute_force_scores(lp, budget), abs=1e-5)


def test_depth_bounded_by_block():
    lp = torch.full((4, 50), -10.0)
    lp[:, 0] = 0.0  # one overwhelming path: the tree must still stop at depth 4
    tree = best_first(0, lp, 30)
    assert max(tree.depths) == 4 and tree.size == 30


@pytest.mark.parametrize("seed", range(5))
def test_visibility_is_ancestor_closure(seed):
    tree = best_first(0, random_logprobs(5, 6, seed), 25)
    vis = tree.visibility()
    for i in range(len(tree.tokens)):
        ancestors, node = set(), i
        while node != -1:
            ancestors.add(node)
            node = tree.parents[node]
        assert {j for j in range(len(tree.tokens)) if vis[i, j]} == ancestors


def test_walk_follows_target_choices():
    tree = chain(5, [1, 2, 3])
    assert tree.walk([1, 2, 9, 0].__getitem__) == [0, 1, 2]
    assert tree.walk([7, 0, 0, 0].__getitem__) == [0]
    lp = torch.log_softmax(torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0]]), -1)
    t = best_first(0, lp, 5)  # depth-1 tokens 0 and 1, each with a token-0 child
    second = t.tokens.index(1)
    choices = [1] + [0] * (len(t.tokens) - 1)
    path = t.walk(choices.__getitem__)
    assert path[1] == second and t.depths[path[-1]] == 2 and len(path) == 3
    asked = []
    assert t.walk(lambda node: asked.append(node) or choices[node]) == path and asked == path  # the path's only
