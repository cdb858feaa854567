"""Newton-Schulz orthogonalization, Muon's step on a whole matrix (optim/muon.py): torch.optim.Muon's quintic iteration
("standard", bf16) and DeepSpeed's Gram-matrix form ("gram", fp16 on a GPU, fp32 elsewhere).

    python -m pytest tests/optim/test_muon.py -q
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The matrix Muon orthogonalizes for a parameter of this shape (2 or more dimensions)."""
    rows = shape[0]
    return rows, math.prod(shape) // rows


def ns_dtype(method: str, device: torch.device | None) -> torch.dtype:
    """The dtype Newton-Schulz computes and returns in: bf16 for "standard" (torch's), fp16 on a GPU and fp32
    elsewhere for "gram"."""
    if method == "standard":
        return torch.bfloat16
    return torch.float16 if device is not None and torch.device(device).type == "cuda" else torch.float32


def ns_work(shape: tuple[int, int]) -> int:
    """Newton-Schulz's work on a matrix of this shape, up to a constant: each iteration's products cost
    rows x cols x min(rows, cols)."""
    rows, cols = shape
    return rows * cols * min(rows, cols)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization: the quintic iteration in bf16 on the wide orientation (bf16 result)."""
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def gram_newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The same quintic map, iterated on the small Gram matrix R = X X^T (n x n, n the short side) and applied to X
    once at the end (DeepSpeed's "gram" method: far fewer flops when the matrix is wide). The accumulated left factor
    Q is applied and the iteration restarted from Q X after two steps, which keeps half precision stable."""
    x = g.to(ns_dtype("gram", g.device))
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    a, b, c = NS_COEFFICIENTS
    n, m = x.shape
    if m <= n:  # square: nothing to gain
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if tall else x
    r, q, restart = x @ x.T, None, 2
    for i in range(steps):
        if i == restart:
            x = q @ x
            r, q = x @ x.T, None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal().add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != restart:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    return (x.T @ q.T) if tall else (q @ x)
