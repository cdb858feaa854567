"""The attributes DeepSpeed's ZeRO-3 puts on every partitioned parameter, which the frameworks built on it read:
`ds_id`, `ds_shape`, `ds_numel`, `ds_tensor` (this rank's partition of it) and `ds_status` (AVAILABLE,
NOT_AVAILABLE or INFLIGHT: whether the parameter is whole on this rank now). OpenRLHF gathers only the parameters
not available, LLaMA-Factory counts parameters with `ds_numel` (0 of them without it), axolotl and others test
`hasattr(p, "ds_id")`.

    python -m pytest tests/engine/test_engine_frameworks.py -q -k ds_attributes

`ds_status` compares equal to DeepSpeed's own `ZeroParamStatus` where a script imported deepspeed before building
the engine (it is then DeepSpeed's enum), else to zkern's `ZeroParamStatus` below, with the same names and values.
"""

from __future__ import annotations

import enum
import sys

import torch


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # whole on this rank
    NOT_AVAILABLE = 2  # at rest: only this rank's partition exists
    INFLIGHT = 3  # an all-gather of it is on its way


def status_enum():
    """DeepSpeed's ZeroParamStatus when deepspeed is already imported (frameworks compare with it), else zkern's."""
    if "deepspeed" in sys.modules:
        try:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as theirs

            return theirs
        except ImportError:
            pass
    return ZeroParamStatus


def mark(params, status: str) -> None:
    """Set ds_status of params to the member named status ("AVAILABLE", ...)."""
    value = getattr(status_enum(), status)
    for p in params:
        p.ds_status = value


def attach(rt, gathered: set[int]) -> None:
    """The static attributes of every parameter a Stage3Runtime partitions, and its status: AVAILABLE for the units
    whose index is in `gathered` (whole now), NOT_AVAILABLE for the rest."""
    shard = rt.param_shard
    rank = rt.comm.rank
    for index, p in enumerate(rt.all_params):
        shape = rt._full_shape[id(p)]
        p.ds_id = index
        p.ds_shape = shape
        p.ds_numel = shape.numel()
        p.ds_tensor = _partition(rt, p, shape.numel(), rank, shard)
    for u in rt.units:
        mark(u.plan.params, "AVAILABLE" if u.index in gathered else "NOT_AVAILABLE")


def _partition(rt, p: torch.nn.Parameter, numel: int, rank: int, shard: torch.Tensor) -> torch.Tensor:
    """This rank's elements of p in its working shard (empty when its chunk holds none of them, or the shard rests
    in a file or as int8 codes: then a meta tensor of that length)."""
    u = rt._unit_of[id(p)]
    b = u.bucket
    off = rt._offset[id(p)]
    lo, hi = max(off, rank * b.chunk), min(off + numel, (rank + 1) * b.chunk)
    n = max(0, hi - lo)
    start = b.shard_offset + lo - rank * b.chunk if n else b.shard_offset
    if rt.store.in_files(shard) or rt.store.in_int8(u.index):
        return torch.empty(n, dtype=shard.dtype, device="meta")
    return shard[start:start + n]
