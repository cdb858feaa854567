"""Partial optimizer offload (offload_optimizer.ratio < 1, DeepSpeed's Twin-Flow): about `ratio` of each rank's
optimizer shard (fp32 master, moments, their step) on the host, the rest on the device.

    python -m pytest tests/offload/test_partial.py -q

The fp32 master shard is a SplitShard (store.py): its elements before the split rest on the device, the rest on the
host. The split falls where one piece of a parameter ends and the next begins, the boundary nearest (1 - ratio) of
the shard, so every optimizer piece lies in one part. The shard's earliest elements stay on the device: backward
lands the last layers' gradients first, so the host part's copies down start early. Chunks that straddle the
split are cut in two at it; the device chunks are marked `on_device` and stepped in place in step(), with their
moments on the device, while HostStep stages and steps the host chunks as under full offload. A model of few
large parameters splits coarsely: the start-up line says the share the split gives.
"""

from __future__ import annotations

from zkern.core.shard_groups import Chunk


def split_point(numel: int, ratio: float, pieces: list[tuple[int, int]]) -> int:
    """Where a shard of numel elements splits for `ratio` of it on the host: the piece boundary nearest
    (1 - ratio) * numel (pieces: each optimizer piece's (start, end) in the shard; the shard's ends count too)."""
    target = (1.0 - ratio) * numel
    bounds = {0, numel} | {a for a, _ in pieces} | {b for _, b in pieces}
    return min(bounds, key=lambda c: (abs(c - target), c))


def place_chunks(chunks: list[Chunk], store) -> list[Chunk]:
    """The chunks of a shard group whose params are ranges of a split master's stand-in, as the optimizer steps
    them: cut at the split where one straddles it, each param the real tensor of its part, the device ones marked
    on_device. Chunks of any other master are returned as they are."""
    out = []
    for c in chunks:
        split = store.split_of(c.param)
        if split is None:
            out.append(c)
            continue
        first = c.param.storage_offset()
        cut = split.split - first
        ranges = [(0, cut), (cut, c.param.numel())] if 0 < cut < c.param.numel() else [(0, c.param.numel())]
        for lo, hi in ranges:
            pieces = [(index, start - lo, numel) for index, start, numel in c.pieces if lo <= start < hi]
            if any(start + numel > hi - lo for _, start, numel in pieces):
                raise ValueError("place_chunks: a piece straddles the split (split_point chooses piece boundaries)")
            out.append(Chunk(param=split.resident(c.param[lo:hi]), grad=c.grad[lo:hi],
                             out=None if c.out is None else c.out[lo:hi], pieces=pieces,
                             on_device=first + lo < split.split))
    return out


def host_share(chunks: list[Chunk]) -> tuple[int, int]:
    """(elements stepped on the device, elements on the host) over chunks."""
    device = sum(c.param.numel() for c in chunks if c.on_device)
    return device, sum(c.param.numel() for c in chunks) - device
