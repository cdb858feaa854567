"""A parameter's gradient written whole, and the part of a parameter this rank's shard holds: DeepSpeed's
safe_set_full_grad and its local API (safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state
and their safe_set_local_* writes), which RL and model-surgery code use to touch only what a rank owns.

    g = zkern.safe_get_full_grad(p); zkern.safe_set_full_grad(p, g.clamp(-1, 1))   # after the boundary's backward
    mine = zkern.safe_get_local_fp32_param(p)      # 1-D: this rank's elements of p, in order (may be empty)

A rank's part of a parameter is one contiguous range of its flattened elements, and the ranks' parts in rank order
make the whole parameter (a unit's or bucket's flat buffer is cut into equal chunks, one per rank), so concatenating
every rank's local tensor gives the full one. DeepSpeed defines the local API for stage 3; zkern's shards at stages 1
and 2 are the same kind of partition, so it answers there too; at stage 0 nothing is partitioned and it refuses.
Gradients are read and written as the optimizer will apply them: unscaled, averaged over ranks, before clipping
(what safe_get_full_grad returns), stored in the accumulation dtype (a bf16 or fp16 gradient buffer rounds a write).
The getters are local, and so are the gradient and optimizer-state writes (each rank writes its own part; for
safe_set_full_grad every rank passes the same full value); a write of the fp32 value is a collective, because the
working copies of the weights follow it.

    python -m pytest tests/engine/test_engine_surface.py -q -k "local or set_full_grad"
"""

from __future__ import annotations

import torch

from zkern.engine import param_views, stepping
from zkern.engine.parts import EngineParts


def _held(parts: EngineParts, param: torch.nn.Parameter, what: str) -> list[tuple]:
    """(first element within param, group, piece index, piece, chunk, first element within the chunk) of each part of
    param this rank's shard holds, in element order; every part at stage 0 (each rank holds the whole)."""
    index = param_views._trained_index(parts, param, what)
    smap = parts.runtime.shard_map()
    held = []
    for gi, group in enumerate(parts.runtime.shard_groups):
        for chunk in group.chunks:
            for pi, at, numel in chunk.pieces:
                owner, start, _ = smap.pieces[gi][pi]
                if owner == index:
                    held.append((start, gi, pi, group.pieces[pi], chunk, at, numel))
    return sorted(held, key=lambda part: part[0])


def _partitioned(parts: EngineParts, what: str) -> None:
    if parts.config.zero_optimization.stage == 0:
        raise ValueError(f"{what}: stage 0 partitions nothing (every rank holds every parameter whole); use the "
                         f"safe_get_full_* / safe_set_full_* calls")


def _grad_scale(parts: EngineParts, what: str) -> float:
    """What turns the gradient buffers' values into the gradient the optimizer applies (see safe_get_full_grad)."""
    if not (parts.counters.backward_unstepped and parts.counters.at_boundary()):
        raise RuntimeError(f"{what} touches the gradient the next step applies: call it after the accumulation "
                           f"boundary's backward and before step()")
    parts.residency.require(what, reads=("lp_grads", "contiguous_grad_buffer"))
    return stepping.unscale_factor(parts)


def _local_value(held: list[tuple], value, what: str) -> torch.Tensor:
    """value as this rank's part of a parameter (its pieces: _held): any tensor of that many elements (the 1-D tensor
    a getter returned)."""
    numel = sum(part[-1] for part in held)
    if not isinstance(value, torch.Tensor) or value.numel() != numel or not value.is_floating_point():
        got = f"{value.numel()} elements" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{what}: this rank holds {numel} elements of the parameter; the value must be a "
                         f"floating-point tensor of that many, got {got}")
    if not torch.isfinite(value).all():
        raise ValueError(f"{what}: the value has inf or NaN elements")
    return value.detach().reshape(-1).to("cpu", torch.float32)


def _concat(pieces: list[torch.Tensor], parts: EngineParts) -> torch.Tensor:
    if not pieces:
        return torch.zeros(0, dtype=torch.float32, device=parts.device)
    return torch.cat([p.reshape(-1).to("cpu", torch.float32) for p in pieces]).to(parts.device)


# -- gradients --------------------------------------------------------------------------------------------------
def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace param's gradient (as safe_get_full_grad returns it) with value, of its full shape: the next step
    clips and applies it. Every rank calls it with the same value."""
    parts = param_views.parts_of(param)
    what = "safe_set_full_grad"
    scale = _grad_scale(parts, what)
    flat = param_views._checked_value(parts, param, value, what)
    _write_grads(parts, _held(parts, param, what), flat, 0, scale)


def safe_update_full_grad_vectorized(param_list: list[torch.nn.Parameter], update_func) -> None:
    """DeepSpeed's vectorised gradient edit: for each trainable parameter with a gradient, its full gradient becomes
    update_func(full_gradient, param) (of the same shape; param as the module holds it, empty at stage 3 at rest).
    Frozen parameters are passed over. A collective: every rank calls it with the same list and function."""
    for param in param_list:
        if not param.requires_grad:
            continue
        grad = param_views.safe_get_full_grad(param)
        if grad is not None:
            safe_set_full_grad(param, update_func(grad, param))


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's part of param's gradient, 1-D fp32 (see the module docstring)."""
    parts = param_views.parts_of(param)
    what = "safe_get_local_grad"
    _partitioned(parts, what)
    scale = _grad_scale(parts, what)
    held = _held(parts, param, what)
    return _concat([chunk.grad[at:at + n].float() * scale for _, _, _, _, chunk, at, n in held], parts)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's part of param's gradient with value (as safe_get_local_grad returned it)."""
    parts = param_views.parts_of(param)
    what = "safe_set_local_grad"
    _partitioned(parts, what)
    scale = _grad_scale(parts, what)
    held = _held(parts, param, what)
    flat = _local_value(held, value, what)
    _write_grads(parts, held, flat, held[0][0] if held else 0, scale)


def _write_grads(parts: EngineParts, held: list[tuple], flat: torch.Tensor, first: int, scale: float) -> None:
    """Each part's gradient from flat (flat[0] is the parameter's element `first`), divided by the buffers' scale.
    Gradients the offloaded step copied to the host during backward are copied again at the step."""
    if parts.host_step is not None:
        parts.host_step.invalidate()
    with torch.no_grad():
        for start, _, _, _, chunk, at, numel in held:
            target = chunk.grad[at:at + numel]
            target.copy_((flat[start - first:start - first + numel] / scale).to(target.device, target.dtype))


# -- fp32 values and optimizer state ------------------------------------------------------------------------------
def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's part of param's fp32 master, 1-D."""
    parts = param_views.parts_of(param)
    what = "safe_get_local_fp32_param"
    _partitioned(parts, what)
    parts.residency.require(what, reads=("hp_params",))
    return _concat([parts.store.read(piece) for _, _, _, piece, _, _, _ in _held(parts, param, what)], parts)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's part of param's fp32 master (a collective: the working copies follow, as after a load)."""
    parts = param_views.parts_of(param)
    what = "safe_set_local_fp32_param"
    _partitioned(parts, what)
    parts.residency.require(what, reads=("hp_params", "lp_params"))
    held = _held(parts, param, what)
    flat, offset = _local_value(held, value, what), 0
    for _, _, _, piece, _, _, numel in held:
        parts.store.write(piece, param_views._placed(parts, piece, flat[offset:offset + numel]))
        offset += numel
    param_views._working_from_masters(parts)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    """This rank's part of param's optimizer state `optim_state_key` ("exp_avg", ...), 1-D fp32."""
    parts = param_views.parts_of(param)
    what = f"safe_get_local_optimizer_state(p, {optim_state_key!r})"
    _partitioned(parts, what)
    parts.residency.require(what, reads=("optim_states",))
    states = [_state(parts, gi, pi, piece, optim_state_key, what)
              for _, gi, pi, piece, _, _, _ in _held(parts, param, what)]
    return _concat([parts.store.read(s, optim_state_key) for s in states], parts)


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's part of param's optimizer state `optim_state_key`."""
    parts = param_views.parts_of(param)
    what = f"safe_set_local_optimizer_state(p, v, {optim_state_key!r})"
    _partitioned(parts, what)
    parts.residency.require(what, reads=("optim_states",))
    held = _held(parts, param, what)
    flat, offset = _local_value(held, value, what), 0
    for _, gi, pi, piece, _, _, numel in held:
        target = _state(parts, gi, pi, piece, optim_state_key, what)
        parts.store.write(target, param_views._placed(parts, target, flat[offset:offset + numel]), optim_state_key)
        offset += numel


def _state(parts: EngineParts, gi: int, pi: int, piece: torch.Tensor, key: str, what: str) -> torch.Tensor:
    keys = param_views._per_element_keys(parts, gi, pi, piece)
    if key not in keys:
        raise ValueError(f"{what}: the optimizer ({type(parts.optimizer).__name__}) has no per-element state "
                         f"{key!r} for this parameter (it has {sorted(keys) or 'none'}; none before the first step "
                         f"for most optimizers)")
    return keys[key]
