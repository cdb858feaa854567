"""Whole tensors from the ranks' shards, one bucket at a time: the fp32 weights (full_state_dict), the 16-bit
weights (save_16bit_model) and the reduced gradients, for stages 0-2 (flat buckets) and 3 (fetch units) alike.

    python -m pytest tests/engine/test_engine.py -q -k state_dict

A bucket (a stage 0-2 flat bucket, or a stage 3 unit) is padded to world equal chunks, rank r holding
chunk r; gathering the chunks gives the bucket whole, and each tensor in it is a slice at a known offset. One
bucket is whole at a time on the device, and what is kept is copied to host memory bucket by bucket, so gathering a
model never holds more than the largest bucket on a GPU (rank 0 never builds the whole model there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zkern.comm.collectives import Comm


@dataclass(frozen=True)
class WholeBucket:
    chunk: int  # elements each rank holds
    entries: tuple[tuple[int, int, torch.Size], ...]  # (key, offset in the whole bucket, shape) per tensor


def gather_whole(comm: Comm, world: int, buckets: list[WholeBucket], chunk_of: Callable[[int], torch.Tensor],
                 dtype: torch.dtype, device: torch.device, purpose: str, keep: bool = True,
                 only: set[int] | None = None) -> dict[int, torch.Tensor]:
    """key -> the whole tensor in `dtype` (a collective over `world` ranks; world 1 copies). chunk_of(i) is this
    rank's chunk of bucket i, wherever it lives (a host shard is copied up first); what is kept is on the host.
    keep=False gathers (every rank must take part) and keeps nothing. only: these keys alone, gathering just the
    buckets that hold them (every rank must pass the same set)."""
    values: dict[int, torch.Tensor] = {}
    for i, bucket in enumerate(buckets):
        if only is not None and not any(key in only for key, _, _ in bucket.entries):
            continue
        mine = chunk_of(i).to(device, dtype)
        if world == 1:
            data = mine
        else:
            data = torch.empty(bucket.chunk * world, dtype=dtype, device=device)
            comm.all_gather(data, mine, f"{purpose}, bucket {i}")
        if keep:
            host = data.cpu()  # one copy down per bucket (the same tensor where it is on the host already)
            for key, offset, shape in bucket.entries:
                if only is not None and key not in only:
                    continue
                values[key] = host[offset:offset + shape.numel()].clone().view(shape)
    return values
