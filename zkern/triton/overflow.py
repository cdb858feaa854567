"""unscale_and_check_: one pass over a flat gradient buffer: unscale in place, flag NaN/inf, sum of squares.

    python -m pytest tests/kernels/test_triton.py -q -k unscale

Each program writes its block's flag and fp32 sum of squares to a small partials buffer; one device-side
reduction of those (a few thousand values for a 2^24-element buffer) gives the totals, deterministically (no
atomics) and with no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zkern.reference import aligned_segments
from zkern.triton._common import CODE, EDGE_BLOCK, LAUNCH_OPTIONS, cast_from_fp32, check_tensor

BLOCK_SIZE = 4096


@triton.jit
def _unscale_and_check_kernel(x_ptr, n, inv_scale, bad_ptr, sq_ptr, BLOCK_SIZE: tl.constexpr,
                              UNSCALE: tl.constexpr, CODE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNSCALE:
        x = x * inv_scale
        tl.store(x_ptr + offs, cast_from_fp32(x, CODE), mask=mask)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    tl.store(bad_ptr + pid, tl.max(bad.to(tl.int32), axis=0))
    tl.store(sq_ptr + pid, tl.sum(x * x, axis=0))


def unscale_and_check_(flat_grad: torch.Tensor, inv_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """zkern.reference.unscale_and_check_ in one pass: returns (found_inf, sq_norm), fp32 0-d, on the device."""
    check_tensor("unscale_and_check_", "flat_grad", flat_grad)
    n = flat_grad.numel()
    if n == 0:
        zero = torch.zeros((), dtype=torch.float32, device=flat_grad.device)
        return zero, zero.clone()
    flat = flat_grad.view(-1)
    segments = [(lo, hi, BLOCK_SIZE if body else EDGE_BLOCK) for lo, hi, body in aligned_segments(n, [flat])]
    blocks = sum(triton.cdiv(hi - lo, block) for lo, hi, block in segments)
    bad = torch.empty(blocks, dtype=torch.int32, device=flat_grad.device)
    sq = torch.empty(blocks, dtype=torch.float32, device=flat_grad.device)
    first = 0
    for lo, hi, block in segments:  # each launch writes its programs' partials into its own slice
        count = triton.cdiv(hi - lo, block)
        _unscale_and_check_kernel[(count,)](flat[lo:hi], hi - lo, float(inv_scale), bad[first:first + count],
                                            sq[first:first + count], BLOCK_SIZE=block, UNSCALE=inv_scale != 1.0,
                                            CODE=CODE[flat_grad.dtype], **LAUNCH_OPTIONS)
        first += count
    return bad.max().float(), sq.sum()
