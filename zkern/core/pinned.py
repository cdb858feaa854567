"""Page-locked host buffers of exactly the size asked.

    python -m pytest tests/offload/test_pinned.py -q

torch's `pin_memory=True` allocates through its caching host allocator, which rounds every allocation up to the next
power of two and keeps freed blocks page-locked for reuse: a 200M-element bf16 staging chunk (400 MB) holds 512 MiB,
a 6.6B-element fp32 master (26.3 GB) 32 GiB, and pinned memory is resident memory the OS cannot page out. At 7B,
by that arithmetic, the rounding alone would hold 8.6 GB more than the books count with bf16 state and 17 GB with
fp32 state and the delayed update's two staging copies, on a 125 GiB host. So a large buffer here is allocated as
ordinary host memory and registered with CUDA in place (cudaHostRegister, as torch's own checkpoint stager pins
shared memory): exactly its size, page-locked for the copy engines, unregistered when the tensor is freed.

Only buffers of at least EXACT_MIN_BYTES are registered: the C allocator maps each of them on pages of its own,
while smaller ones may share a page with a neighbour, which CUDA refuses to register twice; those few go through
torch's allocator, where rounding costs little.
"""

from __future__ import annotations

import weakref

import torch

from zkern.core.buffers import aligned_empty

EXACT_MIN_BYTES = 64 << 20  # glibc maps any allocation above 32 MiB (its largest mmap threshold) on its own pages


def _cudart():
    return torch.cuda.cudart()


def _torch_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor of numel elements (uninitialised); at least EXACT_MIN_BYTES are exactly that size."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < EXACT_MIN_BYTES:
        return _torch_pinned(numel, dtype)
    t = aligned_empty(numel, dtype, "cpu")  # where every buffer zkern hands out starts (core/buffers.py)
    ptr = t.data_ptr()
    cudart = _cudart()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        raise RuntimeError(f"zkern: page-locking a {nbytes / 2**30:.2f} GiB host buffer failed (cudaHostRegister "
                           f"error {err}); the host may be out of lockable memory (ulimit -l, or memory itself): turn "
                           f"pinning off where this buffer was asked for (offload_optimizer / offload_param "
                           f"pin_memory: false, or offload_states(pin_memory=False)) to use pageable memory")
    # Unregister when the tensor object dies, before its storage is freed (a view keeps it alive: its _base). Not at
    # interpreter exit: CUDA may be torn down by then, and the process's pages go with it.
    done = weakref.finalize(t, _unregister, cudart, ptr)
    done.atexit = False
    return t


def pinned_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """pinned_empty, zeroed (which also makes every page resident now, not at the first copy)."""
    return pinned_empty(numel, dtype).zero_()


def _unregister(cudart, ptr: int) -> None:
    cudart.cudaHostUnregister(ptr)  # an error here has no caller to go to; the pages are freed right after
