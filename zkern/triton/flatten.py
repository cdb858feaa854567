"""flatten / unflatten_into_: any number of tensors to or from one flat buffer in ONE launch each.

    python -m pytest tests/kernels/test_triton.py -q -k flatten

The launcher builds a table (each tensor's address, dtype code, size and offset in the flat buffer) and a
block list (which tensor and which element each program starts at), so a thousand small tensors cost one
launch, not a thousand. Mixed fp32/fp16/bf16 inputs are cast through fp32 to the output dtype (exact
widening; rounding to nearest even when narrowing, as torch's .to()).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from zkern.triton._common import CODE, LAUNCH_OPTIONS, cast_from_fp32, check_tensor, check_tensors

BLOCK_SIZE = 4096
# The device tables of the last few tensor lists (building one is a Python pass plus a host-to-device copy that waits
# for the stream: longer than the kernel at a thousand tensors). A list flattened again with the same addresses,
# lengths and dtypes gets the very same table, so a hit is exact, whatever tensors now live at those addresses.
TABLE_CACHE_SIZE = 16
_tables_cache: OrderedDict[tuple, tuple] = OrderedDict()


# ALIGNED (a constexpr the launcher sets when every tensor's address and the flat buffer's are 16-byte aligned and
# every tensor's length and flat offset a multiple of 16 elements) lets the body move 128-bit vectors. The compiler
# cannot see alignment in values loaded from the table, nor through an integer-to-pointer cast, so under ALIGNED:
# lengths and offsets are rounded down to a multiple of 16 (unchanged values it can now prove), and a tensor is
# addressed from the flat buffer's pointer (an argument, 16-byte aligned) plus its byte distance from it, also a
# multiple of 16: anchor_addr is that pointer's address as an integer argument, which Triton specialises as a
# multiple of 16.
@triton.jit
def _typed(addr, code: tl.constexpr, anchor, anchor_addr, ALIGNED: tl.constexpr):
    if ALIGNED:
        delta = addr // 16 * 16 - anchor_addr  # bytes from the anchor: the same value, provably a multiple of 16
        if code == 0:
            ptr = anchor.to(tl.pointer_type(tl.float32), bitcast=True) + delta // 4
        elif code == 1:
            ptr = anchor.to(tl.pointer_type(tl.float16), bitcast=True) + delta // 2
        else:
            ptr = anchor.to(tl.pointer_type(tl.bfloat16), bitcast=True) + delta // 2
    else:
        if code == 0:
            ptr = addr.to(tl.pointer_type(tl.float32), bitcast=True)
        elif code == 1:
            ptr = addr.to(tl.pointer_type(tl.float16), bitcast=True)
        else:
            ptr = addr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    return ptr


@triton.jit
def _hint(x, ALIGNED: tl.constexpr):
    if ALIGNED:
        x = x // 16 * 16  # the same value (the launcher checked), now provably a multiple of 16
    return x


@triton.jit
def _load_as_fp32(addr, offs, mask, code, anchor, anchor_addr, ALIGNED: tl.constexpr):
    if code == 0:
        x = tl.load(_typed(addr, 0, anchor, anchor_addr, ALIGNED) + offs, mask=mask).to(tl.float32)
    elif code == 1:
        x = tl.load(_typed(addr, 1, anchor, anchor_addr, ALIGNED) + offs, mask=mask).to(tl.float32)
    else:
        x = tl.load(_typed(addr, 2, anchor, anchor_addr, ALIGNED) + offs, mask=mask).to(tl.float32)
    return x


@triton.jit
def _flatten_kernel(src_ptrs, src_codes, numels, flat_offsets, block_tensor, block_start, out_ptr, out_addr,
                    BLOCK_SIZE: tl.constexpr, OUT_CODE: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(block_tensor + pid).to(tl.int64)
    offs = _hint(tl.load(block_start + pid), ALIGNED) + tl.arange(0, BLOCK_SIZE)
    mask = offs < _hint(tl.load(numels + t), ALIGNED)
    x = _load_as_fp32(tl.load(src_ptrs + t), offs, mask, tl.load(src_codes + t), out_ptr, out_addr, ALIGNED)
    tl.store(out_ptr + _hint(tl.load(flat_offsets + t), ALIGNED) + offs, cast_from_fp32(x, OUT_CODE), mask=mask)


@triton.jit
def _unflatten_kernel(flat_ptr, flat_addr, dst_ptrs, dst_codes, numels, flat_offsets, block_tensor, block_start,
                      BLOCK_SIZE: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(block_tensor + pid).to(tl.int64)
    offs = _hint(tl.load(block_start + pid), ALIGNED) + tl.arange(0, BLOCK_SIZE)
    mask = offs < _hint(tl.load(numels + t), ALIGNED)
    x = tl.load(flat_ptr + _hint(tl.load(flat_offsets + t), ALIGNED) + offs, mask=mask).to(tl.float32)
    addr, code = tl.load(dst_ptrs + t), tl.load(dst_codes + t)
    if code == 0:
        tl.store(_typed(addr, 0, flat_ptr, flat_addr, ALIGNED) + offs, cast_from_fp32(x, 0), mask=mask)
    elif code == 1:
        tl.store(_typed(addr, 1, flat_ptr, flat_addr, ALIGNED) + offs, cast_from_fp32(x, 1), mask=mask)
    else:
        tl.store(_typed(addr, 2, flat_ptr, flat_addr, ALIGNED) + offs, cast_from_fp32(x, 2), mask=mask)


def _aligned(tensors: list[torch.Tensor], flat: torch.Tensor, align: int) -> bool:
    """Whether the ALIGNED specialisation holds: every address 16-byte aligned, every length and (so) every flat
    offset a multiple of 16 elements."""
    return flat.data_ptr() % 16 == 0 and _tensors_aligned(tensors, align)


def _tensors_aligned(tensors: list[torch.Tensor], align: int) -> bool:
    return all(t.data_ptr() % 16 == 0 and t.numel() % 16 == 0 and -(-t.numel() // align) * align % 16 == 0
               for t in tensors)


def _tables(tensors: list[torch.Tensor], align: int, device: torch.device):
    """(pointer, code, numel, flat offset) per tensor, the block list, the flat length (aligned) and whether the
    tensors allow the ALIGNED path (_aligned without the flat buffer's address); cached."""
    key = (device, align, tuple(map(torch.Tensor.data_ptr, tensors)), tuple(map(torch.Tensor.numel, tensors)),
           tuple(t.dtype for t in tensors))
    hit = _tables_cache.get(key)
    if hit is not None:
        _tables_cache.move_to_end(key)
        return hit
    built = _build_tables(tensors, align, device)
    _tables_cache[key] = built
    if len(_tables_cache) > TABLE_CACHE_SIZE:
        _tables_cache.popitem(last=False)
    return built


def _build_tables(tensors: list[torch.Tensor], align: int, device: torch.device):
    numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    slots = (numels + align - 1) // align * align
    offsets = torch.cumsum(slots, 0) - slots
    blocks = (numels + BLOCK_SIZE - 1) // BLOCK_SIZE
    first = torch.cumsum(blocks, 0) - blocks
    block_tensor = torch.repeat_interleave(torch.arange(len(tensors), dtype=torch.int32), blocks)
    block_start = (torch.arange(int(blocks.sum())) - torch.repeat_interleave(first, blocks)) * BLOCK_SIZE
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    codes = torch.tensor([CODE[t.dtype] for t in tensors], dtype=torch.int32)
    # One host-to-device copy for the whole table.
    packed = torch.cat([ptrs, codes.long(), numels, offsets, block_tensor.long(), block_start]).to(device)
    k, b = len(tensors), block_tensor.numel()
    parts = packed[:k], packed[k:2 * k].int(), packed[2 * k:3 * k], packed[3 * k:4 * k], \
        packed[4 * k:4 * k + b].int(), packed[4 * k + b:]
    return parts, int((offsets + slots)[-1]), b, _tensors_aligned(tensors, align)


def flatten(tensors: list[torch.Tensor], dtype: torch.dtype | None = None, *, align: int = 1,
            pad_to: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """zkern.reference.flatten in one launch: each tensor starts at a multiple of `align` elements, the total is
    padded to a multiple of `pad_to`; gaps and padding are zero. out: a buffer of exactly that length and dtype
    to write into instead of a new one."""
    if align < 1 or pad_to < 1:
        raise ValueError(f"flatten: align and pad_to must be >= 1, got {align} and {pad_to}")
    if not tensors:
        return torch.zeros(0, dtype=dtype or torch.float32)
    check_tensors("flatten", tensors)
    if dtype is None and len({t.dtype for t in tensors}) > 1:
        raise TypeError(f"flatten got mixed dtypes {sorted({str(t.dtype) for t in tensors})}; pass dtype= to cast")
    out_dtype = dtype or tensors[0].dtype
    if out_dtype not in CODE:
        raise TypeError(f"flatten: dtype must be float32, float16 or bfloat16, got {out_dtype}")
    device = tensors[0].device
    (ptrs, codes, numels, offsets, block_tensor, block_start), used, blocks, aligned = _tables(tensors, align, device)
    total = (used + pad_to - 1) // pad_to * pad_to
    if out is None:
        out = torch.empty(total, dtype=out_dtype, device=device)
    else:
        check_tensor("flatten", "out", out, (out_dtype,))
        if out.shape != (total,):
            raise ValueError(f"flatten: out must have shape ({total},), got {tuple(out.shape)}")
    if total != sum(t.numel() for t in tensors):
        out.zero_()  # alignment gaps and padding: one memset, only when there are any
    if blocks:
        _flatten_kernel[(blocks,)](ptrs, codes, numels, offsets, block_tensor, block_start, out, out.data_ptr(),
                                   BLOCK_SIZE=BLOCK_SIZE, OUT_CODE=CODE[out_dtype],
                                   ALIGNED=aligned and out.data_ptr() % 16 == 0, **LAUNCH_OPTIONS)
    return out


def unflatten_into_(flat: torch.Tensor, tensors: list[torch.Tensor], *, align: int = 1) -> None:
    """Scatter flat back into the tensors in place (cast to each one's dtype), laid out as flatten(align=) did."""
    check_tensor("unflatten_into_", "flat", flat)
    check_tensors("unflatten_into_", tensors)
    if not tensors:
        return
    (ptrs, codes, numels, offsets, block_tensor, block_start), used, blocks, aligned = _tables(tensors, align,
                                                                                               flat.device)
    if flat.dim() != 1 or flat.numel() < used:
        raise ValueError(f"unflatten_into_ needs a 1-D buffer of at least {used} elements, got {tuple(flat.shape)}")
    if blocks:
        _unflatten_kernel[(blocks,)](flat, flat.data_ptr(), ptrs, codes, numels, offsets, block_tensor, block_start,
                                     BLOCK_SIZE=BLOCK_SIZE, ALIGNED=aligned and flat.data_ptr() % 16 == 0,
                                     **LAUNCH_OPTIONS)


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """zkern.reference.unflatten: new tensors shaped like `like`, in flat's dtype."""
    out = [torch.empty(t.shape, dtype=flat.dtype, device=flat.device) for t in like]
    unflatten_into_(flat, out)
    return out
