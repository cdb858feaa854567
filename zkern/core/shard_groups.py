"""What an optimizer steps on a rank: its shard of each param group as pieces (one per parameter part it owns) and
chunks (one per bucket: contiguous master, gradient and working-copy ranges). The stage runtimes build them; the
optimizers (optim/), the host step (offload/) and the engine read them, so they live here, below all of those.

    python -m pytest tests/optim/test_optimizers.py -q
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Chunk:
    """One bucket chunk this rank steps: contiguous fp32 params, gradients, and optional low-precision copy."""

    param: torch.Tensor  # fp32, (chunk,)
    grad: torch.Tensor  # working dtype, (chunk,)
    out: torch.Tensor | None  # working-dtype parameter chunk to refresh (mixed precision), else None
    pieces: list[tuple[int, int, int]]  # (piece index within its group, start within chunk, numel)
    # partial offload (offload/partial.py): the chunk's master and moments stay on the device and it steps there, in
    # place; the host step stages only the others
    on_device: bool = False


def shares_staging(chunk: Chunk) -> bool:
    """Whether a chunk's parameter staging is its gradient's (offload's HostStep shares one host buffer): then it
    holds no working copy between steps, and a write of the working copies (a load, a weight set) must pass it by,
    or it would overwrite gradients copied down in a backward whose step has not run yet."""
    return chunk.out is not None and chunk.out is chunk.grad


@dataclass
class ShardGroup:
    """The shard pieces and chunks of one optimizer param group."""

    pieces: list[torch.Tensor]  # the optimizer's params, in shard order
    chunks: list[Chunk]


def working_pieces(group: ShardGroup) -> list[torch.Tensor | None]:
    """Each piece's range of its chunk's working copy (1-D), in piece order; None where the chunk has none."""
    out: list[torch.Tensor | None] = [None] * len(group.pieces)
    for chunk in group.chunks:
        for index, start, numel in chunk.pieces:
            out[index] = None if chunk.out is None else chunk.out[start:start + numel]
    return out
