"""What a stage-3 runtime holds and says: its state components for the engine's registry, memory by kind, and the
start-up lines about its layout.

    python -m pytest tests/core/test_state.py tests/engine/test_reporting.py -q
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zkern.core.state import Component, host_copy
from zkern.offload.store import ShardStore

if TYPE_CHECKING:
    from zkern.stage3.runtime import Stage3Runtime


def state_components(rt: Stage3Runtime) -> list[Component]:
    """This runtime's state for the engine's registry: the shards (weights), the gradient shard and reduction
    buffers (transient), the gathered copies and hpZ's slices (derived from the shards), LoCo's errors."""

    def weights() -> dict:
        return host_copy({"param_shard": rt.store.read(rt.param_shard),
                          "master": None if rt.master is None else rt.store.read(rt.master),
                          "frozen_int8": None if rt.store.int8 is None else rt.store.int8.store})

    def gradients() -> dict:
        r = rt.reducer
        shard = rt.grad_shard if r.micro_since_step and r.grads_live else torch.zeros_like(rt.grad_shard)
        return host_copy({"grad_shard": shard, "used": list(r.used)})

    def derived() -> list[torch.Tensor]:
        # each unit's gather slot (its storage empty at rest) and any buffer that is not it
        out = [u.slot for u in rt.units if u.slot is not None]
        out += [u.buffer for u in rt.units if u.buffer is not None and u.buffer is not u.slot]
        if rt.secondary is not None:
            out.append(rt.secondary.store)
        if rt.param_store is not None:
            out += rt.param_store.cached_tensors()
        return out

    out = [
        Component("stage3.weights", "weights", snapshot=weights,
                  tensors=lambda: [t for t in (rt.param_shard, rt.master, rt._empty,
                                               rt.store.int8.store if rt.store.int8 is not None else None)
                                   if t is not None] + list(rt.all_params)),
        Component("stage3.gradients", "transient", reset=rt.zero_grad, snapshot=gradients,
                  tensors=lambda: [rt.grad_shard,
                                   *(g.buffer for g in rt.reducer.groups if g.buffer is not None),
                                   *(p.grad for p in rt.params if p.grad is not None)]),
        Component("stage3.gathered", "derived", reset=lambda: forget_derived(rt), tensors=derived),
    ]
    if rt.quantized is not None:
        out += rt.quantized.state_components()
    return out


def forget_derived(rt: Stage3Runtime) -> None:
    """hpZ's secondary slices no longer stand for the shards (a load wrote them)."""
    if rt.secondary is not None:
        rt.secondary.versions.clear()


def memory(rt: Stage3Runtime) -> dict[str, int]:
    nbytes = ShardStore.resident_bytes
    persistent = sum(nbytes(u.buffer) for u in rt.units if u.persistent)
    live = sum(nbytes(u.buffer) for u in rt.units if not u.persistent)
    frozen = rt.store.int8.memory() if rt.store.int8 is not None else {}
    if rt.params_on_host:  # the int8 shards rest where the others do
        frozen = {f"host_{k}": v for k, v in frozen.items()}
    shard, disk = nbytes(rt.param_shard), {}
    if rt.param_store is not None:  # the file, and the chunks cached in host memory
        shard, disk = rt.param_store.cache_bytes(), {"disk_params": rt.param_store.nbytes}
    return {"params": shard + persistent, "grads": nbytes(rt.grad_shard),
            "master": nbytes(rt.master), "comm_buffers": live + rt.reducer.buffer_bytes(),
            "host_params": shard if rt.params_on_host else 0, **disk,
            **frozen, **(rt.secondary.memory() if rt.secondary is not None else {}),
            **(rt.quantized.memory() if rt.quantized is not None else {})}


def describe(rt: Stage3Runtime) -> list[str]:
    persistent = sum(u.plan.numel for u in rt.units if u.persistent)
    lines = []
    if rt.store.int8 is not None:
        int8 = sum(u.plan.numel for u in rt.units if u.index in rt.store.int8)
        mixed = sum(rt._full_shape[id(p)].numel() for p in rt.all_params if not p.requires_grad) - int8
        lines.append(f"zero_quantized_nontrainable_weights: {int8} elements of {len(rt.store.int8.chunks)} units "
                     f"with nothing to train rest as int8 ({rt.store.int8.memory()['frozen_int8']} bytes per rank)"
                     + (f"; {mixed} frozen elements share a unit with trainable parameters or are in the "
                        f"persistent unit and stay in {rt.dtype}" if mixed else ""))
    return lines + [f"stage 3: {len(rt.units)} fetch units over {len(rt.all_params)} parameters "
                    f"({rt.layout.numel} elements), padded with {rt.layout.padding} zero elements to a shard "
                    f"of {rt.layout.shard_numel} per rank; {persistent} elements in small units stay whole on "
                    f"every rank"]


def warnings(rt: Stage3Runtime, reduce_bucket_size: int) -> list[str]:
    groups = rt.reducer.groups
    if rt.comm.world > 1 and len(groups) == 1 and len(groups[0].units) > 1:
        n = groups[0].section * rt.comm.world
        return [f"stage 3 with one gradient bucket: reduce_bucket_size ({reduce_bucket_size}) covers all {n} "
                f"trainable elements, so gradients are reduced only when backward ends, from a buffer as large "
                f"as the whole gradient. Set zero_optimization.reduce_bucket_size well below {n} (\"auto\" = "
                f"hidden_size**2) to reduce during backward and keep memory at the shard."]
    return []
