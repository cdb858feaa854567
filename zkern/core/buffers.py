"""Buffers whose memory comes and goes while the tensor object stays: views taken of it (a parameter's .grad, the
optimizer's chunks, what autograd saved) stay the same objects and see the values again once it is restored. And
where every buffer zkern hands the model starts: a multiple of ALIGN_BYTES.

    python -c "import torch; from zkern.core.buffers import *; t = aligned_zeros(4, torch.float32, 'cpu'); \
               release(t); restore(t, zero=True); print(t, t.data_ptr() % ALIGN_BYTES)"

Alignment. cuBLAS, cuDNN and Triton choose their kernels by the operands' alignment (16 bytes at least for vector
loads and TMA descriptors). torch's CUDA allocator starts every block at a multiple of 512 bytes, so there
aligned_empty is torch.empty; its CPU allocator at 64, so on the CPU the buffer is placed in a block ALIGN_BYTES
larger, at its first aligned element. partition.py places every parameter of a flat buffer at a multiple of 128
elements (256 bytes of 16-bit values), so each parameter view into such a buffer starts aligned too. A CPU buffer
restored after a release gets a fresh block and is placed in it the same way, at the same storage offset, so the
views taken before see it (UntypedStorage._swap_data_ptr_: the storage keeps its identity, its bytes move); where
this torch has no way to do that, the restore takes what the allocator gives (64 bytes on the CPU).

Depends on torch alone.
"""

from __future__ import annotations

import weakref

import torch

ALIGN_BYTES = 256  # where every buffer zkern hands the model starts, and so every parameter view into one

# CPU storages placed in a block of their own: the block's storage, which owns their bytes (the placed storage's data
# pointer lies inside it and owns nothing). Kept as a bare storage, not a tensor, so a walk over live tensors counts
# each byte once. The entry goes with the placed storage, or at its release.
_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CAN_PLACE = hasattr(torch.UntypedStorage, "_swap_data_ptr_") and \
    hasattr(torch._C, "_construct_storage_from_data_pointer")


def _placed(block: torch.UntypedStorage, lead: int, nbytes: int) -> int:
    """The address in `block` at which a storage of nbytes starts so that its byte `lead` is ALIGN_BYTES-aligned."""
    first = block.data_ptr() + lead
    first += (-first) % ALIGN_BYTES
    return first - lead


def aligned_empty(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised 1-D tensor whose first element is ALIGN_BYTES-aligned, at storage offset 0 (so offsets into
    its storage, which stochastic rounding and the optimizer's moment layout read, are offsets into the buffer)."""
    device = torch.device(device)
    if device.type == "cpu" and _CAN_PLACE:  # placed straight away: no trial allocation beside the block
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        block = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8).untyped_storage()
        storage = torch._C._construct_storage_from_data_pointer(_placed(block, 0, max(nbytes, 1)), device, nbytes)
        _BLOCKS[storage] = block
        return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))
    t = torch.empty(numel, dtype=dtype, device=device)
    if t.data_ptr() % ALIGN_BYTES == 0:  # CUDA's allocator starts every block at a multiple of 512 bytes
        return t
    size = t.element_size()
    block = torch.empty(numel + ALIGN_BYTES // size, dtype=dtype, device=device)
    skip = ((-block.data_ptr()) % ALIGN_BYTES) // size  # the allocator's alignment is a multiple of the element size
    return block[skip:skip + numel]


def aligned_zeros(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return aligned_empty(numel, dtype, device).zero_()


def aligned_copy(t: torch.Tensor, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
    """A copy of t (shape kept, cast to dtype if given) whose first element is ALIGN_BYTES-aligned."""
    out = aligned_empty(t.numel(), dtype or t.dtype, device).view(t.shape)
    out.copy_(t)
    return out


def release_storage(storage: torch.UntypedStorage) -> None:
    """Free a storage's memory: it holds zero bytes until restore_storage (every tensor viewing it keeps its place)."""
    if storage.device.type == "cpu" and _CAN_PLACE:
        storage._swap_data_ptr_(torch.UntypedStorage(0))  # the bytes go with the temporary (or with their block)
        _BLOCKS.pop(storage, None)
    else:
        storage.resize_(0)


def restore_storage(storage: torch.UntypedStorage, nbytes: int, lead: int = 0) -> None:
    """Give a released storage nbytes again, its byte `lead` ALIGN_BYTES-aligned on the CPU (on CUDA the allocator
    aligns every block); nothing if it has them."""
    if storage.nbytes() >= nbytes:
        return
    if storage.device.type == "cpu" and _CAN_PLACE and storage.nbytes() == 0:
        block = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8).untyped_storage()
        placed = torch._C._construct_storage_from_data_pointer(_placed(block, lead, nbytes), storage.device, nbytes)
        storage._swap_data_ptr_(placed)
        _BLOCKS[storage] = block
    else:
        storage.resize_(nbytes)


def release(t: torch.Tensor) -> None:
    """Free t's memory: its storage holds zero bytes until restore (reading it before then is an error)."""
    release_storage(t.untyped_storage())


def restore(t: torch.Tensor, *, zero: bool) -> None:
    """Give t's storage its bytes back (uninitialised, or zeroed with zero); nothing if it has them. t's first
    element is ALIGN_BYTES-aligned again where it was before (see the module docstring)."""
    lead = t.storage_offset() * t.element_size()
    nbytes = lead + t.numel() * t.element_size()
    if t.untyped_storage().nbytes() >= nbytes:
        return
    restore_storage(t.untyped_storage(), nbytes, lead)
    if zero:
        t.zero_()


def is_released(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


def allocated_bytes(tensors) -> int:
    """Bytes of the distinct allocations behind tensors: a storage that several of them view counts once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
