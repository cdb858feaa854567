"""Stage 3's whole tensors, one unit at a time: the fp32 weights of full_state_dict, the working-dtype weights of
save_16bit_model and the reduced gradients the tests compare (collectives: every rank calls them).

    python -m pytest tests/stage3/test_stage3.py -q -k full
"""

from __future__ import annotations

import torch

from zkern.comm.whole import WholeBucket, gather_whole
from zkern.stage3.reduce import GradReducer
from zkern.stage3.shards import Shards


def full_fp32(s: Shards, rank0_only: bool, only: set[int] | None = None) -> dict[int, torch.Tensor] | None:
    """id(parameter) -> fp32 value (collective; None off rank 0 with rank0_only). Trained parameters come from the
    fp32 master; frozen ones from the working shard they live in (the master's copy of them is never stepped, and
    a checkpoint keeps them in the working dtype: reading the master would give a value that differs with where
    the run was loaded from)."""
    source = s.master if s.master is not None else s.param_shard
    keep = not rank0_only or s.comm.rank == 0
    values = whole(s, source, torch.float32, "fp32 weights for full_state_dict", keep, only=only)
    # (without a working shard the master's frozen elements hold working-dtype values: layout.partition)
    if s.master is not None and s.param_shard is not None and any(not p.requires_grad for p in s.all_params):
        frozen = whole(s, s.param_shard, torch.float32, "frozen weights for full_state_dict", keep,
                       frozen_only=True, only=only)
        if keep:
            values.update({k: v for k, v in frozen.items() if k in s.frozen_ids})
    return values if keep else None


def full_working(s: Shards, rank0_only: bool = False) -> dict[int, torch.Tensor] | None:
    """id(parameter) -> value in the working dtype (collective; None off rank 0 with rank0_only, which then
    holds one unit at a time), for saving 16-bit weights."""
    keep = not rank0_only or s.comm.rank == 0
    values = whole(s, s.source, s.dtype, "weights in the working dtype", keep)  # cast as a gather casts
    return values if keep else None


def full_grads(s: Shards, reducer: GradReducer, only: set[int] | None = None) -> dict[int, torch.Tensor]:
    """id(trainable parameter) -> the reduced gradient as the optimizer reads it (see Stage12Runtime)."""
    reducer.ensure_grads()  # freed since the last step: zeros
    grads = whole(s, s.grad_shard, s.grad_shard.dtype, "reduced gradients", True, trainable_only=True, only=only)
    return {k: v for k, v in grads.items() if k in {id(p) for p in s.params}}


def whole(s: Shards, source: torch.Tensor, dtype: torch.dtype, purpose: str, keep: bool,
          trainable_only: bool = False, frozen_only: bool = False, only: set[int] | None = None) -> dict:
    """Every unit whole from `source` shards (int8-resting units from their codes), one unit at a time
    (offloaded sources are copied up); only units with trainable (or frozen) parameters where asked."""
    units = [u for u in s.units if (u.trainable or not trainable_only)
             and (not frozen_only or u.trainable < len(u.plan.params))]
    buckets = [WholeBucket(u.bucket.chunk, tuple((id(p), s.offsets[id(p)], s.full_shapes[id(p)])
                                                 for p in u.plan.params)) for u in units]

    def chunk_of(i: int) -> torch.Tensor:
        u = units[i]
        return s.store.read_unit(u.index, source[u.bucket.shard_offset:u.bucket.shard_offset + u.bucket.chunk], dtype)

    return gather_whole(s.comm, s.comm.world, buckets, chunk_of, dtype, s.empty.device, purpose, keep, only)
