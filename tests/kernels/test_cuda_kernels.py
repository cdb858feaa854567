"""The CUDA C++ kernels (zkern/cuda) on a GPU, against zkern/reference.py: they run here only where torch has CUDA
and nvcc and ninja are installed (`python bench/run.py --suite gpu` runs the gpu-marked tests first). Without a
GPU their per-element code is tested by tests/kernels/test_cuda_shared.py and their compilation by the gpu-static gate.

    python -m pytest tests/kernels/test_cuda_kernels.py -q
"""

from __future__ import annotations

import functools

import pytest
import torch

from zkern import reference
from zkern.cpu import _ext

cuda_kernels = pytest.importorskip("zkern.cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(cuda_kernels.why_unavailable() is not None,
                                 reason=f"the CUDA kernels cannot run here: {cuda_kernels.why_unavailable()}")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


@pytest.mark.parametrize("master,state", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                          (torch.bfloat16, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("offset", [0, 3])  # a sub-range that starts off a 16-byte boundary takes the element path
@pytest.mark.parametrize("n", [1, 1000, 70_001])
def test_adam_is_the_host_run_of_its_element_code_bit_for_bit(n, offset, master, state):
    """The kernel's arithmetic is zk_adam.h's, which the CPU extension runs on the host (isa="shared"): the same bits,
    which tests/kernels/test_cuda_shared.py holds to the CPU scalar path and to torch's Adam. (Against torch's own
    Adam on CUDA the kernel differs in rounding where a sum cancels: torch's order of operations is not the
    kernel's.)"""
    gen = torch.Generator().manual_seed(n)
    base = [torch.randn(n + offset, generator=gen), torch.randn(n + offset, generator=gen) * 0.1,
            torch.rand(n + offset, generator=gen) * 0.01, torch.randn(n + offset, generator=gen)]
    dtypes = (master, state, state, torch.bfloat16)
    for adamw in (True, False):
        got, want = [], []
        for device, out in (("cuda", got), ("cpu", want)):
            p, m, v, g = (t.to(device=device, dtype=d)[offset:] for t, d in zip(base, dtypes))
            copy = torch.empty(n, dtype=torch.bfloat16, device=device)
            fn = cuda_kernels.adam_step_ if device == "cuda" else functools.partial(_ext.adam_step_, isa="shared")
            for step in (1, 2):
                fn(p, g, m, v, step=step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw=adamw,
                   grad_scale=0.5, param_out=copy)
            out += [p.cpu(), m.cpu(), v.cpu(), copy.cpu()]
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "copy"), got, want):
            assert torch.equal(_bits(a), _bits(b)), f"{name}: {int((_bits(a) != _bits(b)).sum())} of {n} differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_is_the_reference_bit_for_bit(bits, dtype):
    gen = torch.Generator().manual_seed(bits)
    for n, group in ((4096, 256), (1000, 64), (33, 2)):
        x = (torch.randn(n, generator=gen) * 3).to(dtype)
        x[:group] = 0
        codes, scales = cuda_kernels.quantize(x.cuda(), bits, group)
        ref_codes, ref_scales = reference.quantize(x, bits, group)
        assert torch.equal(codes.cpu(), ref_codes) and torch.equal(_bits(scales.cpu()), _bits(ref_scales))


@pytest.mark.parametrize("in_bits,out_bits", [(4, 4), (8, 8), (8, 4), (4, 0)])
def test_the_fused_hop_is_the_reference_bit_for_bit(in_bits, out_bits):
    gen = torch.Generator().manual_seed(in_bits + out_bits)
    for world, n, group in ((2, 4096, 512), (3, 1000, 64)):
        chunks = [reference.quantize(torch.randn(n, generator=gen), in_bits, group) for _ in range(world)]
        q, s = torch.stack([c for c, _ in chunks]), torch.stack([sc for _, sc in chunks])
        got = cuda_kernels.dequant_sum_requant(q.cuda(), s.cuda(), in_bits, group, n, out_bits)
        want = reference.dequant_sum(q, s, in_bits, group, n)
        assert torch.equal(got[0].cpu(), want)
        if out_bits:
            ref_codes, ref_scales = reference.quantize(want, out_bits, group)
            assert torch.equal(got[1].cpu(), ref_codes) and torch.equal(got[2].cpu(), ref_scales)
