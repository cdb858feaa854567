"""A FlatGroup's tensors read whole, its fp32 master written, and what it holds: for full_state_dict, the state
registry, GatheredParameters and memory_report.

    python -m pytest tests/engine/test_engine_api.py tests/core/test_state.py -q
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zkern.comm.whole import WholeBucket, gather_whole
from zkern.offload.store import ShardStore

if TYPE_CHECKING:
    from zkern.stage12.flat_group import FlatGroup


def whole(g: FlatGroup, what: str, keep: bool, only: set[int] | None = None) -> dict[int, torch.Tensor]:
    """id(parameter) -> whole value (collective where shards must be gathered): "fp32" weights, "working"
    weights, or the reduced "grads" as the optimizer reads them (loss-scaled, summed over ranks). Parameters
    are whole on every rank at stages 0-2, so only the fp32 master and the gradient shards are gathered. only: these
    parameters' buckets alone (every rank the same set)."""
    device = g.param_flat.device
    match what:
        case "fp32" if g.master is not None:
            return gather_whole(g.comm, g.shard_world, whole_buckets(g, False),
                                lambda i: master_chunk(g, i), torch.float32, device,
                                "fp32 weights", keep, only)
        case "fp32" | "working":
            dtype = torch.float32 if what == "fp32" else g.dtype
            return gather_whole(g.comm, 1, whole_buckets(g, True), lambda i: bucket_of(g, g.param_flat, i),
                                dtype, device, f"{what} weights", keep, only)
        case "grads" if not g.grads_live:  # freed since the last step: every gradient is zero
            g.ensure_grads()
            return whole(g, what, keep, only)
        case "grads" if g.stage == 0:
            return gather_whole(g.comm, 1, whole_buckets(g, True), lambda i: bucket_of(g, g.grad_flat, i),
                                g.accum_dtype, device, "gradients", keep, only)
        case "grads":
            return gather_whole(g.comm, g.shard_world, whole_buckets(g, False),
                                lambda i: g.grad_chunk(g.layout.buckets[i]), g.accum_dtype, device,
                                "reduced gradients", keep, only)
        case _:
            raise ValueError(f"whole() takes 'fp32', 'working' or 'grads', got {what!r}")


def whole_buckets(g: FlatGroup, whole: bool) -> list[WholeBucket]:
    """Each bucket's tensors and where they lie in it; chunk: what each rank contributes (the whole padded
    bucket where nothing needs gathering)."""
    return [WholeBucket(b.padded if whole else b.chunk,
                        tuple((id(g.params[i]), g.layout.offsets[i] - b.offset, g.params[i].shape)
                              for i in range(b.first, b.last))) for b in g.layout.buckets]


def bucket_of(g: FlatGroup, flat: torch.Tensor, i: int) -> torch.Tensor:
    b = g.layout.buckets[i]
    return flat[b.offset:b.offset + b.padded]


def master_chunk(g: FlatGroup, i: int) -> torch.Tensor:
    """Bucket i's chunk of the fp32 master (read from disk when it is there)."""
    chunk = g.master[shard_slice(g, i)]
    return g.store.read(chunk)


def shard_slice(g: FlatGroup, i: int) -> slice:
    b = g.layout.buckets[i]
    return slice(b.shard_offset, b.shard_offset + b.chunk)


def write_modified(comm, store, index: dict, pinned: list, modifier_rank: int, before_landing=None) -> None:
    """A GatheredParameters context with a modifier rank ends: that rank's values reach every rank's copy, and the
    elements it changed the fp32 masters. pinned: (parameter, its values when the context began); index: id(p) ->
    (group, parameter index). Where nothing changed, nothing is written (a delayed update in flight stays so).
    before_landing: called once the changes are known, before a delayed update lands (store.trained_view's close)."""
    with torch.no_grad():
        edits = []
        for p, before in pinned:
            comm.broadcast(p.data, f"GatheredParameters: a parameter modified on rank {modifier_rank}",
                           src=modifier_rank)
            new = p.detach().clone()  # a copy: a landing below refreshes p from the shards
            edits.append((p, new, (new != before) & ~(new.isnan() & before.isnan())))
        # every rank sees the same broadcast values, so every rank reaches the same answer without a collective
        if before_landing is not None:
            before_landing()
        if not any(changed.any() for _, _, changed in edits):
            return
        store.land_update()  # its weights must not arrive over the write
        for p, new, changed in edits:
            p.data.copy_(torch.where(changed, new, p.detach()))
            if id(p) in index:
                g, i = index[id(p)]
                write_master(g, i, changed)


def write_master(g: FlatGroup, i: int, changed: torch.Tensor) -> None:
    """Parameter i's working values were written (GatheredParameters with a modifier rank; `changed`: which of its
    elements the context changed): those take the new value in this rank's fp32 master pieces."""
    if g.master is None:  # fp32 without offload: the flat parameter buffer is the master
        return
    new = g.params[i].detach().reshape(-1)
    changed = changed.reshape(-1)
    for piece in g.pieces:
        if piece.param != i:
            continue
        lo, hi = piece.param_start, piece.param_start + piece.numel
        region = g.master[piece.shard_start:piece.shard_start + piece.numel]
        master = g.store.read(region)
        merged = torch.where(changed[lo:hi].to(master.device), new[lo:hi].to(master.device, master.dtype),
                             master)
        g.store.write(region, merged)


def master_values(g: FlatGroup) -> torch.Tensor | None:
    """The fp32 master shard's values (read from its files when on NVMe), or None in fp32 without offload."""
    if g.master is None:
        return None
    return g.store.read(g.master)


def grad_values(g: FlatGroup) -> dict:
    """The accumulated gradient as the next step would read it (stage 2's shard only counts once a
    micro-step has been folded into it since the last step)."""
    if g.grad_shard is not None:
        shard = g.grad_shard if g._micro_since_step and g.grads_live else torch.zeros_like(g.grad_shard)
        return {"grad_shard": shard, "used": list(g.used)}
    return {"grad_flat": g.grad_flat if g.grads_live else torch.zeros_like(g.grad_flat), "used": list(g.used)}


def weight_tensors(g: FlatGroup) -> list[torch.Tensor]:
    return [t for t in (g.param_flat, g.master) if t is not None] + g.store.split_parts(g.master) + list(g.params)


def grad_tensors(g: FlatGroup) -> list[torch.Tensor]:
    grads = [t for t in (g.grad_flat, g.grad_shard) if t is not None]
    return grads + list(g._grad_views or ()) + [p.grad for p in g.params if p.grad is not None]


def scratch_tensors(g: FlatGroup) -> list[torch.Tensor]:
    """Stage 2's bucket buffers: filled and reduced within one backward."""
    return [*g._free_buffers, *g._open.values(), *g.reducer.held()]


def memory(g: FlatGroup) -> dict[str, int]:
    nbytes = ShardStore.resident_bytes
    grads = nbytes(g.grad_flat) + nbytes(g.grad_shard)
    buffers = g._buffer_count * g._bucket_capacity * g.comm_dtype.itemsize
    on_device, on_host = g.store.split_bytes(g.master)  # partial offload's two parts
    return {"params": nbytes(g.param_flat), "grads": grads, "master": nbytes(g.master) + on_host,
            "master_on_device": on_device, "comm_buffers": buffers}
