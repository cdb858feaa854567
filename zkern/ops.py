"""THE front door to zkern's kernels: one function per op; each call picks its backend.

    ZKERN_BACKEND=reference python -m zkern.env_report     # force a backend and see what is active

Backends: "reference" (zkern.reference, pure torch, always there); "cpu" (zkern.cpu, the fused CPU Adam
extension: adam_step_ on host tensors when the extension is built); "triton" (CUDA tensors, Triton importable)
and "cuda" plug in here as they land. Every op keeps the signature and semantics documented in zkern.reference.
A backend that lacks an op (the CPU backend has only adam_step_; flatten and the overflow check on host tensors
are torch's own vectorised loops) serves it from zkern.reference. ZKERN_BACKEND=reference|cpu|triton|cuda
forces one; forcing one that is not available is an error, never a silent fallback.
"""

from __future__ import annotations

import os

import torch

from zkern import reference
from zkern.cpu import _ext as cpu_ext

BACKENDS = ("reference", "cpu", "triton", "cuda")


class _CpuBackend:
    """The CPU extension's ops (host tensors only)."""

    adam_step_ = staticmethod(cpu_ext.adam_step_)


# Backends that exist in this build; the Triton and CUDA kernels register here when they land.
AVAILABLE: dict[str, object] = {"reference": reference}
if cpu_ext.available():
    AVAILABLE["cpu"] = _CpuBackend


def forced_backend() -> str | None:
    """The backend ZKERN_BACKEND forces, or None when it is unset."""
    name = os.environ.get("ZKERN_BACKEND", "").strip().lower()
    if not name:
        return None
    if name not in BACKENDS:
        raise ValueError(f"ZKERN_BACKEND={name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    if name not in AVAILABLE:
        why = f" ({cpu_ext.LOAD_ERROR}; {cpu_ext.BUILD_HINT})" if name == "cpu" else " in this build yet"
        raise RuntimeError(f"ZKERN_BACKEND={name}: zkern has no {name} kernels{why}; unset ZKERN_BACKEND or use "
                           f"ZKERN_BACKEND=reference")
    return name


def backend_for(t: torch.Tensor | None = None, op: str = "adam_step_") -> str:
    """The backend op on tensor t runs on."""
    forced = forced_backend()
    if forced is not None:
        if forced == "cpu" and t is not None and t.device.type != "cpu":
            raise RuntimeError(f"ZKERN_BACKEND=cpu: the CPU kernels take host tensors, got one on {t.device}")
        return forced if hasattr(AVAILABLE[forced], op) else "reference"
    if "cpu" in AVAILABLE and op == "adam_step_" and (t is None or t.device.type == "cpu"):
        return "cpu"
    return "reference"


def _impl(t: torch.Tensor | None, op: str):
    return getattr(AVAILABLE[backend_for(t, op)], op)


def flatten(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    return _impl(tensors[0] if tensors else None, "flatten")(tensors, dtype)


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return _impl(flat, "unflatten")(flat, like)


def unscale_and_check_(flat_grad: torch.Tensor, inv_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(flat_grad, "unscale_and_check_")(flat_grad, inv_scale)


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, adamw: bool,
               grad_scale: float = 1.0, param_out: torch.Tensor | None = None) -> None:
    _impl(param, "adam_step_")(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, betas=betas, eps=eps,
                               weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale, param_out=param_out)
