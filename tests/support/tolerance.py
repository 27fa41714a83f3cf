"""Tolerances from the dtype and the depth of the sums, not from one CPU's results."""
from __future__ import annotations

import torch


def sums_depth(g, context: int) -> int:
    """The longest chain of products summed into one output of a decoder of geometry `g` over `context` positions:
    each layer's projections (hidden, intermediate) and attention (context), then the head's (hidden)."""
    return g.num_layers * (g.hidden_size + g.intermediate_size + context) + g.hidden_size


def assert_same_sums(actual: torch.Tensor, expected: torch.Tensor, depth: int) -> None:
    """Equal up to the dtype's rounding: each element is a chain of at most `depth` products summed, every step
    rounding by at most eps of the largest magnitude, so only a difference beyond eps * depth * max|x| is a bug
    (smaller ones are the summation order, which differs with the CPU's kernels and the batch's shape)."""
    tol = torch.finfo(expected.dtype).eps * depth * (expected.abs().max().item() if expected.numel() else 0.0)
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0)


def assert_same_logprobs(actual: list[float | None], expected: list[float | None], g, context: int,
                         vocab: int) -> None:
    """Log-probs of one text from two computations (a prefill's rows, decode steps), None where neither has one:
    the logits' sums, then the log-softmax's over the vocabulary, each at the dtype's rounding (fp32)."""
    assert [a is None for a in actual] == [e is None for e in expected]
    pairs = [(a, e) for a, e in zip(actual, expected) if e is not None]
    assert_same_sums(torch.tensor([a for a, _ in pairs]), torch.tensor([e for _, e in pairs]),
                     sums_depth(g, context) + vocab)
