"""adam_step_: fused Adam/AdamW over a flat fp32 master shard, with the low-precision copy in the same pass.

    python -m pytest tests/kernels/test_triton.py -q -k adam

zkern.reference.adam_step_'s semantics: gradients fp32/fp16/bf16 (upcast, times grad_scale), the master and the
moments fp32 or bf16 (bf16 stored rounded to nearest even, or stochastically with the reference's hash),
bias correction, decoupled (AdamW) or L2 (Adam) weight decay, and an optional fp16/bf16/fp32 param_out
written from the stored master's value. IEEE-rounded division and square root (div_rn, sqrt_rn) and explicit
fused multiply-adds where torch's vectorised CPU ops fuse too (the same structure as the CPU Adam), so the
results differ from torch's by a few units in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zkern.reference import INDEX_STEP, SECOND_STREAM, aligned_segments
from zkern.triton._common import (
    CODE,
    EDGE_BLOCK,
    LAUNCH_OPTIONS,
    cast_from_fp32,
    check_tensor,
    mix32,
    round_bf16_value,
)

BLOCK_SIZE = 2048
# The stochastic-rounding hash's constants, as constexprs: a compiled kernel reads no other globals (the
# interpreter would, which is why bench/run.py --suite gpu-static compiles every launch for real).
_INDEX_STEP = tl.constexpr(INDEX_STEP)
_SECOND_STREAM = tl.constexpr(SECOND_STREAM)


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, n, grad_scale, lr_decay, l2, beta2, one_minus_beta1,
                 one_minus_beta2, neg_step_size, inv_bc2_sqrt, eps, sr_seed, sr_base, BLOCK_SIZE: tl.constexpr,
                 ADAMW: tl.constexpr, OUT_CODE: tl.constexpr, HAS_OUT: tl.constexpr, MASTER_BF16: tl.constexpr,
                 STATE_BF16: tl.constexpr, STOCHASTIC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ADAMW:
        p = p * lr_decay
    else:
        g = tl.fma(l2, p, g)  # fused, as torch's add(alpha=): a cancelling sum keeps its low bits
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.fma(one_minus_beta1, g - m, m)  # torch's lerp(m, g, 1 - beta1)
    v = tl.fma(one_minus_beta2 * g, g, tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32) * beta2)
    denom = tl.fma(tl.sqrt_rn(v), inv_bc2_sqrt, eps)
    p = tl.fma(neg_step_size, tl.div_rn(m, denom), p)
    first = offs.to(tl.uint32)  # placeholders when nothing rounds stochastically
    second = first
    if STOCHASTIC:
        index = (offs + sr_base).to(tl.uint32)
        first = mix32((index * tl.full((), _INDEX_STEP, tl.uint32)) ^ sr_seed.to(tl.uint32))
        second = mix32(first ^ tl.full((), _SECOND_STREAM, tl.uint32))
    if STATE_BF16:
        m = round_bf16_value(m, first & 0xFFFF, STOCHASTIC)
        v = round_bf16_value(v, first >> 16, STOCHASTIC)
        tl.store(m_ptr + offs, m.to(tl.bfloat16), mask=mask)  # exact: already a bf16 value
        tl.store(v_ptr + offs, v.to(tl.bfloat16), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    if MASTER_BF16:
        p = round_bf16_value(p, second & 0xFFFF, STOCHASTIC)
        tl.store(p_ptr + offs, p.to(tl.bfloat16), mask=mask)
    else:
        tl.store(p_ptr + offs, p, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, cast_from_fp32(p, OUT_CODE), mask=mask)


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, adamw: bool,
               grad_scale: float = 1.0, param_out: torch.Tensor | None = None, sr_seed: int | None = None,
               sr_offset: int = 0) -> None:
    n = param.numel()
    check_tensor("adam_step_", "param", param, (torch.float32, torch.bfloat16))
    check_tensor("adam_step_", "exp_avg", exp_avg, (torch.float32, torch.bfloat16))
    check_tensor("adam_step_", "exp_avg_sq", exp_avg_sq, (exp_avg.dtype,))
    check_tensor("adam_step_", "grad", grad)
    if param_out is not None:
        check_tensor("adam_step_", "param_out", param_out)
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("param_out", param_out)):
        if t is not None and t.numel() != n:
            raise ValueError(f"zkern.triton.adam_step_: {name} has {t.numel()} elements, param has {n}")
    if step < 1:
        raise ValueError(f"zkern.triton.adam_step_: step counts from 1, got {step}")
    if n == 0:
        return
    beta1, beta2 = betas
    out = param if param_out is None else param_out
    # Scalars as torch computes them: in double, rounded once to fp32 at the launch.
    decoupled = adamw or weight_decay == 0.0
    scalars = (float(grad_scale), 1.0 - lr * weight_decay if adamw else 1.0, 0.0 if decoupled else weight_decay,
               beta2, 1.0 - beta1, 1.0 - beta2, -lr / (1.0 - beta1**step), 1.0 / (1.0 - beta2**step) ** 0.5, eps)
    flags = dict(ADAMW=decoupled, OUT_CODE=CODE[param_out.dtype] if param_out is not None else 0,
                 HAS_OUT=param_out is not None, MASTER_BF16=param.dtype == torch.bfloat16,
                 STATE_BF16=exp_avg.dtype == torch.bfloat16, STOCHASTIC=sr_seed is not None)
    tensors = tuple(t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq, out))
    seed = (sr_seed or 0) & 0xFFFFFFFF
    for lo, hi, body in aligned_segments(n, list(tensors)):
        block = BLOCK_SIZE if body else EDGE_BLOCK
        # the hashed index is the element's, whatever segment it falls in
        _adam_kernel[(triton.cdiv(hi - lo, block),)](*(t[lo:hi] for t in tensors), hi - lo, *scalars, seed,
                                                      (sr_offset + lo) & 0xFFFFFFFF, BLOCK_SIZE=block, **flags,
                                                      **LAUNCH_OPTIONS)
