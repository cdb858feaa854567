"""zkern.cpu.CPUAdam: a torch optimizer that steps host parameters with zkern's fused CPU Adam kernel.

    opt = zkern.cpu.CPUAdam(model.parameters(), lr=1e-3)        # as torch.optim.AdamW
    opt.load_state_dict(torch_adamw.state_dict())               # and back: the formats are the same

Its param groups carry torch.optim.AdamW's keys (decoupled_weight_decay chooses AdamW or Adam), and its state
is torch's ('step' as a float32 0-d tensor, 'exp_avg', 'exp_avg_sq'), so state dicts move between the two in
either direction. Without the compiled extension it steps with torch's formulas (zkern.reference) after a
one-time warning that says how to build the extension.

Parameters may be fp32 or bf16 (a bf16 master, stepped in fp32 and stored rounded). As DeepSpeedCPUAdam's,
fp32_optimizer_states=False keeps the moments in each parameter's own dtype (bf16 moments for bf16 parameters:
4 bytes per parameter of state instead of 8); stochastic_rounding=True (zkern's) rounds what is stored in bf16
stochastically instead of to nearest even.
"""

from __future__ import annotations

import warnings

import torch

from zkern import reference
from zkern.cpu import _ext

_warned_fallback = False


def _warn_fallback_once() -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(f"zkern.cpu.CPUAdam: {_ext.LOAD_ERROR}; stepping with torch's AdamW formulas instead, "
                      f"several times slower. To get the fused kernel, {_ext.BUILD_HINT}.", stacklevel=3)


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW on CPU fp32 parameters in one fused pass per tensor (defaults as torch.optim.AdamW's)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, adamw_mode: bool = True, fp32_optimizer_states: bool = True,
                 stochastic_rounding: bool = False, seed: int = 0):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"CPUAdam: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"CPUAdam: betas must lie in [0, 1), got {betas}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": False,
                    "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                    "fused": None, "decoupled_weight_decay": adamw_mode}
        super().__init__(params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states
        self.stochastic_rounding, self.seed = stochastic_rounding, seed

    @property
    def uses_extension(self) -> bool:
        return _ext.available()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            for key in ("amsgrad", "maximize", "capturable", "differentiable"):
                if group.get(key):
                    raise ValueError(f"CPUAdam does not implement {key}=True (from a loaded state dict?); use "
                                     f"torch.optim.AdamW for that")
            hyper = {"lr": float(group["lr"]), "betas": tuple(group["betas"]), "eps": group["eps"],
                     "weight_decay": group["weight_decay"], "adamw": bool(group.get("decoupled_weight_decay", True))}
            for index, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("CPUAdam does not take sparse gradients")
                if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16):
                    raise TypeError(f"CPUAdam steps fp32 or bf16 CPU parameters, got {p.dtype} on {p.device}; keep "
                                    f"the master on the host in one of those (or use torch.optim.AdamW on the device)")
                state = self.state[p]
                if not state:
                    dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                if self.stochastic_rounding:
                    hyper["sr_seed"] = reference.call_seed(self.seed, (gi << 32) + index, step)
                if _ext.available():
                    if not p.is_contiguous():
                        raise ValueError("CPUAdam: a parameter is not contiguous; the fused kernel streams flat "
                                         "memory (make it contiguous before building the optimizer)")
                    grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                    _ext.adam_step_(p, grad, state["exp_avg"], state["exp_avg_sq"], step=step, **hyper)
                else:
                    _warn_fallback_once()
                    reference.adam_step_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=step, **hyper)
        return loss
