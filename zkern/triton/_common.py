"""What zkern's Triton kernels share: dtype codes, the bf16 rounding, the launcher's input checks.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests/conftest.py sets it where no GPU is present);
otherwise they take CUDA tensors only.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Codes the kernels branch on (a tensor's dtype in a pointer table, or an output dtype as a constexpr).
CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Every launch compiles with contraction off: the reference (and the CPU) rounds a * b before adding c, where Triton
# would fuse the two (an H100 run and the sm_90 PTX showed it: qgZ's sum of code * scale products and quantization's
# floor(x * inv + 0.5), which at a rounding tie moves a code by one). The fused multiply-adds zkern means are
# written as tl.fma, and the gpu-static gate fails a kernel whose PTX holds one its source does not write.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_tensor(op: str, name: str, t: torch.Tensor, dtypes=tuple(CODE), *, row_stride: bool = False) -> None:
    """The launcher's contract: a supported dtype, contiguous memory, a device the kernels run on. row_stride: a
    kernel that takes t.stride(0) needs only each row of a 2-D t contiguous (one rank's slice of a message)."""
    if t.dtype not in dtypes:
        raise TypeError(f"zkern.triton.{op}: {name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    rows_ok = row_stride and t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)
    if not (t.is_contiguous() or rows_ok):
        raise ValueError(f"zkern.triton.{op}: {name} is not contiguous; the kernels read flat memory (pass "
                         f"{name}.contiguous())")
    if t.device.type != "cuda" and not (interpreting() and t.device.type == "cpu"):
        raise ValueError(f"zkern.triton.{op}: {name} is on {t.device}; Triton kernels take CUDA tensors (CPU "
                         f"tensors only under TRITON_INTERPRET=1)")


def check_tensors(op: str, tensors: list[torch.Tensor]) -> None:
    """check_tensor on each of many tensors (flatten's thousand): one cheap pass over the attributes where all pass,
    the first failing tensor's own error otherwise."""
    on_device = interpreting() or all(t.is_cuda for t in tensors)
    if on_device and all(map(torch.Tensor.is_contiguous, tensors)) and {t.dtype for t in tensors} <= CODE.keys():
        return
    for i, t in enumerate(tensors):
        check_tensor(op, f"tensors[{i}]", t)


@triton.jit
def mix32(x):
    """lowbias32 over uint32 lanes: the hash behind stochastic rounding (zkern.reference._mix32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def round_bf16_value(x, random16, STOCHASTIC: tl.constexpr):
    """fp32 x rounded to bf16 and returned as the fp32 of that bf16 value: to nearest even, or stochastically by
    adding random16 (uint32 lanes in [0, 2**16)) to the bits before truncating; NaN as torch writes it."""
    bits = x.to(tl.uint32, bitcast=True)
    if STOCHASTIC:
        add = random16
    else:
        add = 0x7FFF + ((bits >> 16) & 1)
    rounded = (bits + add) & tl.full((), 0xFFFF0000, tl.uint32)
    rounded = tl.where(x != x, tl.full((), 0xFFFF0000, tl.uint32), rounded)
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16 rounding to nearest even, every NaN written as 0xFFFF: torch's cast bit for bit. Spelled out
    in integer ops (round_bf16_value) because the interpreter's own cast truncates."""
    bits = round_bf16_value(x, 0, False).to(tl.uint32, bitcast=True) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def cast_from_fp32(x, OUT_CODE: tl.constexpr):
    """x (fp32) in the dtype of CODE OUT_CODE."""
    if OUT_CODE == 2:
        return to_bf16_rne(x)
    elif OUT_CODE == 1:
        return x.to(tl.float16)
    else:
        return x


EDGE_BLOCK = 128  # elements per program of a head or tail launch (few elements: small tiles keep registers low)
