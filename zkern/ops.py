"""THE front door to zkern's kernels: one function per op; each call picks its backend.

    ZKERN_BACKEND=reference python -m zkern.env_report     # force a backend and see what is active

Backends: "reference" (zkern.reference, pure torch, always there) today; "triton" (CUDA tensors, Triton
importable) and "cuda" plug in here as they land, each op keeping the signature and semantics documented in
zkern.reference. ZKERN_BACKEND=reference|triton|cuda forces one; forcing one that is not available is an error,
never a silent fallback.
"""

from __future__ import annotations

import os

import torch

from zkern import reference

BACKENDS = ("reference", "triton", "cuda")
# Backends that exist in this build; the Triton and CUDA kernels register here when they land.
AVAILABLE = {"reference": reference}


def forced_backend() -> str | None:
    """The backend ZKERN_BACKEND forces, or None when it is unset."""
    name = os.environ.get("ZKERN_BACKEND", "").strip().lower()
    if not name:
        return None
    if name not in BACKENDS:
        raise ValueError(f"ZKERN_BACKEND={name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    if name not in AVAILABLE:
        raise RuntimeError(f"ZKERN_BACKEND={name}: zkern has no {name} kernels in this build yet; "
                           f"unset ZKERN_BACKEND or use ZKERN_BACKEND=reference")
    return name


def backend_for(t: torch.Tensor | None = None) -> str:
    """The backend an op on tensor t runs on."""
    return forced_backend() or "reference"


def _impl(t: torch.Tensor | None):
    return AVAILABLE[backend_for(t)]


def flatten(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    return _impl(tensors[0] if tensors else None).flatten(tensors, dtype)


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return _impl(flat).unflatten(flat, like)


def unscale_and_check_(flat_grad: torch.Tensor, inv_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(flat_grad).unscale_and_check_(flat_grad, inv_scale)


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, adamw: bool,
               grad_scale: float = 1.0, param_out: torch.Tensor | None = None) -> None:
    _impl(param).adam_step_(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, betas=betas, eps=eps,
                            weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale, param_out=param_out)
