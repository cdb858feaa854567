"""The CUDA kernels' arithmetic, checked without a GPU: zkern/csrc/zk_adam.h and zk_quant.h are the per-element
code zkern/cuda/csrc/*.cu run, and the CPU extension compiles the same headers (zkern.cpu._ext: adam_step_ with
isa="shared", quantize, dequant_sum_requant run them element by element in the kernels' order).

    python -m pytest tests/kernels/test_cuda_shared.py -q

Adam: equal bit for bit to the CPU scalar path (the same formulas and host fma) and within the arithmetic's drift
bound of torch's own Adam/AdamW over ten steps; quantization and qgZ's fused hop: equal bit for bit to
zkern/reference.py, with ragged lengths and groups, all-zero groups and groups holding an infinity or a NaN.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_adam import assert_adam_close, run_both

from zkern import reference
from zkern.cpu import _ext

STATE_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                (torch.bfloat16, torch.float32)]

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)

@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_cuda_adam_element_matches_torch_over_ten_steps(grad_dtype, adamw):
    zkern_state, torch_state, grads = run_both(1031, grad_dtype, adamw, "shared")
    assert_adam_close(zkern_state, torch_state, grads, adamw, 1.0, "the CUDA element code on the host")

@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("master,state", STATE_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_the_cuda_adam_element_is_the_cpu_scalar_path_bit_for_bit(master, state, out_dtype, stochastic):
    """Every dtype combination, rounding mode and copy: the same bits as the CPU scalar kernel, which
    tests/kernels/test_cpu_adam.py and tests/optim/test_bf16_state.py hold to torch and to an fp64 step."""
    gen = torch.Generator().manual_seed(3)
    n = 517
    start = [torch.randn(n, generator=gen).to(master), (torch.randn(n, generator=gen) * 0.1).to(state),
             (torch.rand(n, generator=gen) * 0.01).to(state)]
    for grad_dtype in (torch.float32, torch.float16, torch.bfloat16):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        got = {}
        for isa in ("scalar", "shared"):
            p, m, v = (t.clone() for t in start)
            out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
            for step in (1, 2, 3):
                _ext.adam_step_(p, grad, m, v, step=step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                adamw=step != 2, grad_scale=0.5, param_out=out, sr_seed=11 if stochastic else None,
                                sr_offset=40, isa=isa)
            got[isa] = [p, m, v] + ([] if out is None else [out])
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "param_out"), got["scalar"], got["shared"]):
            assert torch.equal(_bits(a), _bits(b)), f"{name}: grad {grad_dtype}"

def _values(n: int, dtype: torch.dtype, gen: torch.Generator, group: int) -> torch.Tensor:
    x = torch.randn(n, generator=gen) * 3
    x[:group] = 0.0  # an all-zero group: scale 0, codes 0
    if n > 3 * group:
        x[group + 1] = float("inf")  # a group with an infinity, one with a NaN: scale NaN, codes 0
        x[2 * group + 2] = float("nan")
    return x.to(dtype)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [8, 4])
def test_the_cuda_quantize_element_code_is_the_reference_bit_for_bit(bits, dtype):
    gen = torch.Generator().manual_seed(bits)
    for n in (1, 2, 31, 512, 1000, 4099):
        for group in (2, 32, 256):
            x = _values(n, dtype, gen, group)
            codes, scales = _ext.quantize(x, bits, group)
            ref_codes, ref_scales = reference.quantize(x, bits, group)
            assert codes.dtype == ref_codes.dtype and torch.equal(codes, ref_codes), (n, group)
            assert torch.equal(_bits(scales), _bits(ref_scales)) or torch.equal(scales.nan_to_num(-1),
                                                                                ref_scales.nan_to_num(-1)), (n, group)

@pytest.mark.parametrize("in_bits,out_bits", [(4, 4), (8, 8), (8, 4), (4, 8)])
def test_the_cuda_fused_hop_is_dequant_sum_then_quantize_bit_for_bit(in_bits, out_bits):
    """qgZ's hop: every rank's chunk dequantized, summed in rank order in fp32, and requantized for the next hop."""
    gen = torch.Generator().manual_seed(in_bits * 10 + out_bits)
    for world in (1, 3):
        for n, group in ((1000, 64), (4096, 512), (33, 2)):
            chunks = [reference.quantize(_values(n, torch.float32, gen, group) if r == 1 else
                                         torch.randn(n, generator=gen), in_bits, group) for r in range(world)]
            q = torch.stack([c for c, _ in chunks])
            s = torch.stack([sc for _, sc in chunks])
            got = _ext.dequant_sum_requant(q, s, in_bits, group, n, out_bits)
            want = reference.dequant_sum_requant(q, s, in_bits, group, n, out_bits)
            for name, a, b in zip(("sum", "codes", "scales"), got, want):
                assert torch.equal(a.nan_to_num(-1), b.nan_to_num(-1)), (name, world, n, group)
            assert torch.equal(got[0].nan_to_num(-1), reference.dequant_sum(q, s, in_bits, group, n).nan_to_num(-1))

def test_bad_input_to_the_shared_quantization_is_refused():
    with pytest.raises(ValueError, match="power of two"):
        _ext.quantize(torch.zeros(8), 8, 3)
    with pytest.raises(ValueError, match="1-D"):
        _ext.quantize(torch.zeros(2, 4), 8, 2)
    with pytest.raises(ValueError, match="need"):
        _ext.dequant_sum_requant(torch.zeros(2, 4, dtype=torch.int8), torch.zeros(2, 2), 8, 2, 100, 4)
