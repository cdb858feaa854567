"""The optimizer step at an accumulation boundary: one control all-reduce (overflow flag, squared gradient norm,
gather signature, which parameters got gradients), then skip, or clip and step where the optimizer lives, then the
loss scale, the LR schedule and the runtime's after-step work.

    python -m pytest tests/engine/test_engine.py tests/engine/test_precision.py -q

The control all-reduce's .tolist() is the one host synchronisation of the step.
"""

from __future__ import annotations

import logging
import math

import torch

from zkern import ops
from zkern.comm.divergence import signatures_differ
from zkern.config import Config
from zkern.core.runtime import Runtime
from zkern.engine.parts import EngineParts
from zkern.optim.shard_adam import ShardAdam, step_torch_optimizer

log = logging.getLogger("zkern")


def optimizer_step(parts: EngineParts) -> None:
    counters = parts.counters
    # the last step's delayed update reaches the weights, whatever this step decides; the whole copies follow it at
    # after_step when the step applies, or below when it does not (one refresh a step, not two)
    landed = parts.host_step is not None and parts.host_step.delayed and parts.host_step.land(refresh=False)
    found = torch.zeros((), dtype=torch.float32, device=parts.device)
    sq_norm = torch.zeros((), dtype=torch.float32, device=parts.device)
    for segment in parts.runtime.grad_segments():
        f, s = ops.unscale_and_check_(segment, 1.0)  # check and norm only; unscaling is folded into Adam
        found += f
        sq_norm += s
    # float64: the gather signature's sum and sum of squares must add up exactly (divergence.py).
    signature = parts.runtime.gather_signature()
    host = torch.tensor([signature, signature * signature, *map(float, parts.runtime.used)], dtype=torch.float64)
    control = torch.cat([found.view(1).double(), sq_norm.view(1).double(), host.to(parts.device)])
    parts.comm.all_reduce(control, "step control: overflow flag, squared gradient norm, gather signature, "
                                   "parameters with gradients", kind="control")
    values = control.tolist()  # the one host synchronisation of the step
    if signatures_differ(values[2], values[3], signature, parts.world_size):
        if parts.host_step is not None:
            parts.host_step.withdraw()  # the speculative Adam's chunks go back to their state before the step
        parts.runtime.diverged_step()  # stage 3: ranks paired different units; never apply this step
        counters.skipped_steps += 1
        parts.runtime.skipped_step()
        if landed:
            parts.runtime.refresh()
        parts.runtime.zero_grad()
        return
    sq = values[1]
    overflow = values[0] > 0 or not math.isfinite(sq)
    inv = unscale_factor(parts)  # applied inside the Adam pass
    norm = math.sqrt(sq) * inv if math.isfinite(sq) else float("inf")
    counters.last_grad_norm = norm
    if overflow:
        if parts.host_step is not None:
            parts.host_step.withdraw()
        skip(parts, norm)
        if landed:
            parts.runtime.refresh()
    else:
        clip = parts.config.gradient_clipping
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0  # torch.nn.utils.clip_grad_norm_'s rule
        flags = [v > 0 for v in values[4:]]
        check_unused(parts.config, parts.runtime, flags)
        active = parts.runtime.active(flags)
        if parts.host_step is not None:
            parts.host_step.step(parts.optimizer, grad_scale=inv * coef, active=active)
        elif isinstance(parts.optimizer, ShardAdam):
            parts.optimizer.step(grad_scale=inv * coef, active=active, after_chunk=parts.runtime.chunk_stepped)
        else:
            step_torch_optimizer(parts.optimizer, parts.runtime.shard_groups, grad_scale=inv * coef, active=active)
        scale = parts.scaler.scale
        parts.scaler.update(False)
        if parts.scaler.scale != scale:  # LoCo's errors are kept in loss-scaled units: they follow the scale
            parts.runtime.loss_scale_changed(parts.scaler.scale / scale)
        if parts.lr_scheduler is not None:
            parts.lr_scheduler.step()
        parts.runtime.after_step()
        counters.step_applied = True  # was_step_applied()
    parts.runtime.zero_grad()


def unscale_factor(parts: EngineParts) -> float:
    """What turns the gradient buffers into the gradient the optimizer applies (before clipping). The buffers hold the
    sum over ranks of loss_scale / gradient_predivide_factor times each rank's micro-batch mean gradient: the rest of
    the average over ranks (none with gradient_allreduce_op "sum") and the unscaling in one factor."""
    ranks = parts.world_size if parts.config.gradient_allreduce_op == "mean" else 1
    return parts.config.gradient_predivide_factor / (parts.scaler.scale * ranks)


def open_backward(parts: EngineParts) -> float:
    """A backward pass opens; returns the gradients' factor: the loss scale, the mean over micro-steps and the division
    before the sum over ranks (gradient_predivide_factor, by default the world size: no sum of ranks' 16-bit gradients
    grows past the largest of them)."""
    begin_backward(parts)
    return parts.scaler.scale / (parts.counters.accumulation_steps * parts.config.gradient_predivide_factor)


def close_backward(parts: EngineParts) -> None:
    """The pass ended: its reductions are waited for and folded; its gradients are held until the step."""
    parts.runtime.end_backward()
    parts.counters.backward_unstepped = True


def abort_backward(parts: EngineParts) -> None:
    """The pass raised: stage 3 releases what it held, nothing is reduced, a speculative Adam's chunks are undone."""
    parts.runtime.abort_backward()
    if parts.host_step is not None:
        parts.host_step.withdraw("backward failed")


def begin_backward(parts: EngineParts) -> None:
    """A backward starts: the runtime, and the offloaded step's gradient copies, learn whether it ends the
    accumulation."""
    boundary = parts.counters.at_boundary()
    if parts.host_step is not None:
        parts.host_step.begin_pass(boundary)
        if boundary and parts.host_step.speculative:  # the chunks' Adam as they land, guessing an unclipped step
            parts.host_step.speculate(parts.optimizer, unscale_factor(parts))
    parts.runtime.begin_backward(boundary)


def drop_gradients(parts: EngineParts) -> bool:
    """Engine.zero_grad: the gradients held since the last step go (a backward whose step() has not run, or the
    accumulation's micro-steps so far); the accumulation's count stays. True when there were some."""
    if not parts.counters.holding_gradients():
        return False
    if parts.host_step is not None:
        parts.host_step.invalidate()  # gradients copied to the host during backward are dropped too
    parts.runtime.zero_grad()
    parts.runtime.skipped_step()  # qgZ's LoCo: the errors of the dropped reductions go with them
    parts.counters.backward_unstepped = False
    return True


def skip(parts: EngineParts, norm: float) -> None:
    parts.counters.skipped_steps += 1
    parts.runtime.skipped_step()
    before = parts.scaler.scale
    if parts.scaler.loss_scaled:  # fp16, or torch_autocast in fp16
        parts.scaler.update(True)
        if parts.rank == 0:
            log.warning("zkern: OVERFLOW! Skipping step %d. Attempted loss scale: %g, reducing to %g",
                        parts.counters.global_steps + 1, before, parts.scaler.scale)
    elif parts.rank == 0:
        log.warning("zkern: non-finite gradient (norm %s) at step %d; step skipped, parameters and optimizer "
                    "state unchanged", norm, parts.counters.global_steps + 1)


def check_unused(config: Config, runtime: Runtime, flags: list[bool]) -> None:
    if config.zero_optimization.ignore_unused_parameters:
        return
    unused = [n for n, f in zip(runtime.names, flags) if not f]
    if unused:
        raise RuntimeError(f"parameters {unused} got no gradient on any rank in this step and "
                           f"zero_optimization.ignore_unused_parameters is false; set it to true (the default) "
                           f"to let them skip the step")
