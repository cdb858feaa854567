"""Buffers whose memory comes and goes while the tensor object stays: views taken of it (a parameter's .grad, the
optimizer's chunks, what autograd saved) stay the same objects and see the values again once it is restored.

    python -c "import torch; from zkern.core.buffers import *; t = torch.ones(4); release(t); restore(t); print(t)"

Depends on torch alone.
"""

from __future__ import annotations

import torch


def release(t: torch.Tensor) -> None:
    """Free t's memory: its storage holds zero bytes until restore (reading it before then is an error)."""
    t.untyped_storage().resize_(0)


def restore(t: torch.Tensor, *, zero: bool) -> None:
    """Give t's storage its bytes back (uninitialised, or zeroed with zero); nothing if it has them."""
    nbytes = (t.storage_offset() + t.numel()) * t.element_size()
    if t.untyped_storage().nbytes() < nbytes:
        t.untyped_storage().resize_(nbytes)
        if zero:
            t.zero_()


def is_released(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


def allocated_bytes(tensors) -> int:
    """Bytes of the distinct allocations behind tensors: a storage that several of them view counts once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
