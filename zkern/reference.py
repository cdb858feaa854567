"""Pure-torch reference of every zkern op: ground truth for tests and bench, and the CPU fallback.

    python -c "import torch, zkern.reference as r; print(r.flatten([torch.ones(2), torch.zeros(3)]))"

Each function here states the exact semantics its Triton / CUDA / CPU twins must reproduce. Depends on torch alone.
"""

from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def flatten(tensors: list[torch.Tensor], dtype: torch.dtype | None = None, *, align: int = 1,
            pad_to: int = 1) -> torch.Tensor:
    """Concatenate the tensors' elements (row-major) into one new 1-D buffer, cast to dtype if given.

    Each tensor starts at a multiple of `align` elements and the total is padded to a multiple of `pad_to`;
    the gaps are zero. An empty list gives an empty float32 buffer (or dtype). Mixed input dtypes need an
    explicit dtype.
    """
    if align < 1 or pad_to < 1:
        raise ValueError(f"flatten: align and pad_to must be >= 1, got {align} and {pad_to}")
    if not tensors:
        return torch.empty(0, dtype=dtype or torch.float32)
    dtypes = {t.dtype for t in tensors}
    if dtype is None and len(dtypes) > 1:
        raise TypeError(f"flatten got mixed dtypes {sorted(map(str, dtypes))}; pass dtype= to cast them")
    out_dtype = dtype or tensors[0].dtype
    offsets, end = [], 0
    for t in tensors:
        end += (-end) % align
        offsets.append(end)
        end += t.numel()
    end += (-end) % align  # every tensor's slot is a multiple of align, the last one's too
    total = end + (-end) % pad_to
    # One buffer, written in place (a cat per gap would hold the data twice: a 64 MiB model built for stage 3
    # peaked a whole unit higher); only the gaps need zeros.
    out = torch.empty(total, dtype=out_dtype, device=tensors[0].device)
    gap_start = 0
    for t, off in zip(tensors, offsets):
        out[gap_start:off].zero_()
        out[off:off + t.numel()].copy_(t.reshape(-1))
        gap_start = off + t.numel()
    out[gap_start:].zero_()
    return out


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Split flat into new tensors shaped like `like` (in flat's dtype); flat may be longer (padding)."""
    need = sum(t.numel() for t in like)
    if flat.dim() != 1 or flat.numel() < need:
        raise ValueError(f"unflatten needs a 1-D buffer of at least {need} elements, got shape {tuple(flat.shape)}")
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view(t.shape).clone())
        offset += t.numel()
    return out


# Elements per fp32 partial of a sum of squares on a CPU. A CPU torch.dot (and torch.linalg.vector_norm) adds each
# lane of its vector loop sequentially in fp32: over a 200M-element gradient bucket the late terms fall below the
# running sum's rounding, and the total came out 0.8% low (vector_norm: 5.7%). Each partial here is torch's
# cascaded sum of the piece's squares (1e-8 relative at 2^18 elements, where a dot of bf16-valued elements was
# 6e-6 low: measured), its 1 MiB temporary staying in cache, and the partials add in float64. A GPU's dot adds in a
# tree, accurate in one pass, so there the whole buffer is one partial (no launch per piece, no temporary).
NORM_CHUNK = 1 << 18


def _norm_pieces(n: int, device: torch.device) -> range:
    step = NORM_CHUNK if device.type == "cpu" else max(n, 1)
    return range(0, n, step) if n else range(0)


def _squares(x: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of x's squares (one partial)."""
    return (x * x).sum() if x.device.type == "cpu" else torch.dot(x, x)


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """The sum of t's squared elements as a float64 0-d tensor on t's device, accurate to fp32 rounding whatever
    t's length (fp32 partials, added in float64). No host synchronisation."""
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    pieces = _norm_pieces(flat.numel(), t.device)
    for lo in pieces:
        total += _squares(flat[lo:lo + pieces.step].float())
    return total


def unscale_and_check_(flat_grad: torch.Tensor, inv_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Multiply flat_grad by inv_scale in place; return (found_inf, sq_norm) as fp32 0-d tensors.

    found_inf is 1.0 when any element is NaN or +-inf, else 0.0. sq_norm is the sum of squares of the unscaled
    elements (before they are rounded to the buffer's dtype), accurate to fp32 rounding at any length (as
    sum_of_squares). Both stay on flat_grad's device: no host synchronisation. inv_scale == 1.0 leaves the buffer
    untouched (a check-and-norm pass only).
    """
    _check_float("flat_grad", flat_grad)
    if not flat_grad.is_contiguous():
        raise ValueError("unscale_and_check_ needs a contiguous buffer (it works on flat gradient shards)")
    sq_norm = torch.zeros((), dtype=torch.float64, device=flat_grad.device)
    found = torch.zeros((), dtype=torch.bool, device=flat_grad.device)
    pieces = _norm_pieces(flat_grad.numel(), flat_grad.device)
    for lo in pieces:  # sum_of_squares' partials; on a CPU no fp32 copy of the whole buffer either
        part = flat_grad[lo:lo + pieces.step]
        x = part.float()
        if inv_scale != 1.0:
            x = x * inv_scale
            part.copy_(x)
        sq_norm += _squares(x)
        # on the piece just read (a CPU's pieces fit its cache: one pass over memory), through its extremes (a NaN or
        # an inf is one of them; no piece-sized mask is made), and no host read: the step's control exchange stays
        # its one synchronisation
        lo, hi = torch.aminmax(x)
        found |= ~(torch.isfinite(lo) & torch.isfinite(hi))
    return found.float(), sq_norm.float()


_STATE_DTYPES = (torch.float32, torch.bfloat16)
_M32 = 0xFFFFFFFF
INDEX_STEP, SECOND_STREAM = 0x9E3779B1, 0x68E31DA4  # as csrc/simd.h's kIndexStep and kSecondStream


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 tensors holding uint32 values, in two halves so nothing overflows int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32, the integer hash behind stochastic rounding (csrc/simd.h's mix32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stochastic_bits(seed: int, offset: int, n: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit hashes of elements offset..offset+n-1 (int64 tensors): exp_avg rounds with the low 16 bits
    of the first, exp_avg_sq with its high 16, a bf16 master with the low 16 of the second."""
    index = (torch.arange(n, dtype=torch.int64, device=device) + offset) & _M32
    first = _mix32((seed & _M32) ^ _mul32(index, INDEX_STEP))
    return first, _mix32(first ^ SECOND_STREAM)


def call_seed(seed: int, group: int, step: int) -> int:
    """A 32-bit seed for one (group, step) of a run seeded `seed` (an adam_step_ call's sr_seed): splitmix64's
    finaliser over the three."""
    x = (seed * 0x9E3779B97F4A7C15 + group * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & 0xFFFFFFFF


def round_bf16(x: torch.Tensor, random16: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 x rounded to bfloat16: to nearest even (torch's cast) when random16 is None, else stochastically by
    adding random16 (uniform in [0, 2**16)) to the bits and truncating, so the expected value is x. NaN stays NaN."""
    if random16 is None:
        return x.to(torch.bfloat16)
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    top = ((bits + random16) & _M32) >> 16
    top = torch.where(torch.isnan(x), torch.full_like(top, 0xFFFF), top)
    return torch.where(top >= 0x8000, top - 0x10000, top).to(torch.int16).view(torch.bfloat16).view(x.shape)


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, adamw: bool,
               grad_scale: float = 1.0, param_out: torch.Tensor | None = None, sr_seed: int | None = None,
               sr_offset: int = 0) -> None:
    """One Adam/AdamW step in place, with torch.optim.Adam/AdamW's exact formulas (single-tensor path).

    param (the master), exp_avg, exp_avg_sq: fp32, or bf16 (DeepSpeed's bf16_master_weights_and_grads and
    bf16_optimizer_states): a bf16 tensor is read exactly, the step computed in fp32 from it, and the result
    stored rounded to nearest even, or stochastically when sr_seed is given (random bits from
    stochastic_bits(sr_seed, sr_offset, n): the same on every backend). grad: fp32/fp16/bf16, multiplied by
    grad_scale after the upcast (zkern folds loss-scale unscaling, clipping and the 1/world average into that
    one factor). step: the step count after this update (1 on the first step). param_out: optional buffer that
    receives the stored master's value in its own dtype.
    """
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype not in _STATE_DTYPES:
            raise TypeError(f"adam_step_: {name} must be float32 or bfloat16, got {t.dtype}")
        if t.shape != param.shape:
            raise ValueError(f"adam_step_: {name} has shape {tuple(t.shape)}, param has {tuple(param.shape)}")
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise TypeError(f"adam_step_: exp_avg is {exp_avg.dtype} and exp_avg_sq {exp_avg_sq.dtype}; the moments "
                        f"share one dtype")
    _check_float("grad", grad)
    if grad.shape != param.shape:
        raise ValueError(f"adam_step_: grad has shape {tuple(grad.shape)}, param has {tuple(param.shape)}")
    if step < 1:
        raise ValueError(f"adam_step_: step counts from 1, got {step}")
    if param_out is not None and param_out.shape != param.shape:
        raise ValueError(f"adam_step_: param_out has shape {tuple(param_out.shape)}, param has {tuple(param.shape)}")
    if param.dtype == exp_avg.dtype == torch.float32:
        _adam_fp32_(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, adamw, grad_scale)
        if param_out is not None:
            param_out.copy_(param)
        return
    # bf16 state: the same fp32 arithmetic on fp32 copies, then each stored rounded.
    p, m, v = param.float(), exp_avg.float(), exp_avg_sq.float()
    _adam_fp32_(p, grad, m, v, step, lr, betas, eps, weight_decay, adamw, grad_scale)
    first = second = None
    if sr_seed is not None:
        first, second = stochastic_bits(sr_seed, sr_offset, param.numel(), param.device)
        first, second = first.view(param.shape), second.view(param.shape)
    for target, value, random16 in ((param, p, None if second is None else second & 0xFFFF),
                                    (exp_avg, m, None if first is None else first & 0xFFFF),
                                    (exp_avg_sq, v, None if first is None else first >> 16)):
        target.copy_(value if target.dtype == torch.float32 else round_bf16(value, random16))
    if param_out is not None:
        param_out.copy_(param)


def _adam_fp32_(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, adamw, grad_scale) -> None:
    beta1, beta2 = betas
    g = grad.float() if grad.dtype != torch.float32 else grad
    if weight_decay != 0.0:
        if adamw:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g * grad_scale if grad_scale != 1.0 else g
            grad_scale = 1.0
            g = g.add(param, alpha=weight_decay)
    if grad_scale == 1.0:
        exp_avg.lerp_(g, 1.0 - beta1)  # torch's formula, bit for bit
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    else:
        # The scale folded into the coefficients: no full-size temporary (on a CPU every fresh large buffer
        # page-faults), at the price of a last-place rounding difference from lerp.
        exp_avg.mul_(beta1).add_(g, alpha=(1.0 - beta1) * grad_scale)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=(1.0 - beta2) * grad_scale * grad_scale)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    step_size = lr / bias_correction1
    denom = exp_avg_sq.sqrt()
    denom.div_(bias_correction2**0.5).add_(eps)  # in place: one temporary instead of torch's two, same values
    param.addcdiv_(exp_avg, denom, value=-step_size)


def unflatten_into_(flat: torch.Tensor, tensors: list[torch.Tensor], *, align: int = 1) -> None:
    """Copy flat's elements back into each tensor in place (cast to its dtype), laid out as flatten(align=) did."""
    offsets, offset = [], 0
    for t in tensors:
        offsets.append(offset)
        offset += t.numel() + (-t.numel()) % align
    if flat.dim() != 1 or flat.numel() < offset:
        raise ValueError(f"unflatten_into_ needs a 1-D buffer of at least {offset} elements, got {tuple(flat.shape)}")
    for t, start in zip(tensors, offsets):
        t.copy_(flat[start:start + t.numel()].view(t.shape))


# Blockwise symmetric quantization (ZeRO++: int8 weights for the all-gather, int4 gradients for the reduce).
#   scale  per group of group_size consecutive elements (the last group may be shorter): absmax / qmax, qmax =
#          127 (int8) or 7 (int4). An all-zero group has scale 0 and codes 0. A group holding a NaN or an
#          infinity has scale NaN and codes 0, so that its dequantized values are NaN and an overflow check
#          after the collective still sees it.
#   code   round-half-away-from-zero(x * (1 / scale)), both products in fp32, clamped to [-qmax, qmax].
#   int8   one int8 per element. int4: two per uint8, element 2i in the low nibble, each stored as code + 8.
QMAX = {8: 127, 4: 7}


def _check_quant(bits: int, group_size: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"quantization bits must be 8 or 4, got {bits}")
    if group_size < 2 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 2 (kernel tiles are), got {group_size}")


def check_quantize_args(x: torch.Tensor, bits: int, group_size: int) -> None:
    """quantize's argument rules, which every backend applies."""
    _check_quant(bits, group_size)
    if x.dim() != 1:
        raise ValueError(f"quantize takes a 1-D tensor (flatten it first), got shape {tuple(x.shape)}")


def quant_outputs(numel: int, bits: int, group_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (codes, scales) for numel values: int8 codes, or packed uint8 (two a byte); one fp32 scale a group."""
    codes = torch.empty(numel if bits == 8 else (numel + 1) // 2, dtype=torch.int8 if bits == 8 else torch.uint8,
                        device=device)
    return codes, torch.empty((numel + group_size - 1) // group_size, dtype=torch.float32, device=device)


def check_hop_args(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
                   out_bits: int) -> None:
    """dequant_sum_requant's argument rules, which every backend applies (out_bits 0: the sum alone)."""
    _check_quant(bits, group_size)
    if out_bits:
        _check_quant(out_bits, group_size)
    if q.dim() != 2 or scales.dim() != 2 or q.shape[0] != scales.shape[0]:
        raise ValueError(f"dequant_sum_requant takes q (world, codes) and scales (world, groups), got "
                         f"{tuple(q.shape)} and {tuple(scales.shape)}")
    need_codes, need_groups = numel if bits == 8 else (numel + 1) // 2, (numel + group_size - 1) // group_size
    if q.shape[1] < need_codes or scales.shape[1] < need_groups:
        raise ValueError(f"dequant_sum_requant: {numel} elements need {need_codes} codes and {need_groups} scales "
                         f"a chunk, got {q.shape[1]} and {scales.shape[1]}")


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a 1-D float tensor; see the block comment above for the exact rules."""
    _check_float("x", x)
    _check_quant(bits, group_size)
    if x.dim() != 1:
        raise ValueError(f"quantize takes a 1-D tensor (flatten it first), got shape {tuple(x.shape)}")
    n, qmax = x.numel(), QMAX[bits]
    groups = (n + group_size - 1) // group_size
    padded = torch.zeros(groups * group_size, dtype=torch.float32, device=x.device)
    padded[:n] = x.float()
    g = padded.view(groups, group_size)
    bad = (~torch.isfinite(g)).any(dim=1)
    absmax = torch.where(bad, torch.zeros_like(bad, dtype=torch.float32), g.abs().amax(dim=1))
    # A tensor divisor: torch divides a CUDA tensor by a Python number as a multiplication by its reciprocal, which
    # is not the correctly rounded quotient every kernel and the CPU compute (one bit off on an H100).
    scales = absmax / torch.full_like(absmax, qmax)
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    y = torch.where(bad[:, None], torch.zeros_like(g), g * inv[:, None])
    codes = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-qmax, qmax).reshape(-1)[:n]
    scales = torch.where(bad, torch.full_like(scales, float("nan")), scales)
    if bits == 8:
        return codes.to(torch.int8), scales
    stored = (codes + 8).to(torch.uint8)
    if n % 2:
        stored = torch.cat([stored, torch.full((1,), 8, dtype=torch.uint8, device=x.device)])
    return stored[0::2] | (stored[1::2] << 4), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The numel values that quantize encoded: code * scale in fp32, cast to dtype."""
    _check_quant(bits, group_size)
    if bits == 8:
        codes = q.float()[:numel]
    else:
        codes = torch.stack([(q & 0xF).float(), (q >> 4).float()], dim=1).reshape(-1)[:numel] - 8.0
    groups = torch.arange(numel, device=q.device) // group_size
    return (codes * scales.float()[groups]).to(dtype)


def dequant_sum(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int) -> torch.Tensor:
    """Sum over the first dimension (ranks, in order) of quantized chunks, in fp32: the receive side of a quantized
    reduce-scatter. q: (world, codes per chunk), scales: (world, groups per chunk)."""
    if q.dim() != 2 or scales.dim() != 2 or q.shape[0] != scales.shape[0]:
        raise ValueError(f"dequant_sum takes q (world, codes) and scales (world, groups), got {tuple(q.shape)} and "
                         f"{tuple(scales.shape)}")
    total = torch.zeros(numel, dtype=torch.float32, device=q.device)
    for r in range(q.shape[0]):
        total += dequantize(q[r], scales[r], bits, group_size, numel)
    return total


def dequant_sum_requant(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
                        out_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qgZ's hop: the fp32 sum over ranks of quantized chunks (dequant_sum), and that sum quantized again with
    out_bits for the next hop: (sum, codes, scales). The CUDA kernel does it in one pass."""
    total = dequant_sum(q, scales, bits, group_size, numel)
    return (total, *quantize(total, out_bits, group_size))


def aligned_segments(n: int, tensors: list[torch.Tensor]) -> list[tuple[int, int, bool]]:
    """A GPU launcher's split (Triton and CUDA alike): [(start, stop, body)] covering range(n) for an element-wise
    kernel over tensors of n elements each: a head of fewer than 16 elements until every tensor's address is
    16-byte aligned, a body whose length is a multiple of 16 elements (so a kernel moves it with 128-bit loads and
    stores, unmasked within a vector), and a tail of fewer than 16. Where no head aligns every tensor (two tensors
    out of phase), the whole range is one unaligned launch. Empty segments are left out."""
    head = next((h for h in range(16) if h <= n and all((t.data_ptr() + h * t.element_size()) % 16 == 0
                                                        for t in tensors)), None)
    if head is None:
        return [(0, n, False)]
    body = (n - head) // 16 * 16
    segments = [(0, head, False), (head, head + body, True), (head + body, n, False)]
    return [s for s in segments if s[1] > s[0]]
