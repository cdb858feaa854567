"""One parameter's whole gradient or fp32 value, whatever the stage: DeepSpeed's deepspeed.utils.safe_get_full_grad
and safe_get_full_fp32_param, which training scripts call to inspect or log a layer.

    g = zkern.safe_get_full_grad(model.lm_head.weight)        # after the boundary's backward, before step()
    w = zkern.safe_get_full_fp32_param(model.lm_head.weight)

Both are collectives (every rank calls them with the same parameter) that gather only the bucket or stage-3 unit
holding it, and return a new fp32 tensor of the parameter's full shape on the engine's device. The gradient is the
one the optimizer is about to apply, before clipping: the gradient of the accumulation's mean loss, averaged over
ranks, unscaled (a plain single-process run's p.grad for the same global batch).

    python -m pytest tests/test_engine_frameworks.py -q -k safe_get
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from zkern.core.owners import owner_of
from zkern.engine import resident

if TYPE_CHECKING:
    from zkern.engine.engine import Engine

_ENGINES: weakref.WeakSet = weakref.WeakSet()


def register(engine: Engine) -> None:
    _ENGINES.add(engine)


def engine_of(param: torch.Tensor) -> Engine:
    owner = owner_of(param)  # the runtime that partitions it (stages 0-3 register; a forward-only replica does not)
    for engine in list(_ENGINES):
        if owner is not None and engine.runtime is owner:
            return engine
    for engine in list(_ENGINES):
        if owner is None and any(p is param for p in engine.module.parameters()):
            return engine
    raise ValueError("this parameter belongs to no zkern engine: pass a parameter of the model an engine was "
                     "built over (engine.module's)")


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """param's whole gradient in fp32, or None where it has none (frozen, or an engine without an optimizer)."""
    engine = engine_of(param)
    if not param.requires_grad or engine.optimizer is None:
        return None
    if not (engine.backward_unstepped and engine.is_gradient_accumulation_boundary()):
        raise RuntimeError(
            f"safe_get_full_grad reads the gradient the next step applies: call it after the accumulation "
            f"boundary's backward and before step() (this engine is at micro-step {engine.pending_micro_steps + 1} "
            f"of {int(engine.gradient_accumulation_steps)}"
            f"{'' if engine.backward_unstepped else ', with no backward since its last step'})")
    resident.require(engine, "safe_get_full_grad", reads=("lp_grads", "contiguous_grad_buffer"))
    grad = engine.runtime.full_grads(only={id(param)})[id(param)]
    # The buffers hold the sum over ranks of loss_scale / gradient_predivide_factor times each rank's gradient.
    scale = engine.config.gradient_predivide_factor / (engine.scaler.scale * engine.world_size)
    return (grad.float() * scale).to(engine.device)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """param's whole value in fp32: the master weight the optimizer steps where there is one."""
    engine = engine_of(param)
    resident.require(engine, "safe_get_full_fp32_param", reads=("hp_params", "lp_params"))
    values = engine.runtime.full_fp32(False, only={id(param)})
    if id(param) in values:
        return values[id(param)].to(engine.device)
    with engine.runtime.unguarded():  # whole on every rank (frozen below stage 3, or an engine without optimizer)
        return param.detach().to(engine.device, torch.float32, copy=True)
