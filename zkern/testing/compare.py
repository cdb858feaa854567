"""The comparisons zkern's equivalence tests use, with tolerances derived from the arithmetic.

    python -m pytest tests/test_engine.py -q -k wrong_result
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


def assert_params_close(actual: dict, expected: dict, *, lr: float, steps: int, **kwargs) -> None:
    failures = compare_params(actual, expected, lr=lr, steps=steps, **kwargs)
    if failures:
        raise AssertionError("parameters differ from the reference:\n  " + "\n  ".join(failures))
