"""Stage 3's whole tensors, one unit at a time: the fp32 weights of full_state_dict, the working-dtype weights of
save_16bit_model and the reduced gradients the tests compare (collectives: every rank calls them).

    python -m pytest tests/stage3/test_stage3.py -q -k full
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zkern.comm.whole import WholeBucket, gather_whole

if TYPE_CHECKING:
    from zkern.stage3.runtime import Stage3Runtime


def full_fp32(rt: Stage3Runtime, rank0_only: bool, only: set[int] | None = None) -> dict[int, torch.Tensor] | None:
    """id(parameter) -> fp32 value (collective; None off rank 0 with rank0_only). Trained parameters come from the
    fp32 master; frozen ones from the working shard they live in (the master's copy of them is never stepped, and
    a checkpoint keeps them in the working dtype: reading the master would give a value that differs with where
    the run was loaded from)."""
    source = rt.master if rt.master is not None else rt.param_shard
    keep = not rank0_only or rt.comm.rank == 0
    values = whole(rt, source, torch.float32, "fp32 weights for full_state_dict", keep, only=only)
    if rt.master is not None and any(not p.requires_grad for p in rt.all_params):
        frozen = whole(rt, rt.param_shard, torch.float32, "frozen weights for full_state_dict", keep,
                       frozen_only=True, only=only)
        if keep:
            values.update({k: v for k, v in frozen.items() if k in rt._frozen_ids})
    return values if keep else None


def full_working(rt: Stage3Runtime, rank0_only: bool = False) -> dict[int, torch.Tensor] | None:
    """id(parameter) -> value in the working dtype (collective; None off rank 0 with rank0_only, which then
    holds one unit at a time), for saving 16-bit weights."""
    keep = not rank0_only or rt.comm.rank == 0
    values = whole(rt, rt.param_shard, rt.dtype, "weights in the working dtype", keep)
    return values if keep else None


def full_grads(rt: Stage3Runtime, only: set[int] | None = None) -> dict[int, torch.Tensor]:
    """id(trainable parameter) -> the reduced gradient as the optimizer reads it (see Stage12Runtime)."""
    rt.reducer.ensure_grads()  # freed since the last step: zeros
    grads = whole(rt, rt.grad_shard, rt.grad_shard.dtype, "reduced gradients", True, trainable_only=True, only=only)
    return {k: v for k, v in grads.items() if k in {id(p) for p in rt.params}}


def whole(rt: Stage3Runtime, source: torch.Tensor, dtype: torch.dtype, purpose: str, keep: bool,
          trainable_only: bool = False, frozen_only: bool = False, only: set[int] | None = None) -> dict:
    """Every unit whole from `source` shards (int8-resting units from their codes), one unit at a time
    (offloaded sources are copied up); only units with trainable (or frozen) parameters where asked."""
    units = [u for u in rt.units if (u.trainable or not trainable_only)
             and (not frozen_only or u.trainable < len(u.plan.params))]
    buckets = [WholeBucket(u.bucket.chunk, tuple((id(p), rt._offset[id(p)], rt._full_shape[id(p)])
                                                 for p in u.plan.params)) for u in units]

    def chunk_of(i: int) -> torch.Tensor:
        u = units[i]
        return rt.store.read_unit(u.index, source[u.bucket.shard_offset:u.bucket.shard_offset + u.bucket.chunk], dtype)

    return gather_whole(rt.comm, rt.comm.world, buckets, chunk_of, dtype, rt._empty.device, purpose, keep, only)
