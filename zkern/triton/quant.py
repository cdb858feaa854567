"""Blockwise symmetric int8 / int4 quantization, dequantization, and the fused dequantize-and-sum.

    python -m pytest tests/kernels/test_triton.py -q -k quant

The exact rules (scales, rounding, all-zero groups, NaN/inf groups, int4 packing) are zkern.reference's;
these kernels reproduce its codes and scales bit for bit. Each program takes about TILE_ELEMENTS elements,
whole groups, as a 2-D tile [groups, group_size] and reduces along the group for its absmax. int4 tiles are read
and written contiguously and split into (or joined from) their even and odd elements in registers, so each byte's
two codes come from one tile row and every global access is a contiguous one. Their bytes are masked against the
byte count (n_bytes, an argument), not 2 * byte < n: a mask whose constancy the compiler can prove lets the packed
bytes move 16 at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zkern.reference import QMAX, _check_quant, check_quantize_args, quant_outputs
from zkern.triton._common import CODE, LAUNCH_OPTIONS, cast_from_fp32, check_tensor

TILE_ELEMENTS = 4096  # each program quantizes this many elements: max(1, 4096 // group_size) whole groups


@triton.jit
def _codes(x, inv, bad, QMAX: tl.constexpr):
    """round-half-away-from-zero(x * inv) clamped to [-QMAX, QMAX]; 0 in a bad group."""
    y = tl.where(bad[:, None], 0.0, x) * inv[:, None]  # a bad group's NaN/inf never enters the arithmetic
    c = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))
    c = tl.minimum(tl.maximum(c, -QMAX), QMAX)
    return tl.where(bad[:, None], 0.0, c)


@triton.jit
def _scale(x_a, x_b, QMAX: tl.constexpr):
    """(scale, 1/scale, bad) per tile row over both halves (int4) or one (int8: x_b is all zero)."""
    bad_a = (x_a != x_a) | (tl.abs(x_a) == float("inf"))
    bad_b = (x_b != x_b) | (tl.abs(x_b) == float("inf"))
    bad = (tl.max(bad_a.to(tl.int32), axis=1) + tl.max(bad_b.to(tl.int32), axis=1)) > 0
    absmax = tl.maximum(tl.max(tl.where(bad_a, 0.0, tl.abs(x_a)), axis=1),
                        tl.max(tl.where(bad_b, 0.0, tl.abs(x_b)), axis=1))
    absmax = tl.where(bad, 0.0, absmax)
    scale = tl.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32))
    safe = tl.where(scale > 0, scale, 1.0)
    inv = tl.where(scale > 0, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), safe), 0.0)
    return scale, inv, bad


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, n, n_bytes, n_groups, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                     BITS: tl.constexpr, QMAX: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * GROUPS + tl.arange(0, GROUPS)
    if BITS == 8:
        offs = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        scale, inv, bad = _scale(x, tl.zeros_like(x), QMAX)
        tl.store(q_ptr + offs, _codes(x, inv, bad, QMAX).to(tl.int8), mask=offs < n)
    else:  # one contiguous tile, split into its even and odd elements in registers: every access is contiguous
        offs = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        x_e, x_o = tl.split(tl.reshape(x, [GROUPS, GROUP // 2, 2]))
        scale, inv, bad = _scale(x_e, x_o, QMAX)
        lo = (_codes(x_e, inv, bad, QMAX) + 8.0).to(tl.uint8)
        hi = (_codes(x_o, inv, bad, QMAX) + 8.0).to(tl.uint8)
        byte = rows[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
        tl.store(q_ptr + byte, lo | (hi << 4), mask=byte < n_bytes)
    tl.store(s_ptr + rows, tl.where(bad, float("nan"), scale), mask=rows < n_groups)


@triton.jit
def _dequant_tile(q_ptr, s_ptr, rows, n, n_bytes, n_groups, GROUP: tl.constexpr, BITS: tl.constexpr):
    """(offsets, values) of a [rows, GROUP] tile; int4 bytes are read contiguously and their two codes interleaved
    back into element order in registers."""
    scale = tl.load(s_ptr + rows, mask=rows < n_groups, other=0.0)
    offs = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    if BITS == 8:
        codes = tl.load(q_ptr + offs, mask=offs < n, other=0).to(tl.float32)
        return offs, codes * scale[:, None]
    else:
        byte = rows[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
        packed = tl.load(q_ptr + byte, mask=byte < n_bytes, other=0x88).to(tl.int32)
        lo = ((packed & 0xF) - 8).to(tl.float32) * scale[:, None]
        hi = ((packed >> 4) - 8).to(tl.float32) * scale[:, None]
        return offs, tl.reshape(tl.join(lo, hi), [rows.shape[0], GROUP])


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, n, n_bytes, n_groups, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                       BITS: tl.constexpr, OUT_CODE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    offs, values = _dequant_tile(q_ptr, s_ptr, rows, n, n_bytes, n_groups, GROUP, BITS)
    tl.store(out_ptr + offs, cast_from_fp32(values, OUT_CODE), mask=offs < n)


@triton.jit
def _dequant_sum_kernel(q_ptr, s_ptr, out_ptr, world, q_stride, s_stride, n, n_bytes, n_groups,
                        GROUP: tl.constexpr, GROUPS: tl.constexpr, BITS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    offs, acc = _dequant_tile(q_ptr, s_ptr, rows, n, n_bytes, n_groups, GROUP, BITS)
    for r in range(1, world):  # ranks in order, as the reference sums them
        _, values = _dequant_tile(q_ptr + r * q_stride, s_ptr + r * s_stride, rows, n, n_bytes, n_groups, GROUP,
                                  BITS)
        acc += values
    tl.store(out_ptr + offs, acc, mask=offs < n)


def _groups_per_program(group_size: int) -> int:
    return max(1, TILE_ELEMENTS // group_size)


def _grid(n_groups: int, group_size: int) -> tuple[int]:
    return (max(1, triton.cdiv(n_groups, _groups_per_program(group_size))),)


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """zkern.reference.quantize in one pass: (codes int8 (n,) or packed uint8 (ceil(n/2),), fp32 scales)."""
    check_quantize_args(x, bits, group_size)
    check_tensor("quantize", "x", x)
    n = x.numel()
    groups = triton.cdiv(n, group_size)
    q, scales = quant_outputs(n, bits, group_size, x.device)
    if n:
        _quantize_kernel[_grid(groups, group_size)](x, q, scales, n, (n + 1) // 2, groups, GROUP=group_size,
                                                    GROUPS=_groups_per_program(group_size),
                                        BITS=bits, QMAX=QMAX[bits], **LAUNCH_OPTIONS)
    return q, scales


def _check_codes(op: str, q: torch.Tensor, bits: int, *, row_stride: bool = False) -> None:
    check_tensor(op, "q", q, (torch.int8,) if bits == 8 else (torch.uint8,), row_stride=row_stride)


def _out(op: str, out: torch.Tensor | None, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    check_tensor(op, "out", out, (dtype,))
    if out.shape != (numel,):
        raise ValueError(f"{op}: out must have shape ({numel},), got {tuple(out.shape)}")
    return out


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
               dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """zkern.reference.dequantize in one pass (into out when given)."""
    _check_quant(bits, group_size)
    _check_codes("dequantize", q, bits)
    check_tensor("dequantize", "scales", scales, (torch.float32,))
    groups = triton.cdiv(numel, group_size)
    if q.numel() < (numel if bits == 8 else (numel + 1) // 2) or scales.numel() < groups:
        raise ValueError(f"dequantize: {numel} elements need more codes/scales than q {tuple(q.shape)} and scales "
                         f"{tuple(scales.shape)} hold")
    out = _out("dequantize", out, numel, dtype, q.device)
    if numel:
        _dequantize_kernel[_grid(groups, group_size)](q, scales, out, numel, (numel + 1) // 2, groups,
                                                      GROUP=group_size,
                                                      GROUPS=_groups_per_program(group_size), BITS=bits,
                                                      OUT_CODE=CODE[dtype], **LAUNCH_OPTIONS)
    return out


def dequant_sum(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """zkern.reference.dequant_sum in one pass: fp32 sum over ranks of q (world, codes), scales (world, groups)."""
    _check_quant(bits, group_size)
    # Rows may be strided: qgZ's codes are each rank's leading bytes of one received message buffer.
    _check_codes("dequant_sum", q, bits, row_stride=True)
    check_tensor("dequant_sum", "scales", scales, (torch.float32,), row_stride=True)
    if q.dim() != 2 or scales.dim() != 2 or q.shape[0] != scales.shape[0] or q.shape[0] < 1:
        raise ValueError(f"dequant_sum takes q (world, codes) and scales (world, groups), got {tuple(q.shape)} and "
                         f"{tuple(scales.shape)}")
    groups = triton.cdiv(numel, group_size)
    out = _out("dequant_sum", out, numel, torch.float32, q.device)
    if numel:
        _dequant_sum_kernel[_grid(groups, group_size)](q, scales, out, q.shape[0], q.stride(0), scales.stride(0),
                                                       numel, (numel + 1) // 2, groups, GROUP=group_size,
                                                       GROUPS=_groups_per_program(group_size), BITS=bits,
                                                       **LAUNCH_OPTIONS)
    return out


def dequant_sum_requant(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
                        out_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """zkern.reference.dequant_sum_requant: qgZ's hop as the two kernels back to back (the sum, then its codes);
    zkern/cuda fuses them in one pass."""
    total = dequant_sum(q, scales, bits, group_size, numel)
    return (total, *quantize(total, out_bits, group_size))
