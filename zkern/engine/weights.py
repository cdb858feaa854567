"""Whole weights out of an engine, with model.state_dict()'s names: fp32 (full_state_dict), the training dtype
(full_working_state_dict) and DeepSpeed's save_16bit_model file. Collectives: every rank calls them.

    python -m pytest tests/engine/test_engine_api.py -q
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from zkern.core.buffers import aligned_copy
from zkern.engine.parts import EngineParts
from zkern.stage3.gathered import GatheredParameters

log = logging.getLogger("zkern")


def save_16bit_model(parts: EngineParts, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin") -> str:
    """Save the weights in the training dtype with model.state_dict()'s names, as DeepSpeed's method does (a
    collective; rank 0 writes). Stage 3 gathers them only when the config allows it."""
    zero = parts.config.zero_optimization
    if zero.stage == 3:
        if not zero.stage3_gather_16bit_weights_on_model_save:
            raise RuntimeError("save_16bit_model at stage 3 gathers the whole model onto rank 0; set "
                               "zero_optimization.stage3_gather_16bit_weights_on_model_save to true to allow it")
    state = full_working_state_dict(parts, rank0_only=True)
    path = os.path.join(os.fspath(save_dir), save_filename)
    if parts.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        torch.save(state, path)
    return path


def full_working_state_dict(parts: EngineParts, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
    """The weights in the training dtype (bf16/fp16 when mixed precision, else fp32) with model.state_dict()'s
    names, on the host: what DeepSpeed's 16-bit consolidation gives (a collective: call it on every rank). With
    rank0_only, other ranks return None and, at stage 3, hold one unit at a time. Tensors one parameter shares
    under two names (tied embeddings) stay one tensor. With a delayed update in flight they include it: the trained
    model, not the weights the next forward computes with (which stay as they are: store.landed_view)."""
    with parts.store.landed_view():
        return _working_copies(parts, rank0_only)


def _working_copies(parts: EngineParts, rank0_only: bool) -> dict[str, torch.Tensor] | None:
    if parts.config.zero_optimization.stage == 3:
        values = parts.runtime.full_working(rank0_only)
    else:
        values = parts.runtime.full_working()  # whole on every rank already: a read, not a gather
        values = None if rank0_only and parts.rank != 0 else values
    if values is None:
        return None
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in module_state(parts).items():
        if id(t) not in copies:
            copies[id(t)] = aligned_copy(values.get(id(t), t).detach())  # each starts 256-byte aligned
        out[name] = copies[id(t)]
    return out


def module_state(parts: EngineParts) -> dict[str, torch.Tensor]:
    """model.state_dict(keep_vars=True): the names and the tensor objects (stage 3 parameters at rest are empty;
    the caller substitutes gathered values by id)."""
    with parts.runtime.unguarded():
        return parts.module.state_dict(keep_vars=True)


def full_state_dict(parts: EngineParts, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
    """fp32 weights with model.state_dict()'s names, on the host (a collective: call it on every rank). The
    device holds one bucket at a time; with rank0_only, other ranks return None."""
    values = parts.runtime.full_fp32(rank0_only)
    if values is None:
        return None
    out = {}
    for name, t in module_state(parts).items():
        if id(t) in values:
            out[name] = values[id(t)]
        else:
            t = t.detach()
            out[name] = t.to("cpu", torch.float32 if t.is_floating_point() else t.dtype, copy=True)
    return out


@contextlib.contextmanager
def gathered_for_generation(parts: EngineParts, engine):
    """Engine.gathered_for_generation: every unit gathered once and pinned (stage 3), under torch.no_grad(); the
    block gets `engine` (the Engine these parts are of)."""
    if parts.config.zero_optimization.stage != 3:
        with torch.no_grad():
            yield engine
        return

    params, held, total = parts.runtime.generation_params()
    if held < total and parts.rank == 0:
        log.warning("zkern: gathered_for_generation keeps %d of %d elements whole (stage3_max_live_parameters="
                    "%d); the other units are gathered at each use", held, total,
                    parts.config.zero_optimization.stage3_max_live_parameters)
    # Nothing left to gather per use when every unit fits: the per-module hooks step aside.
    hooks = parts.runtime.hooks_suspended() if held == total else contextlib.nullcontext()
    with torch.no_grad(), GatheredParameters(params), hooks:
        yield engine
