"""The optimizer step at an accumulation boundary: one control all-reduce (overflow flag, squared gradient norm,
gather signature, which parameters got gradients), then skip, or clip and step where the optimizer lives, then the
loss scale, the LR schedule and the runtime's after-step work.

    python -m pytest tests/engine/test_engine.py tests/engine/test_precision.py -q

The control all-reduce's .tolist() is the one host synchronisation of the step.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from zkern import ops
from zkern.comm.divergence import signatures_differ
from zkern.optim.shard_adam import ShardAdam, step_torch_optimizer

if TYPE_CHECKING:
    from zkern.engine.engine import Engine

log = logging.getLogger("zkern")


def optimizer_step(engine: Engine) -> None:
    found = torch.zeros((), dtype=torch.float32, device=engine.device)
    sq_norm = torch.zeros((), dtype=torch.float32, device=engine.device)
    for segment in engine.runtime.grad_segments():
        f, s = ops.unscale_and_check_(segment, 1.0)  # check and norm only; unscaling is folded into Adam
        found += f
        sq_norm += s
    # float64: the gather signature's sum and sum of squares must add up exactly (divergence.py).
    signature = engine.runtime.gather_signature()
    host = torch.tensor([signature, signature * signature, *map(float, engine.runtime.used)], dtype=torch.float64)
    control = torch.cat([found.view(1).double(), sq_norm.view(1).double(), host.to(engine.device)])
    engine.comm.all_reduce(control, "step control: overflow flag, squared gradient norm, gather signature, "
                                    "parameters with gradients", kind="control")
    values = control.tolist()  # the one host synchronisation of the step
    if signatures_differ(values[2], values[3], signature, engine.world_size):
        engine.runtime.diverged_step()  # stage 3: ranks paired different units; never apply this step
        engine.skipped_steps += 1
        engine.runtime.skipped_step()
        engine.runtime.zero_grad()
        return
    sq = values[1]
    overflow = values[0] > 0 or not math.isfinite(sq)
    # Gradients hold the sum over ranks of loss_scale / predivide * (micro-batch mean gradient): fold the rest of
    # the average (none with gradient_allreduce_op "sum") and the unscaling into one factor applied inside the Adam
    # pass.
    inv = engine.config.gradient_predivide_factor / (engine.scaler.scale * ranks_averaged(engine))
    norm = math.sqrt(sq) * inv if math.isfinite(sq) else float("inf")
    engine.last_grad_norm = norm
    if overflow:
        skip(engine, norm)
    else:
        clip = engine.config.gradient_clipping
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0  # torch.nn.utils.clip_grad_norm_'s rule
        flags = [v > 0 for v in values[4:]]
        check_unused(engine, flags)
        active = engine.runtime.active(flags)
        if engine.host_step is not None:
            engine.host_step.step(engine.optimizer, grad_scale=inv * coef, active=active)
        elif isinstance(engine.optimizer, ShardAdam):
            engine.optimizer.step(grad_scale=inv * coef, active=active, after_chunk=engine.runtime.chunk_stepped)
        else:
            step_torch_optimizer(engine.optimizer, engine.runtime.shard_groups, grad_scale=inv * coef, active=active)
        scale = engine.scaler.scale
        engine.scaler.update(False)
        if engine.scaler.scale != scale:  # LoCo's errors are kept in loss-scaled units: they follow the scale
            engine.runtime.loss_scale_changed(engine.scaler.scale / scale)
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.step()
        engine.runtime.after_step()
        engine._step_applied = True  # was_step_applied()
    engine.runtime.zero_grad()


def ranks_averaged(engine: Engine) -> int:
    """What the sum of the ranks' gradients is divided by: the world size, or 1 with gradient_allreduce_op "sum"."""
    return engine.world_size if engine.config.gradient_allreduce_op == "mean" else 1


def begin_backward(engine: Engine) -> None:
    """A backward starts: the runtime, and the offloaded step's gradient copies, learn whether it ends the
    accumulation."""
    boundary = engine.is_gradient_accumulation_boundary()
    if engine.host_step is not None:
        engine.host_step.begin_pass(boundary)
    engine.runtime.begin_backward(boundary)


def drop_gradients(engine: Engine) -> None:
    """Engine.zero_grad: the gradients held since the last step go (a backward whose step() has not run, or the
    accumulation's micro-steps so far); the accumulation's count stays."""
    if engine.pending_micro_steps or engine.backward_unstepped:
        if engine.host_step is not None:
            engine.host_step.invalidate()  # gradients copied to the host during backward are dropped too
        engine.runtime.zero_grad()
        engine.runtime.skipped_step()  # qgZ's LoCo: the errors of the dropped reductions go with them
        engine.reporter.losses.clear()
        engine.backward_unstepped = False


def skip(engine: Engine, norm: float) -> None:
    engine.skipped_steps += 1
    engine.runtime.skipped_step()
    before = engine.scaler.scale
    if engine.scaler.loss_scaled:  # fp16, or torch_autocast in fp16
        engine.scaler.update(True)
        if engine.rank == 0:
            log.warning("zkern: OVERFLOW! Skipping step %d. Attempted loss scale: %g, reducing to %g",
                        engine.global_steps + 1, before, engine.scaler.scale)
    elif engine.rank == 0:
        log.warning("zkern: non-finite gradient (norm %s) at step %d; step skipped, parameters and optimizer "
                    "state unchanged", norm, engine.global_steps + 1)


def check_unused(engine: Engine, flags: list[bool]) -> None:
    if engine.config.zero_optimization.ignore_unused_parameters:
        return
    unused = [n for n, f in zip(engine.runtime.names, flags) if not f]
    if unused:
        raise RuntimeError(f"parameters {unused} got no gradient on any rank in this step and "
                           f"zero_optimization.ignore_unused_parameters is false; set it to true (the default) "
                           f"to let them skip the step")
