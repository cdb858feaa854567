"""One parameter's whole gradient, fp32 value or optimizer state, whatever the stage, and writes of the last two:
DeepSpeed's deepspeed.utils.safe_get_full_grad, safe_get_full_fp32_param, safe_get_full_optimizer_state,
safe_set_full_fp32_param and safe_set_full_optimizer_state, which training scripts call to inspect, log or edit a
layer.

    g = zkern.safe_get_full_grad(model.lm_head.weight)        # after the boundary's backward, before step()
    w = zkern.safe_get_full_fp32_param(model.lm_head.weight)
    m = zkern.safe_get_full_optimizer_state(model.lm_head.weight, "exp_avg")
    zkern.safe_set_full_fp32_param(model.lm_head.weight, w * 0.5)   # every rank, the same value

All are collectives (every rank calls them with the same parameter, and a write with the same value). The getters gather
only the bucket or stage-3 unit holding the parameter (the optimizer state: one all-reduce of its size), and return a
new fp32 tensor of the parameter's full shape on the engine's device. A write goes to every rank's part of the master
(or the state), on the device, the host or NVMe, and the working copies follow it, as after a load. The gradient is the
one the optimizer is about to apply, before clipping: the gradient of the accumulation's mean loss, averaged over ranks,
unscaled (a plain single-process run's p.grad for the same global batch).

    python -m pytest tests/engine/test_engine_frameworks.py -q -k safe_get
"""

from __future__ import annotations

import weakref

import torch

from zkern.core.owners import owner_of
from zkern.core.shard_groups import shares_staging
from zkern.engine import stepping
from zkern.engine.parts import EngineParts

_ENGINES: weakref.WeakSet = weakref.WeakSet()  # each engine's parts (an engine holds its parts: they go with it)


def register(parts: EngineParts) -> None:
    _ENGINES.add(parts)


def parts_of(param: torch.Tensor) -> EngineParts:
    """The parts of the engine that trains param (its runtime, counters, optimizer, ...)."""
    owner = owner_of(param)  # the runtime that partitions it (stages 0-3 register; a forward-only replica does not)
    for parts in list(_ENGINES):
        if owner is not None and parts.runtime is owner:
            return parts
    for parts in list(_ENGINES):
        if owner is None and any(p is param for p in parts.module.parameters()):
            return parts
    raise ValueError("this parameter belongs to no zkern engine: pass a parameter of the model an engine was "
                     "built over (engine.module's)")


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """param's whole gradient in fp32, or None where it has none (frozen, or an engine without an optimizer)."""
    parts = parts_of(param)
    if not param.requires_grad or parts.optimizer is None:
        return None
    counters = parts.counters
    if not (counters.backward_unstepped and counters.at_boundary()):
        raise RuntimeError(
            f"safe_get_full_grad reads the gradient the next step applies: call it after the accumulation "
            f"boundary's backward and before step() (this engine is at micro-step {counters.pending_micro_steps + 1} "
            f"of {int(counters.accumulation_steps)}"
            f"{'' if counters.backward_unstepped else ', with no backward since its last step'})")
    parts.residency.require("safe_get_full_grad", reads=("lp_grads", "contiguous_grad_buffer"))
    grad = parts.runtime.full_grads(only={id(param)})[id(param)]
    return (grad.float() * stepping.unscale_factor(parts)).to(parts.device)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """param's whole value in fp32: the master weight the optimizer steps where there is one."""
    parts = parts_of(param)
    parts.residency.require("safe_get_full_fp32_param", reads=("hp_params", "lp_params"))
    values = parts.runtime.full_fp32(False, only={id(param)})
    if id(param) in values:
        return values[id(param)].to(parts.device)
    with parts.runtime.unguarded():  # whole on every rank (frozen below stage 3, or an engine without optimizer)
        return param.detach().to(parts.device, torch.float32, copy=True)


def _trained_index(parts: EngineParts, param: torch.nn.Parameter, what: str) -> int:
    """param's index among the parameters the optimizer trains; raises (on every rank alike) where it is not one."""
    if parts.optimizer is None:
        raise ValueError(f"{what}: this engine has no optimizer (it runs forward only)")
    index = next((i for i, p in enumerate(parts.runtime.params) if p is param), None)
    if index is None:
        raise ValueError(f"{what}: the parameter is frozen (requires_grad False): it has no master or optimizer "
                         f"state; write a frozen parameter with zkern.GatheredParameters(p, modifier_rank=0)")
    return index


def _own_pieces(parts: EngineParts, param: torch.nn.Parameter, what: str):
    """(group, piece index, first element, piece, whether this rank is its writer) of each shard piece of param this
    rank holds."""
    index = _trained_index(parts, param, what)
    smap = parts.runtime.shard_map()
    for gi, group in enumerate(parts.runtime.shard_groups):
        for i, piece in enumerate(group.pieces):
            owner, start, mine = smap.pieces[gi][i]
            if owner == index:
                yield gi, i, start, piece, mine


def _full_shape(parts: EngineParts, param: torch.nn.Parameter) -> torch.Size:
    return torch.Size(parts.runtime.full_shape(param))


def _checked_value(parts: EngineParts, param: torch.nn.Parameter, value, what: str) -> torch.Tensor:
    shape = _full_shape(parts, param)
    if not isinstance(value, torch.Tensor) or value.shape != shape or not value.is_floating_point():
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{what}: the value must be a floating-point tensor of the parameter's full shape "
                         f"{tuple(shape)}, got {got}")
    if not torch.isfinite(value).all():
        raise ValueError(f"{what}: the value has inf or NaN elements")
    return value.detach().reshape(-1).to("cpu", torch.float32)


def _per_element_keys(parts: EngineParts, gi: int, i: int, piece: torch.Tensor) -> dict[str, torch.Tensor]:
    from zkern.checkpoint.save import optimizer_piece_state

    state = optimizer_piece_state(parts.optimizer, gi, i, piece)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() == piece.numel()
            and k != "step"}


def _agree_on_key(parts: EngineParts, param: torch.nn.Parameter, key: str, what: str) -> None:
    """Every rank raises the same error, or none does: a rank may hold no piece of param, and a rank that raised
    alone would leave the others in the collective that follows."""
    seen, missing = set(), 0.0
    for gi, i, _, piece, _ in _own_pieces(parts, param, what):
        keys = _per_element_keys(parts, gi, i, piece)
        seen |= set(keys)
        missing = max(missing, float(key not in keys))
    flag = torch.tensor([missing], device=parts.device)
    parts.comm.all_reduce(flag, f"{what}: whether every rank has the state", op=torch.distributed.ReduceOp.MAX,
                           kind="control")
    if flag.item():
        raise ValueError(f"{what}: the optimizer ({type(parts.optimizer).__name__}) has no per-element state "
                         f"{key!r} for this parameter (this rank's pieces of it have "
                         f"{sorted(seen) or 'none'}; none before the first step for most optimizers)")


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """param's whole optimizer state `optim_state_key` (Adam's "exp_avg", "exp_avg_sq"; SGD's "momentum_buffer";
    ...) in fp32, or None for a frozen parameter or an engine without an optimizer."""
    parts = parts_of(param)
    if parts.optimizer is None or not param.requires_grad:
        return None
    parts.residency.require("safe_get_full_optimizer_state", reads=("optim_states",))
    what = f"safe_get_full_optimizer_state(p, {optim_state_key!r})"
    _agree_on_key(parts, param, optim_state_key, what)
    full = torch.zeros(_full_shape(parts, param).numel(), dtype=torch.float32)
    for gi, i, start, piece, mine in _own_pieces(parts, param, what):
        if mine:  # stage 0 holds every piece on every rank: each counted once
            value = parts.store.read(_per_element_keys(parts, gi, i, piece)[optim_state_key], optim_state_key)
            full[start:start + piece.numel()] = value.reshape(-1).to("cpu", torch.float32)
    full = full.to(parts.device)
    parts.comm.all_reduce(full, what, kind="control")  # every element held by exactly one writer
    return full.view(_full_shape(parts, param))


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set param's master weight (and its working copies) to value, of its full shape: the next forward computes
    with it and the next step starts from it. Optimizer state is left as it is."""
    parts = parts_of(param)
    what = "safe_set_full_fp32_param"
    parts.residency.require(what, reads=("hp_params", "lp_params"))
    _trained_index(parts, param, what)
    flat = _checked_value(parts, param, value, what)
    for _, _, start, piece, _ in _own_pieces(parts, param, what):
        parts.store.write(piece, _placed(parts, piece, flat[start:start + piece.numel()]))
    _working_from_masters(parts)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set param's optimizer state `optim_state_key` to value, of its full shape (Adam's exp_avg, exp_avg_sq, ...)."""
    parts = parts_of(param)
    what = f"safe_set_full_optimizer_state(p, v, {optim_state_key!r})"
    parts.residency.require("safe_set_full_optimizer_state", reads=("optim_states",))
    _trained_index(parts, param, what)
    flat = _checked_value(parts, param, value, what)
    _agree_on_key(parts, param, optim_state_key, what)
    for gi, i, start, piece, _ in _own_pieces(parts, param, what):
        target = _per_element_keys(parts, gi, i, piece)[optim_state_key]
        parts.store.write(target, _placed(parts, target, flat[start:start + piece.numel()]), optim_state_key)


def _placed(parts: EngineParts, target: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values shaped as target, on its device and in its dtype (on the host, where target stands for a file)."""
    values = values.view(target.shape)
    return values if parts.store.in_files(target) else values.to(target.device, target.dtype)


def _working_from_masters(parts: EngineParts) -> None:
    """The working-dtype copies from the masters, everywhere they are kept (as a load leaves them): each chunk's
    working shard, hpZ's secondary slices (dropped), and every whole copy (a collective)."""
    groups = [*parts.runtime.shard_groups, *(parts.host_step.host_groups if parts.host_step is not None else [])]
    with torch.no_grad():
        for g in groups:
            for chunk in g.chunks:
                if chunk.out is not None and not shares_staging(chunk):
                    parts.store.write(chunk.out, parts.store.read(chunk.param))
    parts.state.reset("derived")
    parts.runtime.refresh()
