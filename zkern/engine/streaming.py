"""Whole weights out of a training engine in bounded memory, bucket by bucket: what an RL trainer sends to its
inference engine after each update (engine.stream_full_weights).

    for bucket in engine.stream_full_weights(bucket_bytes=256 << 20):   # every rank, in lockstep
        for name, tensor in bucket:                                       # model.state_dict()'s names
            inference_engine.load_weight(name, tensor)

Parameters come in the model's own order, gathered one stage-3 unit at a time (exact: never from qwZ's int8 or
hpZ's secondary copy), cast to `dtype` (default the working dtype: what the forward computes with), into buckets
of at most bucket_bytes (a parameter larger than that comes alone). A rank holds at most one bucket and one gathered
unit beyond what it holds anyway; a tensor tied under two names is one tensor, listed under both. It is a
collective: every rank iterates to the end (with rank0_only, the others get empty buckets and gather in step); a
rank that stops early leaves the others in a gather, which ends them with a CommError after comm_timeout_s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from zkern.core.buffers import aligned_copy
from zkern.engine.parts import EngineParts
from zkern.stage3.gathered import GatheredParameters


def stream_full_weights(parts: EngineParts, bucket_bytes: int, dtype: torch.dtype | None, rank0_only: bool,
                        on: Callable[[list], None] | None):
    if bucket_bytes < 1:
        raise ValueError(f"stream_full_weights: bucket_bytes must be at least 1, got {bucket_bytes}")
    stream = _buckets(parts, bucket_bytes, dtype or parts.dtype, rank0_only)
    if on is None:
        return stream
    for bucket in stream:
        on(bucket)
    return None


def _groups(parts: EngineParts) -> list[list[torch.nn.Parameter]]:
    """Parameters in the order they are gathered: stage 3 unit by unit, otherwise one at a time."""
    runtime = parts.runtime
    if parts.config.zero_optimization.stage == 3:
        return [list(u.plan.params) for u in runtime.units]
    return [[p] for p in parts.module.parameters()]


def _buckets(parts: EngineParts, bucket_bytes: int, dtype: torch.dtype, rank0_only: bool) -> Iterator[list]:
    # a delayed update in flight is in what streams (the trained weights), and out of the forward's again after
    with parts.store.landed_view():
        yield from _landed_buckets(parts, bucket_bytes, dtype, rank0_only)


def _landed_buckets(parts: EngineParts, bucket_bytes: int, dtype: torch.dtype, rank0_only: bool) -> Iterator[list]:
    keep = not rank0_only or parts.rank == 0
    names: dict[int, list[str]] = {}
    with parts.runtime.unguarded():
        for name, p in parts.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
    stage3 = parts.config.zero_optimization.stage == 3
    bucket, size = [], 0
    for params in _groups(parts):
        with GatheredParameters(params) if stage3 else contextlib.nullcontext():
            for p in params:
                nbytes = p.numel() * dtype.itemsize
                if bucket and size + nbytes > bucket_bytes:
                    yield bucket if keep else []
                    bucket, size = [], 0
                value = aligned_copy(p.detach(), p.device, dtype) if keep else None
                bucket += [(name, value) for name in names.get(id(p), [])]
                size += nbytes
    if bucket:
        yield bucket if keep else []

