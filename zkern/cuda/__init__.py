"""zkern's CUDA C++ kernels: the fused multi-tensor Adam (16-bit copy-out, bf16 state) and ZeRO++'s quantization
with qgZ's hop fused (dequantize, sum over ranks, requantize).

    ZKERN_BACKEND=cuda python -m zkern.env_report     # where torch has CUDA and nvcc is installed
    python bench/run.py --suite gpu-static            # compiles csrc/*.cu for sm_80/sm_90 anywhere nvcc is

csrc/adam.cu and csrc/quant.cu hold the kernels and their launchers over raw pointers (csrc/zk_cuda.h), with no
libtorch, so nvcc checks them on any machine (bench/gpu_static_suite.py: no spill, 128-bit loads and stores).
Their per-element arithmetic is zkern/csrc/zk_math.h, zk_adam.h and zk_quant.h, which the CPU extension compiles
too: zkern.cpu._ext runs the very same code on the host (adam_step_(isa="shared"), quantize,
dequant_sum_requant), and tests/kernels/test_cuda_shared.py holds it to zkern/reference.py. csrc/bindings.cpp binds the
launchers to torch; it is built on first use with torch.utils.cpp_extension (nvcc and ninja), only where torch has
CUDA. Every function here keeps zkern.reference's signature and semantics.
"""

from __future__ import annotations

import functools
import math
import os
import shutil

import torch

from zkern import reference

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
SHARED = os.path.join(os.path.dirname(HERE), "csrc")  # zkern/csrc: the math the CPU extension compiles too
KERNEL_SOURCES = ("adam.cu", "quant.cu")
ARCHS = (80, 90)
# nvcc's flags for every kernel file, here and in the static gate: IEEE division and square root (never
# --use_fast_math: the arithmetic must be the reference's); no contraction of a * b + c into one fused multiply-add
# (--fmad=false: nvcc contracts by default, the host build of the same headers does not, and qgZ's sum of
# code * scale products then differed from the reference in the last bit on an H100; the fmaf calls written in
# zk_adam.h stay fused); and a spill is an error.
NVCC_FLAGS = ("-std=c++17", "-O3", "--fmad=false", f"-I{SHARED}", f"-I{CSRC}",
              "-Xptxas=--warn-on-spills,--warning-as-error")
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def nvcc() -> str | None:
    """nvcc's path: on PATH, under CUDA_HOME, or CUDA's default install."""
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for candidate in (shutil.which("nvcc"), os.path.join(home, "bin", "nvcc")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def why_unavailable() -> str | None:
    """Why the CUDA kernels cannot run here (None: they can, once built)."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return "torch has no CUDA device here"
    if nvcc() is None:
        return "nvcc is not installed (pip install nvidia-cuda-nvcc, or set CUDA_HOME)"
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja)"
    return None


@functools.cache
def _ext():
    """The torch extension, built on first use (a minute or two; cached by torch under TORCH_EXTENSIONS_DIR)."""
    from torch.utils import cpp_extension

    reason = why_unavailable()
    if reason is not None:
        raise RuntimeError(f"zkern.cuda: the CUDA kernels cannot run here: {reason}")
    major, minor = torch.cuda.get_device_capability()
    arch = [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]
    return cpp_extension.load(name="zkern_cuda_ext", sources=[os.path.join(CSRC, "bindings.cpp")] +
                              [os.path.join(CSRC, s) for s in KERNEL_SOURCES],
                              extra_include_paths=[CSRC, SHARED], extra_cflags=["-O3"],
                              extra_cuda_cflags=[*NVCC_FLAGS, *arch], verbose=False)


def _check(name: str, t: torch.Tensor, numel: int, dtypes) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"zkern.cuda: {name} is on {t.device}; these kernels take CUDA tensors")
    if t.dtype not in dtypes:
        raise TypeError(f"zkern.cuda: {name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if not t.is_contiguous() or t.numel() != numel:
        raise ValueError(f"zkern.cuda: {name} must be contiguous with {numel} elements, got {tuple(t.shape)} "
                         f"(strides {t.stride()})")


def adam_scalars(step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, adamw: bool,
                 grad_scale: float) -> list[float]:
    """The step's nine scalars in double, each rounded once to fp32 in the kernel (as the CPU extension does)."""
    beta1, beta2 = betas
    return [grad_scale, 1.0 - lr * weight_decay if adamw else 1.0, 0.0 if adamw else weight_decay, 1.0 - beta1,
            1.0 - beta2, beta2, 1.0 / math.sqrt(1.0 - beta2 ** step), eps, -lr / (1.0 - beta1 ** step)]


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, adamw: bool,
               grad_scale: float = 1.0, param_out: torch.Tensor | None = None, sr_seed: int | None = None,
               sr_offset: int = 0) -> None:
    """zkern.reference.adam_step_ in one fused pass (to float32 rounding, as the CPU extension)."""
    n = param.numel()
    states = (torch.float32, torch.bfloat16)
    _check("param", param, n, states)
    _check("grad", grad, n, tuple(_DTYPES))
    _check("exp_avg", exp_avg, n, states)
    _check("exp_avg_sq", exp_avg_sq, n, (exp_avg.dtype,))
    if param_out is not None:
        _check("param_out", param_out, n, tuple(_DTYPES))
    if step < 1:
        raise ValueError(f"zkern.cuda adam_step_: step counts from 1, got {step}")
    if n == 0:
        return
    scalars = adam_scalars(step, lr, betas, eps, weight_decay, adamw, grad_scale)
    # One launch, the range as up to three of its tensors: a short head until every pointer is 16-byte aligned, an
    # aligned body that the kernel moves in 16-byte vectors, and a tail (the kernel picks its path per tensor).
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([] if param_out is None else [param_out])
    segments = reference.aligned_segments(n, tensors)
    lists = [[t[lo:hi] for lo, hi, _ in segments] for t in tensors]  # per argument, its parts
    starts = [int(sr_offset) + lo for lo, _, _ in segments]  # stochastic rounding hashes the call's own indices
    # AdamW, or Adam without weight decay (whose lr_decay is then 1): the kernels' own rule (l2 == 0)
    _ext().adam_step(*lists[:4], lists[4] if param_out is not None else [], starts, scalars, scalars[2] == 0.0,
                     sr_seed is not None, (sr_seed or 0) & 0xFFFFFFFF)


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    reference.check_quantize_args(x, bits, group_size)
    _check("x", x, x.numel(), tuple(_DTYPES))
    codes, scales = reference.quant_outputs(x.numel(), bits, group_size, x.device)
    if x.numel():
        _ext().quantize(x, bits, group_size, codes, scales)
    return codes, scales


def dequant_sum_requant(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
                        out_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.dequant_sum_requant in one pass. out_bits 0: the sum only (empty codes and scales)."""
    reference.check_hop_args(q, scales, bits, group_size, numel, out_bits)
    for name, t, dtypes in (("q", q, (torch.int8, torch.uint8)), ("scales", scales, (torch.float32,))):
        if t.device.type != "cuda" or t.dtype not in dtypes or t.stride(1) != 1:
            raise ValueError(f"zkern.cuda dequant_sum_requant: {name} must be a CUDA {dtypes} tensor with "
                             f"contiguous rows, got {t.dtype} on {t.device}, strides {t.stride()}")
    total = torch.empty(numel, dtype=torch.float32, device=q.device)
    codes, out_scales = reference.quant_outputs(numel if out_bits else 0, out_bits or 8, group_size, q.device)
    if numel:
        _ext().dequant_sum_requant(q, scales, bits, group_size, numel, total, out_bits, codes, out_scales)
    return total, codes, out_scales


def dequant_sum(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int) -> torch.Tensor:
    return dequant_sum_requant(q, scales, bits, group_size, numel, 0)[0]


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequant_sum_requant(q.reshape(1, -1), scales.reshape(1, -1), bits, group_size, numel, 0)[0].to(dtype)
