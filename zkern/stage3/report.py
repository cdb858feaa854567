"""What a stage-3 runtime holds and says: its state components for the engine's registry, memory by kind, and the
start-up lines about its layout.

    python -m pytest tests/core/test_state.py tests/engine/test_reporting.py -q
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zkern.comm.collectives import Comm
from zkern.comm.zeropp import QuantizedReduce
from zkern.core.state import Component, host_copy
from zkern.offload.store import ShardStore
from zkern.stage3.reduce import GradReducer
from zkern.stage3.shards import Shards


def state_components(s: Shards, reducer: GradReducer, quantized: QuantizedReduce | None,
                     zero_grad: Callable[[], None]) -> list[Component]:
    """This runtime's state for the engine's registry: the shards (weights), the gradient shard and reduction
    buffers (transient), the gathered copies and hpZ's slices (derived from the shards), LoCo's errors."""

    def weights() -> dict:
        return host_copy({"param_shard": None if s.param_shard is None else s.store.read(s.param_shard),
                          "master": None if s.master is None else s.store.read(s.master),
                          "frozen_int8": None if s.store.int8 is None else s.store.int8.store})

    def gradients() -> dict:
        r = reducer
        shard = s.grad_shard if r.micro_since_step and r.grads_live else torch.zeros_like(s.grad_shard)
        return host_copy({"grad_shard": shard, "used": list(r.used)})

    def derived() -> list[torch.Tensor]:
        # each unit's gather slot (its storage empty at rest) and any buffer that is not it
        out = [u.slot for u in s.units if u.slot is not None]
        out += [u.buffer for u in s.units if u.buffer is not None and u.buffer is not u.slot]
        if s.secondary is not None:
            out.append(s.secondary.store)
        if s.param_store is not None:
            out += s.param_store.cached_tensors()
        return out

    out = [
        Component("stage3.weights", "weights", snapshot=weights,
                  tensors=lambda: [t for t in (s.param_shard, s.master, s.empty,
                                               s.store.int8.store if s.store.int8 is not None else None)
                                   if t is not None] + s.store.split_parts(s.master) + list(s.all_params)),
        Component("stage3.gradients", "transient", reset=zero_grad, snapshot=gradients,
                  tensors=lambda: [s.grad_shard,
                                   *(g.buffer for g in reducer.groups if g.buffer is not None),
                                   *(p.grad for p in s.params if p.grad is not None)]),
        Component("stage3.gathered", "derived", reset=lambda: forget_derived(s), tensors=derived),
    ]
    if quantized is not None:
        out += quantized.state_components()
    return out


def forget_derived(s: Shards) -> None:
    """hpZ's secondary slices no longer stand for the shards (a load wrote them)."""
    if s.secondary is not None:
        s.secondary.versions.clear()


def memory(s: Shards, reducer: GradReducer, quantized: QuantizedReduce | None) -> dict[str, int]:
    nbytes = ShardStore.resident_bytes
    persistent = sum(nbytes(u.buffer) for u in s.units if u.persistent)
    live = sum(nbytes(u.buffer) for u in s.units if not u.persistent)
    frozen = s.store.int8.memory() if s.store.int8 is not None else {}
    if s.params_on_host:  # the int8 shards rest where the others do
        frozen = {f"host_{k}": v for k, v in frozen.items()}
    shard, disk = nbytes(s.param_shard), {}
    if s.param_store is not None:  # the file, and the chunks cached in host memory
        shard, disk = s.param_store.cache_bytes(), {"disk_params": s.param_store.nbytes}
    on_device, on_host = s.store.split_bytes(s.master)  # partial offload's two parts
    return {"params": shard + persistent, "grads": nbytes(s.grad_shard),
            "master": nbytes(s.master) + on_host, "master_on_device": on_device,
            "comm_buffers": live + reducer.buffer_bytes(),
            "host_params": shard if s.params_on_host else 0, **disk,
            **frozen, **(s.secondary.memory() if s.secondary is not None else {}),
            **(quantized.memory() if quantized is not None else {})}


def describe(s: Shards) -> list[str]:
    persistent = sum(u.plan.numel for u in s.units if u.persistent)
    lines = []
    if s.store.int8 is not None:
        int8 = sum(u.plan.numel for u in s.units if u.index in s.store.int8)
        mixed = sum(s.full_shapes[id(p)].numel() for p in s.all_params if not p.requires_grad) - int8
        lines.append(f"zero_quantized_nontrainable_weights: {int8} elements of {len(s.store.int8.chunks)} units "
                     f"with nothing to train rest as int8 ({s.store.int8.memory()['frozen_int8']} bytes per rank)"
                     + (f"; {mixed} frozen elements share a unit with trainable parameters or are in the "
                        f"persistent unit and stay in {s.dtype}" if mixed else ""))
    return lines + [f"stage 3: {len(s.units)} fetch units over {len(s.all_params)} parameters "
                    f"({s.layout.numel} elements), padded with {s.layout.padding} zero elements to a shard "
                    f"of {s.layout.shard_numel} per rank; {persistent} elements in small units stay whole on "
                    f"every rank"]


def warnings(comm: Comm, reducer: GradReducer, reduce_bucket_size: int) -> list[str]:
    groups = reducer.groups
    if comm.world > 1 and len(groups) == 1 and len(groups[0].units) > 1:
        n = groups[0].section * comm.world
        return [f"stage 3 with one gradient bucket: reduce_bucket_size ({reduce_bucket_size}) covers all {n} "
                f"trainable elements, so gradients are reduced only when backward ends, from a buffer as large "
                f"as the whole gradient. Set zero_optimization.reduce_bucket_size well below {n} (\"auto\" = "
                f"hidden_size**2) to reduce during backward and keep memory at the shard."]
    return []
