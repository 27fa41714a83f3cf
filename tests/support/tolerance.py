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
