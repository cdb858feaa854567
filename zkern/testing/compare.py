"""The comparisons zkern's equivalence tests use, with tolerances derived from the arithmetic.

    python -m pytest tests/engine/test_engine.py -q -k wrong_result
"""

from __future__ import annotations

import math

import torch


def compare_params(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, lr: float, steps: int,
                   rtol: float = 1e-5, lr_units: float = 1e-3) -> list[str]:
    """Failures (empty when all match) of zkern's equivalence bar, tensor by tensor:

    a tensor matches when its relative error ||a - e|| / ||e|| is within rtol (float32 rounding), or, where Adam's
    division by sqrt(v) amplifies rounding (gradients near zero, as in zero-initialised biases), when its largest
    element error is within lr_units * lr * steps (Adam moves an element by about lr per step).
    """
    failures = []
    if set(actual) != set(expected):
        return [f"names differ: missing {sorted(set(expected) - set(actual))}, "
                f"unexpected {sorted(set(actual) - set(expected))}"]
    for name, e in expected.items():
        a = actual[name]
        if a.shape != e.shape:
            failures.append(f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}")
            continue
        if not e.is_floating_point():
            if not torch.equal(a, e):
                failures.append(f"{name}: integer tensor differs")
            continue
        a, e = a.double(), e.double()
        if not torch.isfinite(a).all():
            failures.append(f"{name}: non-finite values")
            continue
        diff = (a - e).norm().item()
        ref = e.norm().item()
        rel = diff / ref if ref > 0 else (0.0 if diff == 0 else math.inf)
        max_err = (a - e).abs().max().item() if a.numel() else 0.0
        if rel <= rtol or max_err <= lr_units * lr * steps:
            continue
        failures.append(f"{name}: relative error {rel:.3e} > {rtol:g} and largest element error {max_err:.3e} > "
                        f"{lr_units:g} x lr x steps = {lr_units * lr * steps:.3e}")
    return failures


def fp32_sum_rtol(n: int, lam: float = 8.0) -> float:
    """Relative tolerance of a float32 sum of n non-negative terms (a sum of squares) computed in an order the test
    does not fix (torch's vectorised cascade, whose order depends on the CPU's vector width; a Triton tree), against
    the exact sum.

    u = 2**-24. The deterministic worst case over all orders is gamma_{n-1} = (n-1)u / (1-(n-1)u): 6% at n = 2**20,
    a bound no real order comes near. Round-to-nearest errors behave as independent and zero-mean, and Higham & Mary
    (SIAM J. Sci. Comput. 41(5), 2019, "A new approach to probabilistic rounding error analysis", Thm 3.1) bound the
    error of a sum by lam * sqrt(n) * u * sum|x_i| + O(u^2) with probability at least 1 - 2n exp(-lam^2 (1-u)^2 / 2);
    lam = 8 leaves a failure probability below 3e-8 up to n = 2**20 and below 5e-7 up to 2**24. One more u covers
    rounding each term (the square) once. Measured here: 2.1e-5 at n = 2**20 + 3 against a bound of 4.9e-4; a block
    of 1024 elements left out of that sum (1e-3) would fail it, and at n = 1000 one element (1e-3) against 1.5e-5.
    """
    u = 2.0**-24
    return lam * math.sqrt(n) * u + u


def assert_f32_rounding(actual: torch.Tensor, expected: torch.Tensor, scale: float, what: str, ulps: int = 8) -> None:
    """Element-wise agreement to float32 rounding: each element within `ulps` units in the last place of the
    larger of |expected| and `scale`, the size of the terms that formed it (lr times the steps for an Adam
    parameter, whose updates are about lr each; the gradient's magnitude for exp_avg, whose lerp can cancel).
    Fused multiply-adds and a different order of operations move results by a few such units, nothing more."""
    a, e = actual.double(), expected.double()
    bound = ulps * torch.finfo(torch.float32).eps * (e.abs() + scale)
    excess = ((a - e).abs() - bound).max().item() if a.numel() else 0.0
    assert excess <= 0, f"{what}: an element is off by {excess:.3g} beyond {ulps} ulps"


def adam_drift_bound(start: torch.Tensor, grads: list[torch.Tensor], *, lr: float, betas: tuple[float, float],
                     eps: float, weight_decay: float, adamw: bool, grad_scale: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per element, how far two correct float32 implementations of torch's Adam/AdamW may end apart after the
    steps `grads` (parameter, exp_avg, exp_avg_sq): each elementary operation correctly rounded (relative error at
    most u = 2**-24), the two free to fuse multiply-adds and to order operations differently (torch's vectorised
    kernels fuse where its scalar ones do not; zkern's CPU Adam and Triton kernel fuse where they choose).

    First order in u, along the exact trajectory (computed here in float64), with D the bound on the difference:
      effective gradient  g' = s*g (+ wd*p for Adam)  D_g = 4u(|s g| + |wd p|)  (+ wd * D_p: Adam couples p in)
      exp_avg   m = b1 m + (1-b1) g'              D_m <- b1 D_m + (1-b1) D_g + 6u(b1|m| + (1-b1)|g'|)
      exp_avg_sq v = b2 v + (1-b2) g'^2           D_v <- b2 D_v + 2(1-b2)|g'| D_g + 6u(b2 v + (1-b2) g'^2)
      update    U = lr (m/bc1) / (sqrt(v/bc2) + eps)
                D_U = lr [D_m/bc1 + |m/bc1| d] / (sqrt(v/bc2) + eps) + 8u|U|,
                d = min(D_v / (2 bc2 sqrt(v/bc2)), sqrt(D_v / bc2))   (the change of the square root)
      parameter p <- p(1 - lr wd) - U (AdamW) or p - U   D_p <- D_p + D_U + 4u|p|
    Where g' nearly cancels (Adam: g ~ -wd p), sqrt(v) is small and D_g/sqrt(v) large: a few ulps of g' become
    many ulps of p, which no fixed ulp tolerance covers (torch's scalar kernels on a CPU without AVX2 ran 3.9e-6
    past 8 ulps there). The caller allows twice the bound (second-order terms) and a wrong formula still fails:
    a missing weight decay or bias correction moves p by ~lr, orders of magnitude above it.
    """
    u = 2.0**-24
    b1, b2 = betas
    p = start.double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    dp, dm, dv = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    for step, g in enumerate(grads, 1):
        g = g.double() * grad_scale
        dg = 4 * u * g.abs() + (0.0 if adamw else weight_decay * (4 * u * p.abs() + dp))
        if not adamw:
            g = g + weight_decay * p
        dm = b1 * dm + (1 - b1) * dg + 6 * u * (b1 * m.abs() + (1 - b1) * g.abs())
        dv = b2 * dv + 2 * (1 - b2) * g.abs() * dg + 6 * u * (b2 * v + (1 - b2) * g * g)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        root = (v / bc2).sqrt()
        d_root = torch.minimum(dv / (2 * bc2 * root.clamp_min(1e-300)), (dv / bc2).sqrt())
        update = lr * (m / bc1) / (root + eps)
        du = lr * (dm / bc1 + (m / bc1).abs() * d_root) / (root + eps) + 8 * u * update.abs()
        if adamw:
            p = p * (1 - lr * weight_decay)
        dp = dp + du + 4 * u * p.abs()
        p = p - update
    return dp, dm, dv


def same_bits_or_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except where both are NaN: the payload of a NaN cast to a 16-bit type is not specified, and
    torch's own casts differ by CPU (its vectorised kernels write bf16 NaN as 0xFFFF, its scalar ones, on a CPU
    without AVX2, as 0x7FC0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    both_nan = a.isnan() & b.isnan()
    return bool(((a.view(bits) == b.view(bits)) | both_nan).all())


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """|actual - expected| <= bound element by element, NaN where both are NaN."""
    a, e = actual.double(), expected.double()
    both_nan = a.isnan() & e.isnan()
    excess = torch.where(both_nan, torch.zeros_like(a), (a - e).abs() - bound)
    worst = excess.max().item() if a.numel() else 0.0
    assert worst <= 0 and not torch.isnan(excess).any(), f"{what}: an element is off by {worst:.3g} beyond its bound"


def assert_params_close(actual: dict, expected: dict, *, lr: float, steps: int, **kwargs) -> None:
    failures = compare_params(actual, expected, lr=lr, steps=steps, **kwargs)
    if failures:
        raise AssertionError("parameters differ from the reference:\n  " + "\n  ".join(failures))
